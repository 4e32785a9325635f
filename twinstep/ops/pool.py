"""The stem's 3x3 / stride 2 max-pool (pad 1 with -inf, symmetric) and global average pool.

Max-pool tie-break: the whole cotangent of a window goes to ONE maximum, the first in row-major
scan order of the 3x3 window (top-left first) — PyTorch's CPU kernel keeps the first index whose
value is strictly greater than the running max, which is the same element.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from twinstep.ops.windows import pad_hw, scatter_windows, window

POOL_K, POOL_S, POOL_P = 3, 2, 1


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "y"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MaxPoolRes:
    x: jax.Array  # [N, H, W, C]
    y: jax.Array  # [N, Ho, Wo, C]


def maxpool_forward(x):
    """y [N, Ho, Wo, C], Ho = (H - 1) // 2 + 1: the max of each 3x3 window, stride 2, -inf pad 1."""
    pads = ((0, 0), (POOL_P, POOL_P), (POOL_P, POOL_P), (0, 0))
    y = lax.reduce_window(x, -jnp.inf, lax.max, (1, POOL_K, POOL_K, 1), (1, POOL_S, POOL_S, 1),
                          pads)
    return y, MaxPoolRes(x, y)


def maxpool_vjp(res: MaxPoolRes, dy):
    """dx: each window's cotangent scattered to its first maximum (row-major)."""
    x, y = res.x, res.y
    n, h, w, c = x.shape
    ho, wo = y.shape[1:3]
    xp = pad_hw(x, POOL_P, -jnp.inf)
    hp, wp = h + 2 * POOL_P, w + 2 * POOL_P
    taken = jnp.zeros(y.shape, bool)
    routed = {}  # tap -> the cotangent of the windows whose first maximum it is
    for a in range(POOL_K):
        for b in range(POOL_K):
            hit = (window(xp, a, b, ho, wo, s=POOL_S) == y) & ~taken
            taken = taken | hit
            routed[a, b] = jnp.where(hit, dy, 0)
    dxp = scatter_windows(lambda a, b: routed[a, b], POOL_K, hp, wp, POOL_S)
    return dxp[:, POOL_P:POOL_P + h, POOL_P:POOL_P + w, :]


def gap_forward(x):
    """Global average pool: x [N, H, W, C] -> ([N, C], residual = (H, W))."""
    return jnp.mean(x, axis=(1, 2)), x.shape[1:3]


def gap_vjp(hw, dy):
    """dx [N, H, W, C] = dy / (H W) broadcast over the grid."""
    h, w = hw
    return jnp.broadcast_to(dy[:, None, None, :] / (h * w), (dy.shape[0], h, w, dy.shape[1]))
