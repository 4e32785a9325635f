"""Residual add, a bias, squeeze-excite's gate, and the regularisers' masks (drop-path per
example, dropout per element).

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


def bias_forward(x, b):
    """x [..., C] + b [C] (a convolution's bias, squeeze-excite's 1x1 convolutions')."""
    return x + b


def bias_vjp(dy):
    """(dx, db): db [C] sums dy [..., C] over every axis but the channels."""
    return dy, jnp.sum(dy, axis=tuple(range(dy.ndim - 1)))


def gate_forward(x, g):
    """x [N, H, W, C] * g [N, C], each example's channels scaled by its own gate (squeeze-excite:
    g the sigmoid of the pooled branch) -> (y, (x, g))."""
    return x * g[:, None, None, :], (x, g)


def gate_vjp(res, dy):
    """(dx [N, H, W, C], dg [N, C]): dg sums dy x over each example's grid."""
    x, g = res
    return dy * g[:, None, None, :], jnp.sum(dy * x, axis=(1, 2))


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
