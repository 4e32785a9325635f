"""ReLU, with subgradient 0 at 0 (as PyTorch: the mask is x > 0)."""

from __future__ import annotations

import jax.numpy as jnp


def relu_forward(x):
    """Returns (max(x, 0), mask = x > 0)."""
    mask = x > 0
    return jnp.where(mask, x, jnp.zeros((), x.dtype)), mask


def relu_vjp(mask, dy):
    return jnp.where(mask, dy, jnp.zeros((), dy.dtype))
