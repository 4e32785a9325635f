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

Two sources: the embedded digits (`twinstep.data.digits`, already at S x S, not augmented — a
flipped or cropped digit is another digit) and an image folder (`twinstep.data.folder`): timm's
train transform with the recipe's RandAugment, its mixup / CutMix over the global batch, and
timm's eval transform. Batches are built a few steps ahead of the step that runs: by one
background thread (grain) or by ``workers`` processes (`twinstep.data.workers`), each building
whole batches.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from twinstep.data import batches, digits, folder, mix, packed, transforms
from twinstep.data import workers as workers_module
from twinstep.errors import UsageError

LOADERS = ("pillow", "dali")  # who decodes and augments an image folder
PREFETCH = 2  # batches built ahead of the step that runs, per worker


@dataclasses.dataclass(frozen=True)
class Augment:
    """The recipe's augmentation of a training batch: RandAugment's magnitude (None: off), the
    mix (None: off)."""

    randaugment: int | None = None
    mix: mix.MixParams | None = None


class Batch(NamedTuple):
    """One step's rows as the host delivers them (`train_batch`)."""

    xs: np.ndarray  # [k, rows, S, S, 3]: uint8 crops of an image folder, float32 digits
    labels: np.ndarray  # [k, rows] int32
    mix: np.ndarray  # [k, 2] float32: (λ, 1 - λ) of each micro-batch's mix, (1, 0) unmixed
    box: np.ndarray  # [k, 4] int32: its CutMix box (y_lo, y_hi, x_lo, x_hi), empty for a blend
    skipped: int  # images that did not decode, replaced by the next of their split


class Digits:
    """The embedded digits at S x S, the val split at ``eval_res`` (normalised already,
    float32; no augmentation)."""

    def __init__(self, res: int, eval_res: int | None = None):
        self.res, self.eval_res = res, eval_res or res
        self.train_labels = digits.split("train", res)[1]
        self.val_labels = digits.split("val", self.eval_res)[1]
        self.classes = digits.CLASSES

    def train_rows(self, idx: np.ndarray, seed: int, step: int, row_ids: np.ndarray,
                   augment: Augment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images, labels, images skipped per row) of dataset rows ``idx``, which are rows
        ``row_ids`` of step ``step``'s batch (what seeds their augmentation)."""
        images, labels = digits.split("train", self.res)
        return images[idx], labels[idx], np.zeros(len(idx), np.int64)

    def val_rows(self, idx: np.ndarray) -> tuple[np.ndarray, int]:
        return digits.split("val", self.eval_res)[0][idx], 0


class Folder:
    """An ImageFolder tree (`twinstep.data.folder`) through timm's transforms: train crops at
    S x S, val crops at ``eval_res`` (default S). An image that does not decode is replaced by
    the next one of its split (counted, never fatal)."""

    def __init__(self, root: str, res: int, eval_res: int | None = None):
        self._open(folder.scan_both(root), res, eval_res)

    def _open(self, splits, res: int, eval_res: int | None) -> None:
        self.res, self.eval_res = res, eval_res or res
        self.train, self.val = splits
        self.classes = len(self.train.classes)
        self.train_labels, self.val_labels = self.train.labels, self.val.labels

    @staticmethod
    def _decoded(split, i: int):
        """(image, index used, skipped): the first image from i on that decodes."""
        for tried in range(len(split)):
            j = (i + tried) % len(split)
            img = split.image(j)
            if img is not None:
                return img, j, tried
        raise UsageError(f"no image of {len(split)} in this split decodes")

    def train_rows(self, idx, seed, step, row_ids, augment):
        """(uint8 crops [len(idx), S, S, 3], labels, images skipped per row)."""
        rows, labels, skipped = [], [], []
        for i, row in zip(idx, row_ids, strict=True):
            img, used, tried = self._decoded(self.train, int(i))
            rng = np.random.default_rng([seed, step, 0, int(row)])
            rows.append(transforms.train_transform(img, self.res, rng, augment.randaugment))
            labels.append(self.train.labels[used])
            skipped.append(tried)
        return np.stack(rows), np.asarray(labels, np.int32), np.asarray(skipped, np.int64)

    def val_rows(self, idx):
        """(uint8 [len(idx), E, E, 3] at E = eval_res, images skipped)."""
        rows, skipped = [], 0
        for i in idx:
            img, _, tried = self._decoded(self.val, int(i))
            rows.append(transforms.eval_transform(img, self.eval_res, transforms.CROP_PCT))
            skipped += tried
        return np.stack(rows), skipped


class Packed(Folder):
    """A packed image folder (`twinstep.data.packed`, ``twinstep pack``): its images, read from
    ArrayRecord shards, through the same transforms; every image decodes (checked when packed)."""

    def __init__(self, root: str, res: int, eval_res: int | None = None):
        self._open(packed.open_splits(root), res, eval_res)


def train_size(data: str) -> int:
    """How many training images ``data`` holds (a folder is scanned)."""
    if data == "digits":
        return len(digits.labels("train"))
    if packed.is_packed(data):
        return len(packed.open_splits(data)[0])
    return len(folder.scan(data, "train"))


