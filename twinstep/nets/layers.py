"""The layers the nets are made of — conv -> BN [-> activation], the residual join, the pools,
squeeze-excite — and what every net shares: the context a forward runs in and the
running-statistics update (how tensors start: `twinstep.nets.init`).

These are the layer boundaries: each stores what it hands on (its output, or in the backward
the cotangent it hands back) as the levers' ``store`` asks (`twinstep.ops.precision.stored`),
and reads every other lever from the context, so that a net calls neither (docs/nets.md).

Parameters live in a flat dict keyed by timm's state_dict names; a layer is addressed by its
prefixes (``conv="layer1.0.conv1"``, ``bn="layer1.0.bn1"``). A forward returns (y, tape): the
tape holds the residuals its VJP consumes, in the same trace (never across a jit boundary).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from twinstep.collectives import SINGLE, Replicas
from twinstep.ops import activation, batchnorm, conv, dense, elementwise, pool
from twinstep.ops.levers import Levers
from twinstep.ops.precision import F32, Precision, stored


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ctx:
    """What a forward runs in: replicas (BN sync), precision policy, train (batch statistics)
    or eval (running statistics), and the levers, every one resolved (`Levers.on`; default:
    this process's platform's)."""

    replicas: Replicas = SINGLE
    precision: Precision = F32
    train: bool = True
    levers: Levers = dataclasses.field(default_factory=lambda: Levers().on())

    def stored(self, x):
        """x as the levers store it between ops."""
        return stored(x, self.levers.store)


class ConvBN(NamedTuple):
    conv: str  # prefix of the conv weight, e.g. "layer1.0.conv1" -> "layer1.0.conv1.weight"
    bn: str  # prefix of the BN, e.g. "layer1.0.bn1" -> ".weight", ".bias", ".running_mean", ...


class ConvBNTape(NamedTuple):
    names: ConvBN
    depthwise: bool
    train: bool
    conv: conv.ConvRes
    bn: batchnorm.BNRes
    act: tuple | None  # (the activation's name, its residuals), or None


# The activations a layer may end with: name -> (forward x -> (y, residuals), its VJP). ReLU
# keeps its mask as the levers ask (`Levers.relu_mask`); the others have no lever.
ACTIVATIONS = {
    "relu": (lambda x, levers: activation.relu_forward(x, levers.relu_mask), activation.relu_vjp),
    "relu6": (lambda x, levers: activation.relu6_forward(x), activation.relu6_vjp),
    "silu": (lambda x, levers: activation.silu_forward(x), activation.silu_vjp),
}


def act_forward(kind: str | None, x, levers: Levers):
    """x -> (kind(x), (kind, residuals)), ``kind`` a key of `ACTIVATIONS`; None: (x, None)."""
    if kind is None:
        return x, None
    y, res = ACTIVATIONS[kind][0](x, levers)
    return y, (kind, res)


def act_vjp(tape, dy):
    """dx of `act_forward` from its tape."""
    if tape is None:
        return dy
    kind, res = tape
    return ACTIVATIONS[kind][1](res, dy)


def conv_bn_forward(params, buffers, names: ConvBN, x, *, stride: int, ctx: Ctx,
                    act: str | None = "relu", depthwise: bool = False,
                    stats: dict | None = None):
    """x [N, H, W, Ci] -> conv -> BN -> [act] -> y [N, Ho, Wo, Co], stored; returns (y, tape).
    ``act``: a key of `ACTIVATIONS`, or None.

    In train mode the BN's batch statistics are recorded in ``stats[names.bn]``."""
    w, levers = params[names.conv + ".weight"], ctx.levers
    if depthwise:
        y, conv_res = conv.depthwise_forward(x, w, stride, ctx.precision,
                                             path=levers.depthwise_path,
                                             crop_unread=levers.crop_unread)
    else:
        y, conv_res = conv.conv2d_forward(x, w, stride, ctx.precision, path=levers.dense_path,
                                          crop_unread=levers.crop_unread)
    gamma, beta = params[names.bn + ".weight"], params[names.bn + ".bias"]
    if ctx.train:
        y, bn_res, bn_stats = batchnorm.bn_train_forward(y, gamma, beta, ctx.replicas,
                                                         moments=levers.bn_moments)
        if stats is not None:
            stats[names.bn] = bn_stats
    else:
        y, bn_res = batchnorm.bn_eval_forward(y, gamma, beta, buffers[names.bn + ".running_mean"],
                                              buffers[names.bn + ".running_var"])
    y, act_res = act_forward(act, y, levers)
    return ctx.stored(y), ConvBNTape(names, depthwise, ctx.train, conv_res, bn_res, act_res)


