"""The synthetic batches the ties run on: Gaussian images whose replica shards are shifted
apart, and soft (mixup) targets. One generator for the one-step tie, the whole-step ties and
the benchmarks, so that a given seed means the same data everywhere."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from twinstep import dp

SHIFT = 1.0  # replica r's images are offset by r: Chan's correction term is then O(1)
MIXUP_LAMBDA = (0.3, 1.0)  # the mixing weight's range: every target row is soft


def batch(rng: np.random.Generator, lead: tuple, res: int, classes: int, replicas: int,
          shift: bool, dtype):
    """(x [*lead, S, S, 3], t [*lead, K]) in ``dtype``; the last axis of ``lead`` holds the
    R N rows (``lead`` = (R N,) for a batch, (k, R N) for k micro-batches). Images are standard
    normal, replica r's rows offset by r SHIFT when ``shift``; targets are lam a + (1 - lam) b
    for random one-hot a, b — both losses' cotangents are affine in t, so soft targets check
    what one-hot targets would and more."""
    x = jnp.asarray(rng.standard_normal((*lead, res, res, 3)), dtype)
    if shift:
        x = (dp.shift_shards(x, replicas, SHIFT) if len(lead) == 1 else
             jnp.stack([dp.shift_shards(m, replicas, SHIFT) for m in x]))
    lam = rng.uniform(*MIXUP_LAMBDA, (*lead, 1))
    a, b = (np.eye(classes)[rng.integers(0, classes, lead)] for _ in range(2))
    return x, jnp.asarray(lam * a + (1 - lam) * b, dtype)
