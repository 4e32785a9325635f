"""`--loader pillow`, the default: an image dataset's splits decoded by Pillow through timm's
transforms (`twinstep.data.transforms`), bit for bit timm's crops (tests/test_transforms.py)."""

from __future__ import annotations

import numpy as np

from twinstep.data import folder, sources, transforms
from twinstep.errors import UsageError


class Pillow:
    """A dataset's (train, val) splits (`twinstep.data.sources.FORMATS`) through timm's transforms:
    train crops at S x S with the recipe's RandAugment, val crops at ``eval_res`` (default S)."""

    augments = True

    def __init__(self, splits, res: int, eval_res: int | None = None):
        self.train, self.val = splits
        self.res, self.eval_res = res, eval_res or res
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
        rows, labels, skipped = [], [], []
        for i, row in zip(idx, row_ids, strict=True):
            img, used, tried = self._decoded(self.train, int(i))
            rng = np.random.default_rng([seed, step, 0, int(row)])
            rows.append(transforms.train_transform(img, self.res, rng, augment.randaugment))
            labels.append(self.train.labels[used])
            skipped.append(tried)
        return (np.stack(rows), np.asarray(labels, np.int32), np.asarray(skipped, np.int64),
                sources.no_plans(len(rows)))

    def layout(self, augment):
        return None

    def val_rows(self, idx):
        rows, skipped = [], []
        for i in idx:
            img, _, tried = self._decoded(self.val, int(i))
            rows.append(transforms.eval_transform(img, self.eval_res, transforms.CROP_PCT))
            skipped.append(tried)
        return np.stack(rows), np.asarray(skipped, np.int64)

    def val_kind(self) -> str:
        return folder.kind(self.val)


def make(splits, res: int, eval_res: int | None = None) -> Pillow:
    """The `twinstep.data.sources.Source` of ``splits`` (the loader's workers decode it, as
    processes: `twinstep.data.loader.stream`)."""
    return Pillow(splits, res, eval_res)


def unavailable() -> None:
    return None  # Pillow is one of twinstep's own dependencies
