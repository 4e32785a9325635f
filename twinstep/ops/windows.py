"""Strided windows of a padded NHWC tensor and their transpose — shared by the shift-path
depthwise convolution and the max-pool backward."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def pad_hw(x, p: int, value=0.0):
    """Pad H and W by p on both sides (symmetric)."""
    return jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)), constant_values=value) if p else x


def window(xp, a: int, b: int, ho: int, wo: int, s: int):
    """xp[:, a + s*i, b + s*j, :] for i < ho, j < wo: one tap of a k x k window, stride s."""
    n, _, _, c = xp.shape
    return lax.slice(xp, (0, a, b, 0), (n, a + (ho - 1) * s + 1, b + (wo - 1) * s + 1, c),
                     (1, s, s, 1))


def scatter_window(v, a: int, b: int, hp: int, wp: int, s: int):
    """The transpose of `window`: v [N, ho, wo, C] placed at rows a + s*i, cols b + s*j of an
    hp x wp grid, zeros elsewhere."""
    ho, wo = v.shape[1:3]
    hi_h, hi_w = hp - a - (ho - 1) * s - 1, wp - b - (wo - 1) * s - 1
    return lax.pad(v, jnp.zeros((), v.dtype),
                   ((0, 0, 0), (a, hi_h, s - 1), (b, hi_w, s - 1), (0, 0, 0)))
