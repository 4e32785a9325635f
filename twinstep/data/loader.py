"""The trainer's data: step s's global batch is a pure function of (seed, s) — the sampler's
indices (`twinstep.data.batches.indices`), each row's augmentation drawn from its own generator
seeded by (seed, s, row), the step's mix from one seeded by (seed, s, micro-batch) — so a resumed
run draws exactly the batches the uninterrupted one would have, and the number of loader workers
cannot change them. The data iterator's whole state is therefore the step, which every
checkpoint holds.

The host delivers what the devices cannot make: an image folder's rows as uint8 crops, their
labels, and each micro-batch's drawn mix (`Batch`). Normalisation, the mix over the global batch
and the targets are computed on the devices, beside the step (`twinstep.program
.prepare_program`): a quarter of the bytes cross to the devices, and a process decodes only its
own rows.

The rows come from a source (`twinstep.data.sources`: the digits, or an image dataset decoded by
a loader). Batches are built a few steps ahead of the step that runs: by one background thread
(grain) or by ``workers`` processes (`twinstep.data.workers`), each building whole batches.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from twinstep.data import batches, mix, sources
from twinstep.data import workers as workers_module
from twinstep.data.sources import Augment, Source

PREFETCH = 2  # batches built ahead of the step that runs, per worker


class Batch(NamedTuple):
    """One step's rows as the host delivers them (`train_batch`)."""

    xs: np.ndarray  # [k, rows, S, S, 3]: uint8 crops of an image folder, float32 digits
    labels: np.ndarray  # [k, rows] int32
    mix: np.ndarray  # [k, 2] float32: (λ, 1 - λ) of each micro-batch's mix, (1, 0) unmixed
    box: np.ndarray  # [k, 4] int32: its CutMix box (y_lo, y_hi, x_lo, x_hi), empty for a blend
    plan: np.ndarray  # [k, rows, P] int32: the devices' work on each row (xs are canvases),
    # P = 0 where xs are the crops (`twinstep.data.sources.Source.train_rows`)
    skipped: tuple  # train images (indices) that did not decode, replaced by the next


def train_batch(src: Source, augment: Augment, *, seed: int, step: int, micro: int, rows: int,
                part: slice | None = None) -> Batch:
    """Step ``step``'s k micro-batches of R N rows as the host delivers them (`Batch`), each
    micro-batch's mix drawn for all its R N rows (row i mixed with row R N - 1 - i, on the
    devices). ``part``: only these rows (a process's own, `twinstep.processes.cluster
    .local_rows`), each equal to its row of the whole batch."""
    idx = batches.indices(seed, step, micro * rows, len(src.train_labels)).reshape(micro, rows)
    own = np.arange(rows)[part if part is not None else slice(None)]
    xs, labels, mixes, boxes, plans, skipped = [], [], [], [], [], ()
    for m in range(micro):
        x, y, sk, plan = src.train_rows(idx[m][own], seed, step, m * rows + own, augment)
        lam, box = 1.0, None
        if augment.mix is not None:
            lam, box = mix.draw(np.random.default_rng([seed, step, 1, m]), augment.mix,
                                src.res, src.res)
        xs.append(x)
        labels.append(y)
        # (λ, 1 - λ) rounded as timm's float32 tensors are scaled by a Python float
        mixes.append((np.float32(lam), np.float32(1.0 - lam)))
        boxes.append(box or (0, 0, 0, 0))
        plans.append(plan)
        skipped += sources.skipped_images(idx[m][own], sk, len(src.train_labels))
    return Batch(_stacked(xs), np.stack(labels), np.asarray(mixes, np.float32),
                 np.asarray(boxes, np.int32), _stacked(plans), skipped)


def _stacked(parts: list) -> np.ndarray:
    """np.stack(parts), without copying a single part (a device loader's canvases: 786 KB a row
    at 224²)."""
    return parts[0][None] if len(parts) == 1 else np.stack(parts)


def val_batch(src, rows: int, b: int,
              part: slice | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple]:
    """The b-th eval batch of ``rows``: (x, labels, valid, val images (indices) skipped); the
    last batch is padded and masked (`twinstep.data.batches.eval_rows`). ``part``: only these
    rows."""
    idx, valid = batches.eval_rows(b, rows, len(src.val_labels))
    idx, valid = idx[part or slice(None)], valid[part or slice(None)]
    x, skipped = src.val_rows(idx)
    return x, src.val_labels[idx], valid, sources.skipped_images(idx, skipped,
                                                                  len(src.val_labels))


def val_batch_count(src, rows: int) -> int:
    return -(-len(src.val_labels) // rows)


def stream(make, start: int, stop: int, workers: int):
    """A generator of ``make(i)`` for i in [start, stop), built ahead: by one background thread
    (grain) when ``workers`` is 0, else by that many processes (`twinstep.data.workers`); close
    it to stop them. ``make`` must pickle (a module function or a partial of one)."""
    if workers > 0:
        yield from workers_module.stream(make, start, stop, workers, PREFETCH)
        return
    # lazy: grain imports JAX, and loader workers (spawned processes) import this module
    import grain

    dataset = grain.MapDataset.range(start, stop).map(make)
    yield from dataset.to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                         prefetch_buffer_size=PREFETCH))


def train_stream(src, augment, *, seed, start, stop, micro, rows, workers, part=None):
    """train_batch for the steps [start, stop), in order."""
    return stream(functools.partial(_train_item, src=src, augment=augment, seed=seed,
                                    micro=micro, rows=rows, part=part), start, stop, workers)


def _train_item(step, *, src, augment, seed, micro, rows, part):
    return train_batch(src, augment, seed=seed, step=step, micro=micro, rows=rows, part=part)


def val_stream(src, rows: int, workers: int, part: slice | None = None):
    return stream(functools.partial(val_batch, src, rows, part=part), 0,
                  val_batch_count(src, rows), workers)
