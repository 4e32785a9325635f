"""What the trainer reads: a `Source` — the embedded digits, or an image dataset's two splits
decoded by a loader — chosen once from ``--data`` and ``--loader`` (`get_source`).

A dataset format is how its splits are opened (`FORMATS`: a packed folder, an ImageFolder
tree); a loader is who decodes and augments their images (`LOADERS`: Pillow through timm's
transforms; nvImageCodec with the resize and RandAugment on the devices). A new format or
loader is a module of its own and one row of its table; the trainer, its evaluation and its
loader processes see only `Source`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from twinstep.data import digits, folder, mix, packed
from twinstep.errors import UsageError

DIGITS = "digits"  # --data digits: the embedded set (`twinstep.data.digits`)
BUILTIN_DIGITS = "builtin:digits"  # the embedded set, whatever ./digits is


@dataclasses.dataclass(frozen=True)
class Augment:
    """The recipe's augmentation of a training batch: RandAugment's magnitude (None: off), the
    mix (None: off)."""

    randaugment: int | None = None
    mix: mix.MixParams | None = None


@runtime_checkable
class Source(Protocol):
    """A dataset as the trainer reads it. Rows are drawn by index (`twinstep.data.batches`); a
    train row's augmentation is seeded by (seed, step, its row of the step's batch), so the
    same index at the same row gives the same pixels in any process or worker."""

    res: int  # S: train crops are S x S
    eval_res: int  # E: val crops are E x E
    classes: int  # K
    train_labels: np.ndarray  # [images] int32, in index order
    val_labels: np.ndarray  # [images] int32
    augments: bool  # whether the recipe's RandAugment and mix apply (the digits: never)

    def train_rows(self, idx: np.ndarray, seed: int, step: int, row_ids: np.ndarray,
                   augment: Augment) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(images [n, S, S, 3] — uint8 crops, or float32 already normalised; a loader that
        finishes its crops on the devices gives its canvases [n, C, C, 3] —, labels [n] int32,
        images skipped per row [n] int64, plans [n, P] int32 of the devices' work, P = 0
        where there is none) of dataset rows ``idx``, which are rows ``row_ids`` of step
        ``step``'s batch. An image that does not decode is replaced by the next one of its
        split and counted: a row that skipped t images skipped rows i, i + 1, ..., i + t - 1
        (modulo the split's size; `skipped_images`)."""

    def layout(self, augment: Augment):
        """What a plan holds under ``augment`` (`twinstep.data.device.Layout`), None where the
        rows are the crops."""

    def val_rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(images [n, E, E, 3], images skipped per row [n] int64) of val rows ``idx``."""

    def val_kind(self) -> str:
        """What kind of val split this is, for pairing runs image by image
        (`twinstep.training.evaluation.val_fingerprint`): a folder and its packed copy share
        it."""


def skipped_images(idx: np.ndarray, skipped: np.ndarray, size: int) -> tuple[int, ...]:
    """The images of a split of ``size`` that rows ``idx`` skipped, ``skipped`` [n] of them
    each: those from each row's index on, which the next that decodes replaced."""
    return tuple(int(i + k) % size for i, t in zip(idx, skipped, strict=True)
                 for k in range(int(t)))


def no_plans(n: int) -> np.ndarray:
    """The plans [n, 0] of rows that are their crops already."""
    return np.zeros((n, 0), np.int32)


class Digits:
    """The embedded digits at S x S, the val split at ``eval_res`` (normalised already,
    float32; no augmentation: a flipped or cropped digit is another digit)."""

    augments = False

    def __init__(self, res: int, eval_res: int | None = None):
        self.res, self.eval_res = res, eval_res or res
        self.train_labels = digits.split("train", res)[1]
        self.val_labels = digits.split("val", self.eval_res)[1]
        self.classes = digits.CLASSES

    def train_rows(self, idx, seed, step, row_ids, augment):
        images, labels = digits.split("train", self.res)
        return images[idx], labels[idx], np.zeros(len(idx), np.int64), no_plans(len(idx))

    def layout(self, augment):
        return None

    def val_rows(self, idx):
        return digits.split("val", self.eval_res)[0][idx], np.zeros(len(idx), np.int64)

    def val_kind(self) -> str:
        return DIGITS