def conv_bn_vjp(tape: ConvBNTape, dy, grads: dict):
    """dx of `conv_bn_forward`; the conv and BN parameter gradients are written into ``grads``."""
    dy = act_vjp(tape.act, dy)
    bn_vjp = batchnorm.bn_train_vjp if tape.train else batchnorm.bn_eval_vjp
    dy, grads[tape.names.bn + ".weight"], grads[tape.names.bn + ".bias"] = bn_vjp(tape.bn, dy)
    conv_vjp = conv.depthwise_vjp if tape.depthwise else conv.conv2d_vjp
    dx, grads[tape.names.conv + ".weight"] = conv_vjp(tape.conv, dy)
    return dx


class ResidualTape(NamedTuple):
    drop: jax.Array | None  # the drop-path mask's residual, or None
    relu: jax.Array | None  # the ReLU's mask after the add, or None
    levers: Levers  # the forward's (its store: the backward stores alike)


def residual_forward(branch, shortcut, *, ctx: Ctx, mask=None, relu: bool = False):
    """A residual block's end: branch [N, H, W, C] [times its drop-path ``mask`` [N]] plus
    shortcut [N, H, W, C] [-> ReLU], stored; returns (y, tape)."""
    drop = None
    if mask is not None:
        branch, drop = elementwise.mask_forward(branch, mask)
    y, kept = elementwise.add_forward(branch, shortcut), None
    if relu:
        y, kept = activation.relu_forward(y, ctx.levers.relu_mask)
    return ctx.stored(y), ResidualTape(drop, kept, ctx.levers)


def residual_vjp(tape: ResidualTape, dy):
    """(d branch, d shortcut) of `residual_forward`; the drop-path mask's product stored."""
    if tape.relu is not None:
        dy = activation.relu_vjp(tape.relu, dy)
    d_branch, d_shortcut = elementwise.add_vjp(dy)
    if tape.drop is not None:
        d_branch = stored(elementwise.mask_vjp(tape.drop, d_branch), tape.levers.store)
    return d_branch, d_shortcut


def fork_vjp(tape: ResidualTape, d_from_branch, d_from_shortcut):
    """The cotangent of a block's input, which its branch and its shortcut both read: the sum
    of the two, stored."""
    return stored(d_from_branch + d_from_shortcut, tape.levers.store)


class PoolTape(NamedTuple):
    res: object  # the pool op's residuals
    levers: Levers  # the forward's (its store: the backward stores alike)


def maxpool_forward(x, *, ctx: Ctx):
    """3x3/2 max-pool (`twinstep.ops.pool`); returns (y, tape). Its output is not stored
    again: its values are its stored input's."""
    y, res = pool.maxpool_forward(x)
    return y, PoolTape(res, ctx.levers)


def maxpool_vjp(tape: PoolTape, dy):
    """dx of `maxpool_forward`, stored."""
    return stored(pool.maxpool_vjp(tape.res, dy), tape.levers.store)


def gap_forward(x, *, ctx: Ctx):
    """Global average pool x [N, H, W, C] -> [N, C]; returns (y, tape). Not stored: the head
    reads it at once."""
    y, res = pool.gap_forward(x)
    return y, PoolTape(res, ctx.levers)


def gap_vjp(tape: PoolTape, dy):
    """dx [N, H, W, C] of `gap_forward`, stored."""
    return stored(pool.gap_vjp(tape.res, dy), tape.levers.store)


class SETape(NamedTuple):
    prefix: str
    gap: PoolTape
    reduce: conv.ConvRes
    act: tuple | None
    expand: conv.ConvRes
    sigmoid: jax.Array  # the gate [N, 1, 1, C]
    gate: tuple
    levers: Levers  # the forward's (its store: the backward stores alike)


def squeeze_excite_forward(params, prefix: str, x, *, ctx: Ctx, act: str):
    """timm's SqueezeExcite at ``prefix``: x [N, H, W, C] times the gate sigmoid(conv_expand(
    act(conv_reduce(mean of x over H, W)))) [N, C], stored; returns (y, tape). Its two 1x1
    convs, ``conv_reduce`` [R, C, 1, 1] and ``conv_expand`` [C, R, 1, 1], carry biases and act
    on the pooled [N, 1, 1, C]. Every quantity is per example: no replica talks here."""
    levers, prec = ctx.levers, ctx.precision
    pooled, gap = gap_forward(x, ctx=ctx)

    def conv_bias(name, v):
        y, res = conv.conv2d_forward(v, params[f"{prefix}.{name}.weight"], 1, prec,
                                     path=levers.dense_path, crop_unread=levers.crop_unread)
        return elementwise.bias_forward(y, params[f"{prefix}.{name}.bias"]), res

    h, reduce = conv_bias("conv_reduce", pooled[:, None, None, :])
    h, act_res = act_forward(act, h, levers)
    g, expand = conv_bias("conv_expand", h)
    g, sig = activation.sigmoid_forward(g)
    y, gate = elementwise.gate_forward(x, g[:, 0, 0, :])
    return ctx.stored(y), SETape(prefix, gap, reduce, act_res, expand, sig, gate, levers)


