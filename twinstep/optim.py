"""The optimizers of the recipes (docs/recipes.md): optax transforms composed to timm's / torch's
update, and the LR.

Parameters, gradients and updates are flat dicts {timm name: array}; every optimizer is one
``optax.chain`` of optax's own transforms, composed from its row of the catalogue
(`twinstep.optimizers.OPTIMIZERS`: its ε, momentum, trust ratio):

  kind      timm / torch                       chain (after the recipe's optional clip)
  lamb      timm Lamb (β .9/.999, ε 1e-6)      clip_by_global_norm(1), scale_by_adam,
                                               add_decayed_weights(mask),
                                               masked(scale_by_trust_ratio, adapt), lr
  adamw     torch AdamW (β .9/.999, ε 1e-8)    scale_by_adam, add_decayed_weights(mask), lr
  momentum  torch SGD(momentum=.9)             add_decayed_weights(mask), trace(.9), lr
  sgd       torch SGD(momentum=.9, nesterov)   add_decayed_weights(mask), trace(.9, nesterov), lr
  rmsproptf timm RMSpropTF (α .9, ε 1e-3,      add_decayed_weights(mask),
            momentum .9)                       scale_by_rms(.9, ε in √, from 1), +lr, trace(.9),
                                               scale(-1)

One transform is written here (`clip_grad_norm`, torch's clip); elsewhere, where optax and timm
could part, the composition decides:
- timm's LAMB adapts (trust ratio ‖θ‖/‖r‖, 1 if either norm is 0) only the tensors whose group has
  weight decay != 0 (``always_adapt=False``): with wx the 1-D tensors skip both the decay and the
  trust ratio, and with weight_decay = 0 no tensor is adapted. optax.lamb would adapt every tensor,
  hence the ``adapt`` mask.
- timm's LAMB decay is L2 inside the update (r = m̂/(√v̂+ε) + wd θ, then the trust ratio), which
  is add_decayed_weights between the Adam scaling and the trust ratio.
- AdamW's decoupled θ ← θ(1 − lr wd) − lr m̂/(√v̂+ε) is the same as adding wd θ to the Adam
  direction before the lr; SGD's coupled decay is the same transform placed before the momentum.
- timm's LAMB clips inside the optimizer (max_grad_norm=1.0, its default): g / max(‖g‖₂, 1),
  ‖g‖₂ over ALL tensors of all groups; optax.clip_by_global_norm(1.0) is that exactly. A
  recipe's ``clip`` is timm's train.py --clip-grad 1.0 (mode norm), which calls
  torch.nn.utils.clip_grad_norm_ before the optimizer: g · min(1, 1 / (‖g‖ + 1e-6)), not
  optax's factor (`clip_grad_norm`).
- torch SGD's momentum buffer starts as the first gradient; optax.trace starts at zero and adds
  the gradient, the same thing.
- timm's RMSpropTF (lr_in_momentum=True, decoupled_decay=False, its defaults): g ← g + wd θ;
  v ← v + (1 − α)(g² − v) from v = 1; b ← μ b + lr g/√(v + ε); θ ← θ − b. optax.rmsprop is
  that chain but puts the sign before the trace, which would then hold −b: the sign goes last
  here, so the trace is timm's momentum_buffer (the loop oracle compares it) and the update the
  same.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from twinstep.defaults import BETAS, MOMENTUM
from twinstep.optimizers import OPTIMIZERS

KINDS = tuple(OPTIMIZERS)
# Kinds that take a norm of every tensor (LAMB's trust ratio ||θ|| / ||r||): with the optimizer
# state in slices over R replicas each such norm is a scalar collective, two per tensor (466 for
# MobileNetV4) where a whole state needs none — these keep the whole optimizer state on every
# replica (`twinstep.program.train_program`).
PER_TENSOR_NORMS = tuple(k for k, o in OPTIMIZERS.items() if o.trust_ratio)
CLIP_NORM = 1.0
EPS = {k: o.eps for k, o in OPTIMIZERS.items() if o.eps is not None}  # the Adams' and RMSProp's ε


def decay_mask(params: dict, wx: bool) -> dict[str, bool]:
    """True where weight decay applies. With wx the 1-D tensors (BN γ, β) and biases are excluded,
    as timm's ``param_groups_weight_decay`` does (ndim <= 1 or a name ending ".bias")."""
    return {n: not (wx and (len(p.shape) <= 1 or n.endswith(".bias"))) for n, p in params.items()}


