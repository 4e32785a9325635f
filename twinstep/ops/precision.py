"""The precision policy (SPEC §5).

- ``f64``: every op in float64 — the exact checks (needs ``jax_enable_x64``).
- ``f32``: every op in float32 — the default.
- ``bf16``: every convolution (dense and depthwise; forward, input-VJP and weight-VJP) takes
  bfloat16 operands and yields a bfloat16-TYPED result, converted back to float32. An
  f32-typed result would let XLA silently run the convolution in f32. BN, adds, ReLU, pooling,
  the head, the loss, the optimizer, master weights and all collectives stay float32.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    # False only to MEASURE the bf16 boundary: weight-gradient convolutions then keep their f32
    # partial sums unrounded (the tie's bound needs them); the product always rounds.
    round_weight_grads: bool = True

    def __post_init__(self):
        if self.name not in ("f64", "f32", "bf16"):
            raise ValueError(f"unknown precision {self.name!r}; choose f64, f32 or bf16")

    @property
    def dtype(self):
        """Activations, master weights, statistics and collectives."""
        return jnp.float64 if self.name == "f64" else jnp.float32

    @property
    def conv_dtype(self):
        """Operands and result type of every convolution."""
        return jnp.bfloat16 if self.name == "bf16" else self.dtype

    @property
    def weight_grad_dtype(self):
        """Result type of the weight-gradient convolutions."""
        return self.conv_dtype if self.round_weight_grads else self.dtype


F64, F32, BF16 = Precision("f64"), Precision("f32"), Precision("bf16")
PRECISIONS = {p.name: p for p in (F64, F32, BF16)}


def get_precision(name: str | Precision) -> Precision:
    return name if isinstance(name, Precision) else Precision(name)
