"""ReLU, with subgradient 0 at 0 (as PyTorch: the mask is x > 0); ReLU6 (MobileNetV2's), SiLU
(EfficientNet's) and the sigmoid (squeeze-excite's gate), each with the residuals its VJP reads.

The mask the VJP reads is kept as bools, a byte an element, or with ``mask="bits"`` as bits,
eight channels a byte (docs/precision.md#relu-masks-as-bits): the same mask, an eighth of the
bytes to write in the forward and read in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MASKS = ("bool", "bits")  # how `relu_forward` keeps its mask: `Levers.relu_mask`
# bit b of a byte holds channel 8 c + b; numpy, as importing must not start JAX's backend
_BIT = np.arange(8, dtype=np.uint8)


def relu_forward(x, mask: str):
    """x [..., C] -> (max(x, 0), kept): kept = x > 0, bool [..., C]; ``mask`` "bits" (`MASKS`)
    and C a multiple of 8: uint8 [..., C / 8] instead, channel 8 c + b in bit b of byte c."""
    positive = x > 0
    y = jnp.where(positive, x, jnp.zeros((), x.dtype))
    if mask != "bits" or x.shape[-1] % 8:
        return y, positive
    bits = positive.reshape(*x.shape[:-1], x.shape[-1] // 8, 8).astype(jnp.uint8) << _BIT
    return y, jax.lax.reduce(bits, jnp.uint8(0), jax.lax.bitwise_or, (x.ndim,))


def relu_vjp(mask, dy):
    """dy where the mask holds, else 0; the mask as `relu_forward` kept it."""
    if mask.dtype == jnp.uint8:
        mask = ((mask[..., None] >> _BIT) & 1).astype(jnp.bool_).reshape(dy.shape)
    return jnp.where(mask, dy, jnp.zeros((), dy.dtype))


def relu6_forward(x):
    """x [..., C] -> (min(max(x, 0), 6), kept): kept = 0 < x < 6, bool — PyTorch's hardtanh
    gradient, 0 at both edges."""
    kept = (x > 0) & (x < 6)
    return jnp.clip(x, 0, 6), kept


def relu6_vjp(kept, dy):
    return jnp.where(kept, dy, jnp.zeros((), dy.dtype))


def sigmoid_forward(x):
    """x -> (s = 1 / (1 + exp(-x)), s): its VJP reads only the output."""
    s = jax.nn.sigmoid(x)
    return s, s


def sigmoid_vjp(s, dy):
    return dy * s * (1 - s)


def silu_forward(x):
    """x -> (x s, (x, s)), s the sigmoid of x (timm's nn.SiLU)."""
    s = jax.nn.sigmoid(x)
    return x * s, (x, s)


def silu_vjp(res, dy):
    """dy (s + x s (1 - s)): the derivative of x s."""
    x, s = res
    return dy * s * (1 + x * (1 - s))
