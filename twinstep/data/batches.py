"""The sampler: step s's global batch is a pure function of (seed, s), so a resumed run draws
exactly the batches the uninterrupted one would have, and the number of loader workers cannot
change them. Its rows are dealt to the replicas in order: replica r takes rows r N .. (r+1) N - 1
of every micro-batch (the layout the tie and the renders assume)."""

from __future__ import annotations

import numpy as np


def indices(seed: int, step: int, rows: int, size: int) -> np.ndarray:
    """The dataset indices of step ``step``'s global batch of ``rows`` examples: epochs are
    seeded permutations of the ``size`` examples, read consecutively (an epoch's tail joins the
    next epoch's head), so every example is seen once per epoch."""
    start = step * rows
    first, last = start // size, (start + rows - 1) // size
    order = np.concatenate([np.random.default_rng([seed, e]).permutation(size)
                            for e in range(first, last + 1)])
    offset = start - first * size
    return order[offset:offset + rows]


def one_hot(labels: np.ndarray, classes: int, dtype) -> np.ndarray:
    return np.eye(classes, dtype=dtype)[labels]


def train_batch(images: np.ndarray, labels: np.ndarray, classes: int, seed: int, step: int,
                micro: int, rows: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(xs [k, R N, S, S, 3], ts [k, R N, K]) of step ``step``: k micro-batches of R N rows."""
    idx = indices(seed, step, micro * rows, len(labels)).reshape(micro, rows)
    return images[idx].astype(dtype), one_hot(labels[idx], classes, dtype)


def eval_batches(images: np.ndarray, labels: np.ndarray, rows: int):
    """The whole split in batches of ``rows``: (x [rows, ...], labels [rows], valid [rows]
    bool); the last batch is padded with copies of image 0 and masked, so that every image counts
    exactly once."""
    for start in range(0, len(labels), rows):
        idx = np.arange(start, start + rows)
        valid = idx < len(labels)
        idx = np.where(valid, idx, 0)
        yield images[idx], labels[idx], valid