def squeeze_excite_vjp(tape: SETape, dy, grads: dict):
    """dx of `squeeze_excite_forward`, stored: the gate's direct path plus the pool's; the four
    parameter gradients are written into ``grads``."""
    p = tape.prefix
    dx, dg = elementwise.gate_vjp(tape.gate, dy)
    dz = activation.sigmoid_vjp(tape.sigmoid, dg[:, None, None, :])
    dz, grads[f"{p}.conv_expand.bias"] = elementwise.bias_vjp(dz)
    dh, grads[f"{p}.conv_expand.weight"] = conv.conv2d_vjp(tape.expand, dz)
    dh, grads[f"{p}.conv_reduce.bias"] = elementwise.bias_vjp(act_vjp(tape.act, dh))
    dp, grads[f"{p}.conv_reduce.weight"] = conv.conv2d_vjp(tape.reduce, dh)
    return stored(dx + pool.gap_vjp(tape.gap.res, dp[:, 0, 0, :]), tape.levers.store)


def layer_vjp(tape, dy, grads: dict):
    """dx of one layer of a chain from its tape: conv -> BN [-> act], or squeeze-excite."""
    vjp = squeeze_excite_vjp if isinstance(tape, SETape) else conv_bn_vjp
    return vjp(tape, dy, grads)


def skip_block_vjp(tape, dy, grads: dict):
    """dx of a block that is a chain of layers [plus an identity skip, its end joined by
    `residual_forward`]: ``tape`` = (the layers' tapes in order, the join's tape or None)."""
    tapes, skip = tape
    d_shortcut = None
    if skip is not None:
        dy, d_shortcut = residual_vjp(skip, dy)
    for t in reversed(tapes):
        dy = layer_vjp(t, dy, grads)
    return dy if skip is None else fork_vjp(skip, dy, d_shortcut)


def block_masks(skips, drop_path) -> list:
    """Each block's drop-path mask [N], or None: the rows of ``drop_path`` [sites, N] (or None)
    dealt in order to the blocks whose ``skips`` entry is true, the drop-path sites."""
    out, site = [], 0
    for skip in skips:
        out.append(drop_path[site] if skip and drop_path is not None else None)
        site += bool(skip)
    return out


def classifier_forward(params, prefix: str, y, dropout=None):
    """The head's end: y [N, D] [times its dropout mask [N, D]] -> logits [N, K] through the
    linear layer ``prefix`` (``.weight`` [K, D], ``.bias`` [K]); returns (logits, tape)."""
    m = None
    if dropout is not None:
        y, m = elementwise.mask_forward(y, dropout)
    logits, fc = dense.dense_forward(y, params[prefix + ".weight"], params[prefix + ".bias"])
    return logits, (prefix, m, fc)


def classifier_vjp(tape, dlogits, grads: dict):
    """dy [N, D] of `classifier_forward`; the weight and bias gradients go into ``grads``."""
    prefix, m, fc = tape
    dy, grads[prefix + ".weight"], grads[prefix + ".bias"] = dense.dense_vjp(fc, dlogits)
    return dy if m is None else elementwise.mask_vjp(m, dy)


def bn_names(param_shapes: dict) -> list[str]:
    """BN prefixes in network order: every ``X.weight`` that has a 1-D shape and an ``X.bias``
    but is not the classifier."""
    return [k[:-len(".weight")] for k, s in param_shapes.items()
            if k.endswith(".weight") and len(s) == 1]


def buffer_shapes(param_shapes: dict) -> dict:
    """The BN running-statistics buffers, in timm's order: ``X.running_mean``, ``X.running_var``."""
    out = {}
    for bn in bn_names(param_shapes):
        c = param_shapes[bn + ".weight"]
        out[bn + ".running_mean"], out[bn + ".running_var"] = c, c
    return out


def update_running(buffers: dict, stats: dict, momentum: float = batchnorm.MOMENTUM) -> dict:
    """Every BN's running statistics from this step's global batch statistics."""
    out = dict(buffers)
    for bn, s in stats.items():
        out[bn + ".running_mean"], out[bn + ".running_var"] = batchnorm.bn_running_update(
            buffers[bn + ".running_mean"], buffers[bn + ".running_var"], s, momentum)
    return out
