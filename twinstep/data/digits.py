"""The embedded dataset: scikit-learn's bundled handwritten digits — 1,797 real 8 x 8 grey
images of 0-9, no download — upsampled to S x S, replicated to 3 channels and normalised with
ImageNet's mean and std, as timm's transforms would feed a pretrained net.

The split is fixed: every sixth image (index 0, 6, 12, ...) is validation (300), the rest train
(1,497), so both splits hold every writer's style.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image

from twinstep.data.transforms import MEAN, STD

CLASSES = 10
VAL_EVERY = 6


@functools.lru_cache(maxsize=1)
def _raw() -> tuple[np.ndarray, np.ndarray]:
    # lazy: scikit-learn (~0.3 s idle, seconds on a loaded machine) only when the digits are
    # asked for; every train, 'train --help' and loader worker imports this module (its source)
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int32)


def _upsample(images: np.ndarray, res: int) -> np.ndarray:
    """[n, 8, 8] in [0, 1] -> [n, S, S, 3] normalised (bilinear, Pillow)."""
    out = np.stack([np.asarray(Image.fromarray(im, mode="F").resize((res, res),
                                                                    Image.Resampling.BILINEAR))
                    for im in images])
    return ((out[..., None] - MEAN) / STD).astype(np.float32)


def _keep(name: str, count: int) -> np.ndarray:
    val = np.arange(count) % VAL_EVERY == 0
    return val if name == "val" else ~val


def labels(name: str) -> np.ndarray:
    """The labels [n] int32 of "train" or "val"."""
    all_labels = _raw()[1]
    return all_labels[_keep(name, len(all_labels))]


@functools.lru_cache(maxsize=4)
def split(name: str, res: int) -> tuple[np.ndarray, np.ndarray]:
    """(images [n, S, S, 3] float32, labels [n] int32) of "train" or "val"."""
    images, all_labels = _raw()
    keep = _keep(name, len(all_labels))
    return _upsample(images[keep], res), all_labels[keep]
