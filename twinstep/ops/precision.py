"""The precision policy (docs/precision.md).

- ``f64``: every op in float64 — the exact checks (needs ``jax_enable_x64``).
- ``f32``: every op in float32 — the default.
- ``bf16``: every convolution (dense and depthwise; forward, input-VJP and weight-VJP) takes
  bfloat16 operands and yields a bfloat16-TYPED result, converted back to float32. An
  f32-typed result would let XLA silently run the convolution in f32. BN, adds, ReLU, pooling,
  the head, the loss, the optimizer, master weights and all collectives stay float32.

`stored` rounds an activation or cotangent to bf16 between ops where the levers ask for it
(`twinstep.ops.levers.Levers.store`, docs/precision.md#bf16-storage).

``Precision("bf16", base="f64")`` keeps the bf16 policy's rounding points (every conv operand and
result) and runs everything else in float64: the bf16 tie's policy (why: docs/tie.md#bf16).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NAMES = ("f64", "f32", "bf16")
# How activations and cotangents are stored between ops (`stored`): in the precision's dtype,
# or rounded to bfloat16 (under the bf16 policy only: `twinstep.ops.levers.Levers.check`)
STORES = ("dtype", "bf16")


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    # False only to MEASURE the bf16 boundary: weight-gradient convolutions then keep their f32
    # partial sums unrounded (the tie's bound needs them); the product always rounds.
    round_weight_grads: bool = True
    # The dtype of everything that is not a convolution: None = the policy's own (f64 for f64,
    # else f32); "f64" under bf16 for the tie (docs/tie.md#bf16).
    base: str | None = None

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"unknown precision {self.name!r}; choose f64, f32 or bf16")
        if self.base not in (None, "f32", "f64") or (self.name != "bf16"
                                                     and self.base not in (None, self.name)):
            raise ValueError(f"precision {self.name!r} cannot have base {self.base!r}")

    @property
    def dtype(self):
        """Activations, master weights, statistics and collectives."""
        base = self.base or ("f64" if self.name == "f64" else "f32")
        return jnp.float64 if base == "f64" else jnp.float32

    @property
    def conv_accumulator(self):
        """None: XLA accumulates a bf16-typed convolution as the backend does (f32, in an order
        that can depend on the batch size, so that two batch sizes round different elements to
        bf16). float64 under base="f64": exact products
        and f64 sums of the same bf16 operands, then the same bf16 rounding point."""
        return jnp.float64 if self.name == "bf16" and self.base == "f64" else None

    @property
    def conv_dtype(self):
        """Operands and result type of every convolution."""
        return jnp.bfloat16 if self.name == "bf16" else self.dtype

    @property
    def weight_grad_dtype(self):
        """Result type of the weight-gradient convolutions."""
        return self.conv_dtype if self.round_weight_grads else self.dtype


def round_to(x, dtype):
    """``x.astype(dtype)``, except float64 -> bfloat16 rounds through float32. XLA:CPU's own
    f64 -> bf16 conversion depends on the CPU: with AVX512-BF16 it rounds through f32
    (1 + 2^-8 + 2^-30 -> 1.0, where a single rounding gives 1 + 2^-7), elsewhere it can round
    once.
    The two steps, each a correctly rounded conversion, give the same bits on every CPU — and
    the same bits as the tie's bound computes (`twinstep.checking.bounds.bf16_bound`)."""
    if x.dtype == jnp.float64 and dtype == jnp.bfloat16:
        x = x.astype(jnp.float32)
    return x.astype(dtype)


def stored(x, store: str):
    """x [any] as ``store`` (`STORES`) keeps it between ops: "bf16" rounds it to bf16, held as
    a bf16 array and widened back to x's dtype where it is read, as timm's AMP stores it;
    "dtype" is x itself.

    The optimization barrier is what makes the store: without it XLA:GPU fuses the rounding
    and the widening into the op that makes x and writes x in its own dtype, the same bytes
    as no store at all (docs/precision.md#bf16-storage)."""
    if store != "bf16":
        return x
    return jax.lax.optimization_barrier(round_to(x, jnp.bfloat16)).astype(x.dtype)


F64, F32, BF16 = Precision("f64"), Precision("f32"), Precision("bf16")


def get_precision(name: str | Precision) -> Precision:
    return name if isinstance(name, Precision) else Precision(name)
