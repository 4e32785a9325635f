"""Oracles that certify the op library (test and `twinstep certify` only — never the step).

Each op is a `Case` (`twinstep.checking.cases`): its product forward (output + residuals) and
hand-written VJP, with inputs split into differentiable batch tensors (sharded with the batch),
masks (sharded, constant) and parameters (replicated). Against it:

- `check_vjp`: the hand VJP against ``jax.vjp`` of the same forward (norm-relative, TOL_VJP);
- `check_fd`: a random directional derivative against central finite differences (TOL_FD);
- `check_dp_facts`: the four data-parallel facts (docs/tie.md) under ``jax.shard_map`` on R devices
  — (1) sharding: replica r's output and input cotangent are shard r of the global op's,
  (2) collectives: the replica mean of each parameter-gradient node is 1/R of the global node,
  (3) homogeneity: VJP(s g) = s VJP(g),
  (4) the divisor (losses): a replica's cotangent is R x its shard of the global cotangent.
Every "equal" here has negative controls (`twinstep.collectives.CONTROLS`) that must fail it.
All checks are meant for float64 (``jax_enable_x64``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import dp
from twinstep.checking.bounds import rel as rel_err
from twinstep.checking.cases import Case, loss_case_fn, normal, soft_targets
from twinstep.collectives import SINGLE, Replicas
from twinstep.ops import batchnorm

TOL_VJP = 1e-12  # hand VJP vs jax.vjp, norm-relative
TOL_FD = 1e-6  # directional derivative vs central differences, relative
FD_STEP = 1e-6
TOL_DP = 1e-12  # each data-parallel fact, norm-relative


def worst(pairs) -> float:
    return max((rel_err(a, b) for a, b in pairs), default=0.0)


@dataclasses.dataclass(frozen=True)
class Check:
    op: str
    check: str
    err: float
    tol: float
    replicas: int = 1
    control: str = "none"

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.err) and self.err <= self.tol)


# ----------------------------------------------------------------------------- single device


def _fwd_out(case: Case, batch, params):
    return case.forward(SINGLE, batch, case.masks, params)[0]


def _hand_vjp(case: Case, batch, params, dy):
    return case.vjp(case.forward(SINGLE, batch, case.masks, params)[1], dy)


def _cotangent(rng, y):
    return rng.standard_normal(np.shape(y))


def _jit(fn):
    """These programs are small and each is compiled once: XLA's -O0 (`dp.FAST_COMPILE`, the same
    numerics) compiles them faster than they would ever run."""
    return dp.jit(fn, fast_compile=True)


def check_vjp(case: Case, rng) -> Check:
    """Hand VJP vs jax.vjp of the same forward, worst norm-relative error over all inputs."""
    y = _jit(lambda b, p: _fwd_out(case, b, p))(case.batch, case.params)
    dy = _cotangent(rng, y)
    hand = _jit(lambda b, p, g: _hand_vjp(case, b, p, g))(case.batch, case.params, dy)
    ref = _jit(lambda b, p, g: jax.vjp(lambda b_, p_: _fwd_out(case, b_, p_), b, p)[1](g))(
        case.batch, case.params, dy)
    err = worst(zip(jax.tree.leaves(hand), jax.tree.leaves(ref), strict=True))
    return Check(case.name, "vjp vs jax.vjp", err, TOL_VJP)


def check_fd(case: Case, rng) -> Check:
    """<dy, (f(u + h v) - f(u - h v)) / 2h> vs <VJP(dy), v> for a random direction v (the
    arithmetic around the two programs in NumPy: eager JAX would compile each op per shape)."""
    fwd = _jit(lambda b, p: _fwd_out(case, b, p))
    dy = _cotangent(rng, fwd(case.batch, case.params))
    hand = jax.tree.leaves(_jit(lambda b, p, g: _hand_vjp(case, b, p, g))(
        case.batch, case.params, dy))
    inputs = jax.tree.map(np.asarray, (case.batch, case.params))
    v = jax.tree.map(lambda a: _cotangent(rng, a), inputs)
    shifted = [jax.tree.map(lambda a, d, s=s: a + s * FD_STEP * d, inputs, v) for s in (1, -1)]
    plus, minus = (np.asarray(fwd(b, p)) for b, p in shifted)
    fd = float(np.sum(dy * (plus - minus)) / (2 * FD_STEP))
    an = float(sum(np.sum(np.asarray(g) * d) for g, d in zip(hand, jax.tree.leaves(v),
                                                               strict=True)))
    return Check(case.name, "vjp vs finite differences", abs(fd - an) / max(abs(an), 1e-12), TOL_FD)


# ------------------------------------------------------------------------ data-parallel facts


def _replica_run(batch, masks, params, dy, *, case: Case, rep: Replicas):
    """Inside shard_map: forward, hand VJP, and the parameter-gradient collective."""
    y, res = case.forward(rep, batch, masks, params)
    d_batch, d_params = case.vjp(res, dy)
    return y, d_batch, rep.grad_mean(d_params)


def check_dp_facts(case: Case, count: int, rng, shift: float = 1.0,
                   control: str = "none") -> list[Check]:
    """Facts (1)-(3) for a per-example or BN op on ``count`` replicas (global batch = the case's
    batch, which must divide by ``count``)."""
    batch = tuple(dp.shift_shards(b, count, shift) for b in case.batch)
    y = _jit(lambda b, p: _fwd_out(case, b, p))(batch, case.params)
    dy = _cotangent(rng, y)
    d_batch, d_params = _jit(lambda b, p, g: _hand_vjp(case, b, p, g))(batch, case.params, dy)
    rep = dp.replicas(count, control)
    run = dp.replica_map(lambda b, m, p, g: _replica_run(b, m, p, g, case=case, rep=rep), count,
                         (dp.BATCH, dp.BATCH, dp.REPLICATED, dp.BATCH),
                         (dp.BATCH, dp.BATCH, dp.REPLICATED), fast_compile=True)
    ry, rd_batch, rd_params = run(batch, case.masks, case.params, dy)
    s = 2.5
    _, sd_batch, sd_params = run(batch, case.masks, case.params, s * dy)
    checks = [
        Check(case.name, "sharding", worst([(ry, y), *zip(rd_batch, d_batch, strict=True)]),
              TOL_DP, count, control),
        Check(case.name, "homogeneity",
              worst(zip(jax.tree.leaves((sd_batch, sd_params)),
                        [s * a for a in jax.tree.leaves((rd_batch, rd_params))], strict=True)),
              TOL_DP, count, control),
    ]
    if case.params:
        checks.append(Check(case.name, "collectives",
                            worst((a, b / count) for a, b in zip(rd_params, d_params, strict=True)),
                            TOL_DP, count, control))
    return checks


def check_divisor(kind: str, count: int, rng, *, n: int = 2, k: int = 5,
                  control: str = "none") -> Check:
    """Fact (4): each replica's loss cotangent is R x its shard of the global cotangent."""
    z = normal(rng, (count * n, k)) * 2.0
    t = soft_targets(rng, count * n, k)
    f = loss_case_fn(kind)
    _, dz = f(z, t, SINGLE)
    rep = dp.replicas(count, control)
    run = dp.replica_map(lambda a, b: f(a, b, rep)[1], count, (dp.BATCH, dp.BATCH), dp.BATCH)
    return Check(f"loss {kind}", "divisor", rel_err(run(z, t), count * dz), TOL_DP, count, control)


