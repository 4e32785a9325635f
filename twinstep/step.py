"""The train step: where forward, loss, backward, the gradient collective and the optimizer meet.

`grad_step` is ONE function for both twins: called with the single-device context it is the
step at the global batch; called inside ``shard_map`` with a `Replicas` context it is the
replica step — BN synchronised at its sites (ops/batchnorm), the loss divided by THIS replica's
batch, every parameter gradient element all-reduced by its mean exactly once (in buckets,
`Replicas.grad_mean`), and the reported loss the mean of the replicas' losses.

`train_step` is the whole step of a recipe (docs/recipes.md): k micro-steps of `grad_step` (BN
statistics per micro-batch, running statistics at momentum m = 0.1 after every micro-step,
each replica's gradients summed over k and all-reduced once, then divided by k), then the clip
and the optimizer (`twinstep.optim`), then the EMA of weights and running statistics
(`twinstep.ema`). After the collective every replica holds the same gradient, so everything after
it leaves every replica with the same parameters, buffers and EMA (the optimizer state may be
spread over the replicas in slices: `update`). Drop-path and dropout masks are drawn for the
GLOBAL batch from the step's key and sharded with the batch.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from twinstep import ema, optim
from twinstep.nets import layers
from twinstep.ops import batchnorm, elementwise
from twinstep.ops import loss as losses


class StepOut(NamedTuple):
    loss: object  # scalar, the global batch's mean loss
    grads: dict  # {timm name: gradient}, identical on every replica
    stats: dict  # {bn: BNStats}, the global batch statistics
    buffers: dict  # running statistics after the step
    logits: object  # [N, K] this replica's rows


def grad_step(net, params: dict, buffers: dict, x, targets, *, ctx: layers.Ctx,
              loss: str = "ce", masks: dict | None = None, collective: bool = True,
              alpha: float = losses.LABEL_SMOOTHING,
              momentum: float = batchnorm.MOMENTUM) -> StepOut:
    """x [N, H, W, 3], targets [N, K] -> StepOut. ``masks``: keyword masks of net.forward
    (drop_path, dropout), this replica's rows of masks drawn for the global batch.
    ``collective=False`` returns this replica's own gradient nodes (to measure them).
    alpha: CE label smoothing; momentum: the running statistics' update."""
    rep = ctx.replicas
    logits, tape, stats = net.forward(params, buffers, x, ctx, **(masks or {}))
    divisor = losses.loss_divisor(loss, rep.loss_rows(x.shape[0]), logits.shape[-1])
    value, dlogits = losses.value_and_cotangent(loss, logits, targets.astype(logits.dtype),
                                                divisor, alpha)
    grads = net.backward(tape, dlogits)
    grads = rep.grad_mean(grads) if collective else grads
    return StepOut(rep.mean(value, "loss"), grads, stats,
                   layers.update_running(buffers, stats, momentum), logits)


# ----------------------------------------------------------------------- the whole train step


class TrainState(NamedTuple):
    """Everything a step carries: the same values on every replica (the optimizer state may be
    laid out in slices over them, `twinstep.program.train_program`). ``ema`` is (params,
    buffers) or None."""

    step: jax.Array  # optimizer steps taken (int32 scalar)
    params: dict
    buffers: dict
    opt_state: object
    ema: tuple | None


def path_parts(path) -> list[str]:
    """A pytree path as names: dict keys (timm names), NamedTuple fields, sequence indices."""
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def state_names(state) -> list[str]:
    """The flat names of a TrainState's leaves, in ``jax.tree.leaves`` order ("step",
    "params/<timm name>", "opt_state/...", ...): a render's signature and its check."""
    return ["/".join(path_parts(path)) for path, _ in
            jax.tree_util.tree_flatten_with_path(state)[0]]


def init_state(recipe, params: dict, buffers: dict, opt: optax.GradientTransformation):
    return TrainState(jnp.zeros((), jnp.int32), params, buffers, opt.init(params),
                      ema.ema_init(params, buffers) if recipe.ema else None)


def check_recipe(net, recipe) -> None:
    """Reject a recipe this net cannot run (ValueError, one line)."""
    if recipe.net != net.NAME:
        raise ValueError(f"recipe {recipe.name!r} is for {recipe.net}, not {net.NAME}")
    if recipe.dropout and "dropout" not in net.MASKS:
        raise ValueError(f"{net.NAME} has no classifier dropout; drop 'do' from the recipe")


def draw_masks(net, recipe, key, rows: int, dtype) -> dict:
    """The recipe's regularisation masks for a GLOBAL batch of ``rows`` examples, as net.forward
    takes them (drop-path [sites, rows], dropout [rows, features]); {} when it has none."""
    check_recipe(net, recipe)
    masks = {}
    kd, ko = jax.random.split(key)
    if recipe.drop:
        rates = net.drop_path_rates(recipe.drop_path_rate)
        keys = jax.random.split(kd, len(rates))
        masks["drop_path"] = jnp.stack([elementwise.keep_mask(k, (rows,), r, dtype)
                                        for k, r in zip(keys, rates, strict=True)])
    if recipe.dropout:
        masks["dropout"] = elementwise.keep_mask(ko, (rows, net.FEATURES), recipe.dropout_rate,
                                                 dtype)
    return masks


MASK_BATCH_AXIS = {"drop_path": 1, "dropout": 0}


