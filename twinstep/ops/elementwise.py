"""Residual add and the regularisers' masks (drop-path per example, dropout per element).

Masks are explicit inputs, already scaled by 1 / keep (timm's ``scale_by_keep``), so they can be
drawn once for the GLOBAL batch and sharded with it: a replica must not draw its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add_forward(a, b):
    return a + b


def add_vjp(dy):
    """(da, db): the residual add passes its cotangent to both branches."""
    return dy, dy


def _broadcast_mask(mask, x):
    """A per-example mask [N] acts on every element of its example; a full mask as is."""
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)).astype(x.dtype)


def mask_forward(x, mask):
    """x * mask; mask [N] (drop-path, per example) or x.shape (dropout, per element)."""
    m = _broadcast_mask(mask, x)
    return x * m, m


def mask_vjp(m, dy):
    return dy * m


def keep_mask(key, shape, rate: float, dtype=jnp.float32):
    """Bernoulli(1 - rate) / (1 - rate) of the given shape: [N] for drop-path, the activation's
    shape for dropout. rate 0 gives ones."""
    if rate == 0.0:
        return jnp.ones(shape, dtype)
    keep = 1.0 - rate
    return jax.random.bernoulli(key, keep, shape).astype(dtype) / keep