class Format(NamedTuple):
    """A dataset format: whether a ``--data`` path is one, and its (train, val) splits
    (``splits(path, val_split=None)``, the format refusing a --val-split it cannot hold) — each
    with ``classes``, ``labels``, ``len()``, ``image(i)`` (PIL, or None when it does not decode)
    and ``encoded(i)`` (the file's bytes)."""

    holds: Callable[[str], bool]
    splits: Callable[[str], tuple]


# the first whose ``holds`` accepts the path
FORMATS = {"packed": Format(packed.is_packed, packed.open_splits),
           "folder": Format(os.path.isdir, folder.scan_both)}


# --loader NAME: the module of the loader, imported when chosen. Each has ``make(splits, S,
# eval_res=E) -> Source`` and ``unavailable() -> str | None`` (why it cannot run here); its
# --workers are the loader's processes (`twinstep.data.loader.stream`), never its own
LOADERS = {"pillow": "twinstep.data.pillow", "device": "twinstep.data.device"}
DEFAULT_LOADER = "pillow"  # the digits are arrays: only the default reads them


def resolve(data: str) -> str:
    """--data as the trainer reads it: `DIGITS` for the embedded set, else a path. ``digits``
    names the embedded set unless a file or folder ./digits exists: then it is refused
    (UsageError) as naming both, and ``./digits`` or ``builtin:digits`` says which."""
    if data == BUILTIN_DIGITS:
        return DIGITS
    if data == DIGITS and os.path.exists(DIGITS):
        raise UsageError(f"--data {DIGITS} names both the embedded digits and ./{DIGITS} here: "
                         f"write --data ./{DIGITS} for the folder or --data {BUILTIN_DIGITS} "
                         f"for the embedded set")
    return data


def check(data: str, loader: str) -> None:
    """UsageError (one line) unless ``data`` is the digits or a path of one of `FORMATS`, and
    ``loader`` can read it here."""
    if data != DIGITS:
        _format(data)
    if loader not in LOADERS:
        raise UsageError(f"unknown --loader {loader!r}; choose from {', '.join(LOADERS)}")
    if data == DIGITS and loader != DEFAULT_LOADER:
        raise UsageError(f"--loader {loader} decodes images: give --data an image folder or a "
                         f"packed one (the digits are arrays already)")
    if (why := _loader(loader).unavailable()) is not None:
        raise UsageError(why)


def _loader(name: str):
    # by name, when chosen: the device loader imports JAX (and needs the [nvimgcodec] extra),
    # and loader workers (spawned processes) import this module
    return importlib.import_module(LOADERS[name])


def _format(data: str) -> Format:
    found = next((f for f in FORMATS.values() if f.holds(data)), None)
    if found is None:
        raise UsageError(f"--data {data}: no such directory (or 'digits', the embedded set)")
    return found


def open_splits(data: str, val_split: float | None = None) -> tuple | None:
    """``data``'s (train, val) splits (a folder is scanned), None for the digits;
    ``val_split``: a folder without val/ holds out this share of train/ as its val split
    (`twinstep.data.folder.scan_both`)."""
    if data == DIGITS:
        if val_split is not None:
            raise UsageError("--val-split holds images out of a folder's train/; the digits "
                             "have their val split")
        return None
    return _format(data).splits(data, val_split=val_split)


def train_size(data: str, splits: tuple | None = None) -> int:
    """How many training images ``data`` holds (its ``splits`` when opened already)."""
    if data == DIGITS:
        return len(digits.labels("train"))
    return len((splits or open_splits(data))[0])


def get_source(data: str, res: int, loader: str = DEFAULT_LOADER,
               eval_res: int | None = None, splits: tuple | None = None) -> Source:
    """``data`` — "digits", or a path in one of `FORMATS` — read by ``loader`` (`LOADERS`):
    train crops at ``res``, val crops at ``eval_res`` (default ``res``); ``splits``: its
    splits when opened already (`open_splits`)."""
    check(data, loader)
    if data == DIGITS:
        return Digits(res, eval_res)
    return _loader(loader).make(splits or open_splits(data), res, eval_res=eval_res)