def shard_masks(masks: dict, rep, row_order=None) -> dict:
    """This replica's rows of the global batch's ``masks`` (`draw_masks`), along each kind's
    `MASK_BATCH_AXIS`; on one device, the rows in ``row_order`` [R N] when given."""
    if row_order is not None:  # the same examples in another order keep their masks
        masks = {k: jnp.take(m, row_order, MASK_BATCH_AXIS[k]) for k, m in masks.items()}
    return {k: rep.shard_rows(m, MASK_BATCH_AXIS[k]) for k, m in masks.items()}


def accumulate(net, params: dict, buffers: dict, xs, ts, *, recipe, key, ctx: layers.Ctx,
               row_order=None, slice_dims: dict | None = None, packed: bool = True):
    """k micro-steps: xs [k, N, S, S, 3], ts [k, N, K] (this replica's rows). Returns (mean
    gradient over the k micro-steps, running statistics after them, mean loss). Each micro-step
    normalises over its own R*N rows and moves the running statistics at momentum m.
    row_order [N] (one device only): the rows are the global batch's in this order — the tie's
    noise floor reorders a batch and its masks alike. slice_dims: return only this replica's
    slices of the mean gradient; packed: the gradients in buckets, else a collective per tensor
    (both as `collectives.Replicas.grad_mean` takes them)."""
    k, n = xs.shape[0], xs.shape[1]
    rep = ctx.replicas
    if row_order is not None and rep.synced:
        raise ValueError("row_order reorders a single device's global batch, not a replica's")
    momentum = batchnorm.MOMENTUM  # every micro-step's forward, as timm's train.py accumulates
    alpha = recipe.effective_label_smoothing
    ts = (losses.bce_targets(ts, alpha, recipe.bce_threshold) if recipe.loss == "bce" else ts)

    def micro(carry, inp):
        grads, bufs, total = carry
        x, t, i = inp
        masks = draw_masks(net, recipe, jax.random.fold_in(key, i), n * rep.count, x.dtype)
        out = grad_step(net, params, bufs, x, t, ctx=ctx, loss=recipe.loss,
                        masks=shard_masks(masks, rep, row_order), collective=False, alpha=alpha,
                        momentum=momentum)
        grads = jax.tree.map(lambda a, g: a + g, grads, out.grads)
        return (grads, out.buffers, total + out.loss), None

    # Each replica sums its own gradients over the k micro-steps; they are all-reduced once,
    # after the scan: k times fewer gradient bytes than a collective per micro-step.
    zeros = rep.varying(jax.tree.map(jnp.zeros_like, params))
    loss_dtype = jax.tree.leaves(params)[0].dtype
    (grads, buffers, total), _ = jax.lax.scan(
        micro, (zeros, buffers, jnp.zeros((), loss_dtype)), (xs, ts, jnp.arange(k)))
    return (jax.tree.map(lambda g: g / k, rep.grad_mean(grads, slice_dims, packed)), buffers,
            total / k)


def train_step(net, state: TrainState, xs, ts, key, *, recipe,
               opt: optax.GradientTransformation, ctx: layers.Ctx,
               row_order=None) -> tuple[TrainState, dict]:
    """One optimizer step of ``recipe``: xs [k, N, S, S, 3], ts [k, N, K] soft targets (this
    replica's rows of the global micro-batches), key the step's key (the same on every replica).
    Returns (new state, {"loss", "lr"}). row_order: see `accumulate`."""
    grads, buffers, loss = accumulate(net, state.params, state.buffers, xs, ts, recipe=recipe,
                                      key=key, ctx=ctx, row_order=row_order)
    return update(state, grads, buffers, loss, recipe=recipe, opt=opt)


def update(state: TrainState, grads: dict, buffers: dict, loss, *, recipe,
           opt: optax.GradientTransformation, sliced=None,
           whole=None) -> tuple[TrainState, dict]:
    """The step after the gradient collective: the clip and the optimizer on the mean gradient
    ``grads``, then the EMA; ``buffers`` and ``loss`` as `accumulate` returns them. ``sliced`` /
    ``whole`` (params dict -> params dict, identity by default): where the optimizer's arithmetic
    runs — on the slices the optimizer state is spread in — and the new parameters, whole again
    (`twinstep.program.train_program` lays them out; the values are the same)."""
    sliced, whole = sliced or (lambda t: t), whole or (lambda t: t)
    params = sliced(state.params)
    updates, opt_state = opt.update(sliced(grads), state.opt_state, params)
    params = whole(optax.apply_updates(params, updates))
    step = state.step + 1
    averaged = state.ema
    if averaged is not None:
        kw = {"decay": recipe.ema_decay, "warmup": recipe.ema_warmup}
        averaged = (ema.ema_update(averaged[0], params, step, **kw),
                    ema.ema_update(averaged[1], buffers, step, **kw))
    lr = optim.recipe_schedule(recipe)(state.step)
    return TrainState(step, params, buffers, opt_state, averaged), {"loss": loss, "lr": lr}


def eval_logits(net, state: TrainState, x, ctx: layers.Ctx, use_ema: bool = False):
    """Eval-mode logits [N, K] of x [N, S, S, 3] with the raw weights and running statistics,
    or with their EMA (``use_ema``; the state must carry one)."""
    if use_ema and state.ema is None:
        raise ValueError("this state has no EMA (the recipe has no 'ema' token)")
    params, buffers = state.ema if use_ema else (state.params, state.buffers)
    return net.forward(params, buffers, x, dataclasses.replace(ctx, train=False))[0]