# ------------------------------------------------------------- the variance exchange (control)


def naive_moments_exchange(x, rep: Replicas):
    """The one-round E[x^2] - E[x]^2 exchange — a known-bad formula, kept only as a control:
    it cancels catastrophically when the mean is large against the spread."""
    m1 = rep.mean(jnp.mean(x, axis=(0, 1, 2)), "bn_forward")
    m2 = rep.mean(jnp.mean(x * x, axis=(0, 1, 2)), "bn_forward")
    return m1, m2 - m1 * m1


def chan_bound(count: int, offset: float, rows: int, shift: float = 1.0) -> float:
    """The most f32 can leave of Chan's combined variance, relative, for ``count`` shards of
    ``rows`` unit-normal values near ``offset``, shard r shifted by r ``shift``. A shard mean is
    off by at most half an ulp of ``offset`` (its rounding) plus the worst case of summing its
    rows in f32, (rows - 1) u |x|; the global mean, the mean of the shard means, adds its own.
    The term (mu_r - mu)^2 carries the error of mu_r - mu times 2 |mu_r - mu| <= (R - 1) shift,
    against the variance 1 + shift^2 (R^2 - 1) / 12. The shard variances, of differences
    x - mu_r that f32 forms exactly, add only that error's square."""
    u, top = 2.0**-24, offset + count * shift
    half_ulp = float(np.spacing(np.float32(offset))) / 2
    shard_mean = half_ulp + (rows - 1) * u * top
    diff = 2 * shard_mean + half_ulp + (count - 1) * u * top  # mu_r - mu
    var = 1 + shift**2 * (count**2 - 1) / 12
    return ((count - 1) * shift * diff + diff**2) / var


def variance_exchange_errors(count: int, rng, *, offset: float = 1e4, n=4, h=4, c=8):
    """Relative error of the global variance from f32 shards sharing a large offset, against the
    float64 variance of the same f32 values: (Chan's two-round form, the naive one-round form,
    `chan_bound`)."""
    x64 = dp.shift_shards(normal(rng, (count * n, h, h, c), offset), count, 1.0)
    x32 = x64.astype(jnp.float32)
    truth = jnp.var(x32.astype(jnp.float64), axis=(0, 1, 2))  # of the values the replicas hold
    rep = dp.replicas(count)
    # Chan's two rounds over two-pass shard moments, as `chan_bound` derives its bound
    chan = dp.replica_map(lambda x: batchnorm.bn_forward_site(x, rep, moments="two-pass").var,
                          count, dp.BATCH, dp.REPLICATED)(x32)
    naive = dp.replica_map(lambda x: naive_moments_exchange(x, rep)[1], count, dp.BATCH,
                           dp.REPLICATED)(x32)
    return rel_err(chan, truth), rel_err(naive, truth), chan_bound(count, offset, n * h * h)
