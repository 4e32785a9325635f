"""What a tie starts from: its precision policy (`tie_precision`), its parameters and global
batch (`setup`), and a lower bound on the memory it holds (`memory_floor`). The batches are
synthetic — Gaussian images whose replica shards are shifted apart, soft (mixup) targets —
from one generator (`batch`) for the one-step tie, the whole-step ties and the benchmarks, so
that a given seed means the same data everywhere."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import dp, program
from twinstep.nets import init, layers
from twinstep.ops import loss as losses
from twinstep.ops.precision import Precision, get_precision

SHIFT = 1.0  # replica r's images are offset by r: Chan's correction term is then O(1)
MIXUP_LAMBDA = (0.3, 1.0)  # the mixing weight's range: every target row is soft
# near-init's betas are this N(0, 1), not init.near_init_bn's NEAR_INIT_SCALE N(0, 1): where a
# BN's output reaches the next BN through per-channel positively homogeneous maps only (ReLU,
# depthwise convs), per channel gamma g_gamma = -beta g_beta: gamma's gradient is a cancellation
# to |beta| / gamma of its terms, and f32 resolves it that much worse (docs/tie.md#f32)
NEAR_INIT_BETA = 0.1


def batch(rng: np.random.Generator, lead: tuple, *, res: int, classes: int, replicas: int,
          shift: bool, dtype):
    """(x [*lead, S, S, 3], t [*lead, K]) in ``dtype``; the last axis of ``lead`` holds the
    R N rows (``lead`` = (R N,) for a batch, (k, R N) for k micro-batches). Images are standard
    normal, replica r's rows offset by r SHIFT when ``shift``; targets are lam a + (1 - lam) b
    for random one-hot a, b — both losses' cotangents are affine in t, so soft targets check
    what one-hot targets would and more."""
    x = jnp.asarray(rng.standard_normal((*lead, res, res, 3)), dtype)
    if shift:
        x = (dp.shift_shards(x, replicas, SHIFT) if len(lead) == 1 else
             jnp.stack([dp.shift_shards(m, replicas, SHIFT) for m in x]))
    lam = rng.uniform(*MIXUP_LAMBDA, (*lead, 1))
    a, b = (np.eye(classes)[rng.integers(0, classes, lead)] for _ in range(2))
    return x, jnp.asarray(lam * a + (1 - lam) * b, dtype)


def tie_precision(name: str) -> Precision:
    """The policy both programs run under: bf16 keeps its rounding points with f64 around them
    (why: docs/tie.md#bf16)."""
    return Precision("bf16", base="f64") if name == "bf16" else get_precision(name)


def setup(cfg, net):
    """(params, buffers, x [R N, S, S, 3], t [R N, K]) of the tie ``cfg`` (a
    `twinstep.checking.tie.TieConfig`): its state (random-bn, or near-init with its betas
    NEAR_INIT_BETA N(0, 1)), its batch."""
    prec = tie_precision(cfg.precision)
    key = jax.random.key(cfg.seed)
    shapes = net.param_shapes(cfg.classes)
    params = init.init_params(key, shapes, dtype=prec.dtype, linear=net.LINEAR_INIT)
    buffers = init.init_buffers(shapes, prec.dtype)
    if cfg.state == "near-init":
        params = init.near_init_bn(jax.random.fold_in(key, 1), params, net.branch_end_bns())
        widen = NEAR_INIT_BETA / init.NEAR_INIT_SCALE  # the same draws, NEAR_INIT_BETA N(0, 1)
        params |= {f"{bn}.bias": params[f"{bn}.bias"] * widen for bn in layers.bn_names(shapes)}
    else:
        params, buffers = init.randomize_bn(jax.random.fold_in(key, 1), params, buffers)
    rng = np.random.default_rng(cfg.seed)
    x, t = batch(rng, (cfg.replicas * cfg.batch,), res=cfg.res, classes=cfg.classes,
                 replicas=cfg.replicas, shift=cfg.shift, dtype=prec.dtype)
    if cfg.loss == "bce":
        t = losses.bce_targets(t, smoothing=0.1)
    return params, buffers, x, t


def nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def memory_floor(cfg, net, prec: Precision) -> int:
    """A lower bound on the bytes a tie holds at once, from shapes alone (nothing runs): the
    activations the single-device step saves for its backward at R N rows (its tape, by
    jax.eval_shape) and four parameter-sized trees (parameters, buffers, two gradients)."""
    params, buffers = program.abstract_params(net, cfg.classes, prec.dtype)
    x = jax.ShapeDtypeStruct((cfg.replicas * cfg.batch, cfg.res, cfg.res, 3), prec.dtype)
    ctx = program.Setup(precision=prec).context()

    def saved(p, b, x):  # the tape's arrays (it also holds names)
        return [a for a in jax.tree.leaves(net.forward(p, b, x, ctx)[1]) if hasattr(a, "dtype")]

    return nbytes(jax.eval_shape(saved, params, buffers, x)) + 4 * nbytes(params)


MEMORY_ADVICE = "lower --replicas, --batch or --res"