def lr_schedule(peak_lr: float, warmup_steps: int, total_steps: int, warmup_init: float = 0.0,
                end_lr: float = 0.0, xp=jnp) -> optax.Schedule:
    """Linear warmup then cosine, indexed by the optimizer step s = 0, 1, … (optax's count: the
    first update uses s = 0) — timm's CosineLRScheduler stepped per update (``step_update``,
    warmup_prefix=False, one cycle) (docs/recipes.md#learning-rate-schedule):

    lr(s) = warmup_init + (peak_lr − warmup_init) s / W                      for s < W
    lr(s) = end_lr + (peak_lr − end_lr) ½ (1 + cos(π s / T))                for W <= s < T
    lr(s) = end_lr                                                            for s >= T
    with W = warmup_steps, T = total_steps: lr(0) = warmup_init (lr(0) = peak_lr when W = 0);
    the cosine runs over [0, T] under the warmup, so lr(W) is just below peak_lr.

    Evaluated in the canonical float dtype (f64 under ``jax_enable_x64``, as the exact checks
    run). optax's own warmup_cosine_decay_schedule evaluates in f32 even then, and two compiled
    programs (replica, single device) round it differently by an ulp or two, which every f64
    Adam-type update carries uniformly, far above the tie's bound (bench/history/
    2026-12-03.md, "measurements behind the design"). ``xp=numpy``: the same schedule in NumPy,
    for a reader without JAX (`twinstep plot`).
    """
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got {warmup_steps}, {total_steps}")

    def schedule(count):
        s = xp.asarray(count, xp.result_type(float))
        warm = warmup_init + (peak_lr - warmup_init) * s / max(warmup_steps, 1)
        cosine = end_lr + (peak_lr - end_lr) * 0.5 * (1.0 + xp.cos(xp.pi * s / total_steps))
        return xp.where(s < warmup_steps, warm, xp.where(s < total_steps, cosine, end_lr))

    return schedule


def step_lr_schedule(peak_lr: float, warmup_steps: int, decay_steps: float, decay_rate: float,
                     warmup_init: float = 0.0, xp=jnp) -> optax.Schedule:
    """Linear warmup then a staircase, indexed by the optimizer step s as `lr_schedule` — timm's
    StepLRScheduler stepped per update (``--sched step --sched-on-updates``, warmup_prefix=False)
    (docs/recipes.md#learning-rate-schedule):

    lr(s) = warmup_init + (peak_lr − warmup_init) s / W          for s < W
    lr(s) = peak_lr · decay_rate ^ (s // D)                       for s >= W
    with W = warmup_steps and D = decay_steps (timm's decay_t, --decay-epochs × updates per epoch,
    fractional as timm's 2.4 epochs): the decay counts from step 0, under the warmup. ``//`` is
    Python's floor division, which timm's scheduler runs: jnp.floor_divide computes the same
    quotient where ⌊s / D⌋ would not (s / D rounded up to an integer: s = 11, D = 1.1).
    """
    if not (warmup_steps >= 0 and decay_steps > 0):
        raise ValueError(f"need warmup_steps >= 0 and decay_steps > 0, got {warmup_steps}, "
                         f"{decay_steps}")

    def schedule(count):
        s = xp.asarray(count, xp.result_type(float))
        warm = warmup_init + (peak_lr - warmup_init) * s / max(warmup_steps, 1)
        staircase = peak_lr * decay_rate ** xp.floor_divide(s, decay_steps)
        return xp.where(s < warmup_steps, warm, staircase)

    return schedule