def check_loader(kind: str, data: str) -> None:
    """UsageError (one line) unless ``kind`` can read ``data``."""
    if kind not in LOADERS:
        raise UsageError(f"unknown --loader {kind!r}; choose from {', '.join(LOADERS)}")
    if kind == "dali":
        from twinstep.data import dali

        if data == "digits":
            raise UsageError("--loader dali decodes images: give --data an image folder or a "
                             "packed one (the digits are arrays already)")
        if (why := dali.available()) is not None:
            raise UsageError(why)


def source(data: str, res: int, kind: str = "pillow", threads: int = 0,
           eval_res: int | None = None):
    """``digits``, a packed folder (``twinstep pack``) or an image folder's root, decoded by
    Pillow (in ``threads`` worker processes, `stream`) or by DALI (on ``threads`` threads of
    its own, and on the GPU when JAX has one: `twinstep.data.dali`); train crops at ``res``,
    val crops at ``eval_res`` (default ``res``)."""
    check_loader(kind, data)
    if data == "digits":
        return Digits(res, eval_res)
    if kind == "dali":
        from twinstep.data import dali

        splits = packed.open_splits(data) if packed.is_packed(data) else folder.scan_both(data)
        return dali.Dali(splits, res, threads, dali.device_id(), eval_res)
    return (Packed if packed.is_packed(data) else Folder)(data, res, eval_res)


def train_batch(src, augment: Augment, seed: int, step: int, micro: int, rows: int,
                part: slice | None = None) -> Batch:
    """Step ``step``'s k micro-batches of R N rows as the host delivers them (`Batch`), each
    micro-batch's mix drawn for all its R N rows (row i mixed with row R N - 1 - i, on the
    devices). ``part``: only these rows (a process's own, `twinstep.processes.cluster
    .local_rows`), each equal to its row of the whole batch."""
    idx = batches.indices(seed, step, micro * rows, len(src.train_labels)).reshape(micro, rows)
    own = np.arange(rows)[part if part is not None else slice(None)]
    xs, labels, mixes, boxes, skipped = [], [], [], [], 0
    for m in range(micro):
        x, y, sk = src.train_rows(idx[m][own], seed, step, m * rows + own, augment)
        lam, box = 1.0, None
        if augment.mix is not None:
            lam, box = mix.draw(np.random.default_rng([seed, step, 1, m]), augment.mix,
                                x.shape[1], x.shape[2])
        xs.append(x)
        labels.append(y)
        # (λ, 1 - λ) rounded as timm's float32 tensors are scaled by a Python float
        mixes.append((np.float32(lam), np.float32(1.0 - lam)))
        boxes.append(box or (0, 0, 0, 0))
        skipped += int(sk.sum())
    return Batch(np.stack(xs), np.stack(labels), np.asarray(mixes, np.float32),
                 np.asarray(boxes, np.int32), skipped)


def val_batch(src, rows: int, b: int,
              part: slice | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The b-th eval batch of ``rows``: (x, labels, valid, images skipped); the last batch is
    padded and masked (`twinstep.data.batches.eval_rows`). ``part``: only these rows."""
    idx, valid = batches.eval_rows(b, rows, len(src.val_labels))
    idx, valid = idx[part or slice(None)], valid[part or slice(None)]
    x, skipped = src.val_rows(idx)
    return x, src.val_labels[idx], valid, skipped


def val_batch_count(src, rows: int) -> int:
    return -(-len(src.val_labels) // rows)


def stream(make, start: int, stop: int, workers: int):
    """A generator of ``make(i)`` for i in [start, stop), built ahead: by one background thread
    (grain) when ``workers`` is 0, else by that many processes (`twinstep.data.workers`); close
    it to stop them. ``make`` must pickle (a module function or a partial of one)."""
    if workers > 0:
        yield from workers_module.stream(make, start, stop, workers, PREFETCH)
        return
    import grain

    dataset = grain.MapDataset.range(start, stop).map(make)
    yield from dataset.to_iter_dataset(grain.ReadOptions(num_threads=1,
                                                         prefetch_buffer_size=PREFETCH))


def train_stream(src, augment, seed, start, stop, micro, rows, workers, part=None):
    """train_batch for the steps [start, stop), in order."""
    return stream(functools.partial(_train_item, src, augment, seed, micro, rows, part),
                  start, stop, _processes(src, workers))


def _train_item(src, augment, seed, micro, rows, part, step):
    return train_batch(src, augment, seed, step, micro, rows, part)


def val_stream(src, rows: int, workers: int, part: slice | None = None):
    return stream(functools.partial(val_batch, src, rows, part=part), 0,
                  val_batch_count(src, rows), _processes(src, workers))


def _processes(src, workers: int) -> int:
    """Worker processes for ``src``: none for DALI, whose threads are its workers."""
    return 0 if getattr(src, "THREADS_ARE_WORKERS", False) else workers
