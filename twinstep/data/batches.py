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


def eval_rows(batch: int, rows: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset indices [rows], valid [rows] bool) of eval batch ``batch`` over a split of
    ``size`` examples: the last batch is padded with copies of example 0 and masked, so that
    every example counts exactly once."""
    idx = np.arange(batch * rows, (batch + 1) * rows)
    valid = idx < size
    return np.where(valid, idx, 0), valid