def clip_grad_norm(max_norm: float = CLIP_NORM) -> optax.GradientTransformation:
    """torch.nn.utils.clip_grad_norm_ (timm's train.py --clip-grad, mode norm): every gradient
    times min(1, max_norm / (‖g‖ + 1e-6)), ‖g‖ over all tensors."""
    def update(updates, state, params=None):
        del params
        factor = jnp.minimum(1.0, max_norm / (optax.tree.norm(updates) + 1e-6))
        return {n: g * factor.astype(g.dtype) for n, g in updates.items()}, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(kind: str, learning_rate, *, weight_decay: float, wx: bool, clip: bool,
                   params: dict) -> optax.GradientTransformation:
    """The optimizer ``kind`` (one of KINDS) with timm's / torch's semantics (module docstring).

    learning_rate: a float or an optax schedule of the optimizer step. weight_decay: L2 for
    lamb, momentum, sgd and rmsproptf (added to the gradient / Adam direction), decoupled for
    adamw. wx: exclude 1-D tensors from the decay (and, for lamb, from the trust ratio). clip:
    torch's clip_grad_norm_ at 1.0 first (`clip_grad_norm`; LAMB clips inside too, as timm's).
    params: only their names and shapes are read (arrays or ShapeDtypeStructs).
    """
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer kind {kind!r}; expected one of {KINDS}")
    row = OPTIMIZERS[kind]
    mask = decay_mask(params, wx)
    decay = [optax.add_decayed_weights(weight_decay, mask)] if weight_decay else []
    chain = [clip_grad_norm(CLIP_NORM)] if clip else []
    if row.trust_ratio:
        chain.append(optax.clip_by_global_norm(CLIP_NORM))  # timm Lamb's own, max_grad_norm=1
    if row.alpha is not None:  # RMSProp in TF's form, the lr inside the momentum (module doc)
        return optax.chain(*chain, *decay, optax.scale_by_rms(
            row.alpha, row.eps, initial_scale=1.0, eps_in_sqrt=True),
            optax.scale_by_learning_rate(learning_rate, flip_sign=False),
            optax.trace(decay=MOMENTUM), optax.scale(-1.0))
    if row.eps is not None:
        chain += [optax.scale_by_adam(*BETAS, eps=row.eps), *decay]
    else:
        chain += [*decay, optax.trace(decay=MOMENTUM, nesterov=row.nesterov)]
    # timm adapts a tensor iff its group's weight decay is non-zero (always_adapt=False)
    adapt = mask if weight_decay else {n: False for n in mask}
    if row.trust_ratio and any(adapt.values()):
        chain.append(optax.masked(optax.scale_by_trust_ratio(), adapt))
    chain.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*chain)


def recipe_schedule(recipe, xp=jnp) -> optax.Schedule:
    """A recipe's learning rate per optimizer step: its warmup, then its cosine (`lr_schedule`)
    or its step decay (`step_lr_schedule`); in NumPy with ``xp=numpy``."""
    if recipe.schedule == "step":
        return step_lr_schedule(recipe.lr, recipe.warmup_steps, recipe.decay_steps,
                                recipe.decay_rate, recipe.warmup_lr, xp=xp)
    return lr_schedule(recipe.lr, recipe.warmup_steps, recipe.total_steps, recipe.warmup_lr,
                       xp=xp)


def for_recipe(recipe, params: dict) -> optax.GradientTransformation:
    """A recipe's clip + optimizer at its schedule (`twinstep.recipes.Recipe`'s fields)."""
    return make_optimizer(recipe.optimizer, recipe_schedule(recipe),
                          weight_decay=recipe.effective_weight_decay, wx=recipe.wx,
                          clip=recipe.clip, params=params)


def apply(opt: optax.GradientTransformation, grads: dict, opt_state, params: dict):
    """One optimizer step: (new params, new optimizer state)."""
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
