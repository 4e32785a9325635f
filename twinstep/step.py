"""The train step: where forward, loss, backward and the gradient collective meet.

`grad_step` is ONE function for both twins: called with the single-device context it is the
step at the global batch; called inside ``shard_map`` with a `Replicas` context it is the
replica step — BN synchronised at its sites (ops/batchnorm), the loss divided by THIS replica's
batch, every parameter gradient all-reduced by its mean exactly once, and the reported loss the
mean of the replicas' losses.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.nets import layers
from twinstep.ops import loss as losses


class StepOut(NamedTuple):
    loss: object  # scalar, the global batch's mean loss
    grads: dict  # {timm name: gradient}, identical on every replica
    stats: dict  # {bn: BNStats}, the global batch statistics
    buffers: dict  # running statistics after the step
    logits: object  # [N, K] this replica's rows


def loss_and_cotangent(kind: str, logits, targets, divisor, alpha: float = 0.1):
    """(mean loss, d logits) of CE (label smoothing alpha) or BCE (targets already transformed)."""
    if kind == "ce":
        return losses.smoothed_ce(logits, targets, alpha, divisor)
    if kind == "bce":
        return losses.bce(logits, targets, divisor)
    raise ValueError(f"unknown loss {kind!r}; choose ce or bce")


def grad_step(net, params: dict, buffers: dict, x, targets, ctx: layers.Ctx, loss: str = "ce",
              masks: dict | None = None, collective: bool = True) -> StepOut:
    """x [N, H, W, 3], targets [N, K] -> StepOut. ``masks``: keyword masks of net.forward
    (drop_path, dropout), this replica's rows of masks drawn for the global batch.
    ``collective=False`` returns this replica's own gradient nodes (to measure them)."""
    rep = ctx.replicas
    logits, tape, stats = net.forward(params, buffers, x, ctx, **(masks or {}))
    n = x.shape[0] * (rep.count if rep.control == "wrong-divisor" else 1)
    value, dlogits = loss_and_cotangent(loss, logits, targets.astype(logits.dtype),
                                        losses.loss_divisor(loss, n, logits.shape[-1]))
    grads = net.backward(tape, dlogits)
    grads = rep.grad_mean(grads) if collective else grads
    return StepOut(rep.mean(value), grads, stats, layers.update_running(buffers, stats), logits)
