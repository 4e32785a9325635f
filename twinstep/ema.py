"""EMA of weights and BN running statistics with timm's ``ModelEmaV3`` semantics (docs/recipes.md).

The step is counted as timm's train loop counts it: ``num_updates`` is incremented after each
optimizer step and THEN ``model_ema.update(model, step=num_updates)`` runs, so the first EMA
update has step = 1. ModelEmaV3.get_decay uses t = step − 1 (update_after_step = 0), the number
of earlier EMA updates, and returns decay 0 when t = 0: the first update copies the model.

  warmup    decay for t >= 1
  "none"    decay
  "timm"    min(decay, 1 − (1 + t/γ)^(−p))      (γ = 1, p = 2/3: 0.37 at t = 1)
  "tf"      min(decay, (1 + t)/(10 + t))        (0.18 at t = 1)

For "tf" we use the same t, and the same copy at t = 0, so the three differ only in the warmup
curve (tf.train.ExponentialMovingAverage would give (1 + 0)/(10 + 0) = 0.1 on its first update
after a zero-initialised shadow; the copy is timm's convention for every mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from twinstep.defaults import EMA_DECAY as DECAY
from twinstep.defaults import EMA_WARMUPS as WARMUPS


def ema_weight(step, decay: float = DECAY, warmup: str = "none", gamma: float = 1.0,
               power: float = 2 / 3):
    """1 − ema_decay(step, …): the lerp weight of the new value, computed without cancellation
    ((1 + t/γ)^(−p) and 9/(10 + t) directly, and 1 − decay in Python double as timm does)."""
    if warmup not in WARMUPS:
        raise ValueError(f"unknown EMA warmup {warmup!r}; expected one of {WARMUPS}")
    t = jnp.maximum(jnp.asarray(step) - 1, 0).astype(float)
    floor = 1.0 - decay
    if warmup == "timm":
        w = jnp.maximum(floor, jnp.power(1.0 + t / gamma, -power))
    elif warmup == "tf":
        w = jnp.maximum(floor, 9.0 / (10.0 + t))
    else:
        w = jnp.full_like(t, floor)
    return jnp.where(t > 0, w, 1.0)


def ema_decay(step, decay: float = DECAY, warmup: str = "none", gamma: float = 1.0,
              power: float = 2 / 3):
    """The decay timm's ModelEmaV3.get_decay(step) returns (module docstring), as a jnp scalar
    of the integer step (traceable)."""
    return 1.0 - ema_weight(step, decay, warmup, gamma, power)


def ema_init(params: dict, buffers: dict) -> tuple[dict, dict]:
    """The EMA state (params, buffers): a copy of the model's, as ModelEmaV3's deepcopy."""
    return jax.tree.map(jnp.array, (params, buffers))


def ema_update(ema_tree, new_tree, step, **decay_kw):
    """ema ← lerp(ema, new, 1 − decay) over every leaf (weights AND running statistics), with
    torch's lerp formula (exact copy at weight 1); integer leaves are copied, as timm does.
    decay_kw: decay, warmup, gamma, power of ema_decay."""
    w = ema_weight(step, **decay_kw)

    def lerp(e, n):
        if not jnp.issubdtype(e.dtype, jnp.floating):
            return jnp.asarray(n, e.dtype)
        wt, n = w.astype(e.dtype), jnp.asarray(n, e.dtype)
        return jnp.where(wt < 0.5, e + wt * (n - e), n - (n - e) * (1 - wt))

    return jax.tree.map(lerp, ema_tree, new_tree)
