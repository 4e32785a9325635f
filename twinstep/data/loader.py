"""The trainer's data: step s's global batch is a pure function of (seed, s) — the sampler's
indices (`twinstep.data.batches.indices`), each row's augmentation drawn from its own generator
seeded by (seed, s, row), the step's mix from one seeded by (seed, s, micro-batch) — so a resumed
run draws exactly the batches the uninterrupted one would have, and the number of loader workers
cannot change them. The data iterator's whole state is therefore the step, which every
checkpoint holds.

Two sources: the embedded digits (`twinstep.data.digits`, already at S x S, not augmented — a
flipped or cropped digit is another digit) and an image folder (`twinstep.data.folder`): timm's
train transform with the recipe's RandAugment, its mixup / CutMix over the global batch, and
timm's eval transform. Batches are built by grain: ``workers`` processes each build whole
batches (0: one background thread), a few steps ahead of the step that runs.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np

from twinstep.data import batches, digits, folder, mix, transforms
from twinstep.errors import UsageError

PREFETCH = 2  # batches built ahead of the step that runs, per worker
CROP_PCT = 0.95  # timm's eval crop for both nets' recipes


@dataclasses.dataclass(frozen=True)
class Augment:
    """The recipe's augmentation of a training batch: RandAugment's magnitude (None: off), the
    mix (None: off)."""

    randaugment: int | None = None
    mix: mix.MixParams | None = None


class Digits:
    """The embedded digits at S x S (normalised already; no augmentation)."""

    def __init__(self, res: int):
        self.res = res
        self.train_labels = digits.split("train", res)[1]
        self.val_labels = digits.split("val", res)[1]
        self.classes = digits.CLASSES

    def train_rows(self, idx: np.ndarray, seed: int, step: int, first_row: int,
                   augment: Augment) -> tuple[np.ndarray, np.ndarray, int]:
        images, labels = digits.split("train", self.res)
        return images[idx], labels[idx], 0

    def val_rows(self, idx: np.ndarray) -> tuple[np.ndarray, int]:
        return digits.split("val", self.res)[0][idx], 0


class Folder:
    """An ImageFolder tree (`twinstep.data.folder`) through timm's transforms at S x S. An image
    that does not decode is replaced by the next one of its split (counted, never fatal)."""

    def __init__(self, root: str, res: int):
        self.res = res
        self.train, self.val = folder.scan_both(root)
        self.classes = len(self.train.classes)
        self.train_labels, self.val_labels = self.train.labels, self.val.labels

    @staticmethod
    def _decoded(split: folder.Split, i: int):
        """(image, index used, skipped): the first image from i on that decodes."""
        for tried in range(len(split)):
            j = (i + tried) % len(split)
            img = folder.load(split.paths[j])
            if img is not None:
                return img, j, tried
        raise UsageError(f"no image of {len(split)} in this split decodes")

    def train_rows(self, idx, seed, step, first_row, augment):
        rows, labels, skipped = [], [], 0
        for j, i in enumerate(idx):
            img, used, tried = self._decoded(self.train, int(i))
            rng = np.random.default_rng([seed, step, 0, first_row + j])
            rows.append(transforms.train_transform(img, self.res, rng, augment.randaugment))
            labels.append(self.train.labels[used])
            skipped += tried
        return transforms.normalize(np.stack(rows)), np.asarray(labels, np.int32), skipped

    def val_rows(self, idx):
        rows, skipped = [], 0
        for i in idx:
            img, _, tried = self._decoded(self.val, int(i))
            rows.append(transforms.eval_transform(img, self.res, CROP_PCT))
            skipped += tried
        return transforms.normalize(np.stack(rows)), skipped


def train_size(data: str) -> int:
    """How many training images ``data`` holds (a folder is scanned)."""
    if data == "digits":
        return len(digits.labels("train"))
    return len(folder.scan(data, "train"))


def source(data: str, res: int):
    """``digits`` or an image folder's root."""
    return Digits(res) if data == "digits" else Folder(data, res)


def train_batch(src, augment: Augment, seed: int, step: int, micro: int, rows: int,
                dtype) -> tuple[np.ndarray, np.ndarray, int]:
    """(xs [k, R N, S, S, 3], ts [k, R N, K], images skipped) of step ``step``: k micro-batches
    of R N rows, each mixed over its R N rows when the recipe mixes."""
    idx = batches.indices(seed, step, micro * rows, len(src.train_labels)).reshape(micro, rows)
    xs, ts, skipped = [], [], 0
    for m in range(micro):
        x, labels, sk = src.train_rows(idx[m], seed, step, m * rows, augment)
        if augment.mix is not None:
            lam, box = mix.draw(np.random.default_rng([seed, step, 1, m]), augment.mix,
                                x.shape[1], x.shape[2])
            x, t = mix.apply(x, labels, src.classes, lam, box)
        else:
            t = batches.one_hot(labels, src.classes, np.float32)
        xs.append(x)
        ts.append(t)
        skipped += sk
    return np.stack(xs).astype(dtype), np.stack(ts).astype(dtype), skipped


def val_batch(src, rows: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The b-th eval batch of ``rows``: (x, labels, valid, images skipped); the last batch is
    padded and masked (`twinstep.data.batches.eval_rows`)."""
    idx, valid = batches.eval_rows(b, rows, len(src.val_labels))
    x, skipped = src.val_rows(idx)
    return x, src.val_labels[idx], valid, skipped


def val_batch_count(src, rows: int) -> int:
    return -(-len(src.val_labels) // rows)


def stream(make, start: int, stop: int, workers: int):
    """A generator of ``make(i)`` for i in [start, stop), built ahead by grain: ``workers``
    processes, or one background thread when 0; close it to stop them. ``make`` must pickle (a
    module function or a partial of one)."""
    import grain

    dataset = grain.MapDataset.range(start, stop).map(make)
    if workers == 0:
        return _owned(iter(dataset.to_iter_dataset(grain.ReadOptions(
            num_threads=1, prefetch_buffer_size=PREFETCH))))
    from absl import flags

    if not flags.FLAGS.is_parsed():  # grain's workers read its absl flags; no absl main here
        flags.FLAGS.mark_as_parsed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # os.fork() in a threaded process
        it = iter(dataset.to_iter_dataset(grain.ReadOptions(num_threads=0)).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=PREFETCH)))
    return _owned(it)


def _owned(it):
    """The items of a worker stream copied out of grain's shared memory, each block freed as
    soon as it is copied: grain frees them on a thread pool, and one still queued when the
    interpreter exits is reported as leaked — so the pool is drained when the stream ends."""
    from grain._src.python.ipc import shared_memory_array  # no public hook for this

    try:
        for item in it:
            yield tuple(np.array(a) if isinstance(a, np.ndarray) else a for a in item)
            del item
    finally:
        pool = shared_memory_array.SharedMemoryArray._del_thread_pool
        if pool is not None:
            shared_memory_array.SharedMemoryArray._disable_async_del()
            pool.close()
            pool.join()


def train_stream(src, augment, seed, start, stop, micro, rows, dtype, workers):
    """train_batch for the steps [start, stop), in order."""
    return stream(functools.partial(_train_item, src, augment, seed, micro, rows, dtype),
                  start, stop, workers)


def _train_item(src, augment, seed, micro, rows, dtype, step):
    return train_batch(src, augment, seed, step, micro, rows, dtype)


def val_stream(src, rows: int, workers: int):
    return stream(functools.partial(val_batch, src, rows), 0, val_batch_count(src, rows),
                  workers)
