"""BatchNorm: training mode split into its sync sites (docs/sync-sites.md), eval mode, running
statistics.

Training mode normalises each channel over every row of the GLOBAL batch — on one device its
N·H·W rows, on R replicas all R·N·H·W rows — with the biased variance, eps = 1e-5; each
shard's moments two-pass, or one-pass where a GPU's programs ask (`MOMENTS`).
The `Replicas` context decides which: the same code is the single-device op (no collective)
and the replica op inside ``jax.shard_map``.

Sites, in the order the step meets them:
- forward site  `bn_forward_site`: one gather of every replica's [mu_r, var_r], then on each
  replica mu = mean_r mu_r; var = mean_r (var_r + (mu_r - mu)^2) (Chan's parallel variance:
  exact for equal shards, never E[x^2] - E[x]^2 across shards; the gather lets it take one
  round, not two).
- backward site `bn_backward_site`: one collective of [mean(g.dy), mean(xhat.g.dy)], then
  dx = rstd (g.dy - mean(g.dy) - xhat mean(xhat.g.dy)), xhat from the GLOBAL mu, var.
- gamma, beta nodes `bn_gamma_grad`, `bn_beta_grad`: sum(dy.xhat) with the GLOBAL statistics,
  sum(dy) — this replica's share; the step's gradient collective averages them once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from twinstep.collectives import SINGLE, Replicas

EPS = 1e-5
MOMENTUM = 0.1  # timm / PyTorch: running <- (1 - m) running + m batch
_ROWS = (0, 1, 2)  # N, H, W of an NHWC activation


@functools.partial(jax.tree_util.register_dataclass, data_fields=["mean", "var"],
                   meta_fields=["count"])
@dataclasses.dataclass(frozen=True)
class BNStats:
    """A step's batch statistics of one BN layer: global mean and biased variance [C], and the
    number of rows they reduce (R·N·H·W)."""

    mean: jax.Array
    var: jax.Array
    count: int


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "mean", "rstd", "gamma"],
                   meta_fields=["replicas"])
@dataclasses.dataclass(frozen=True)
class BNRes:
    x: jax.Array  # [N, H, W, C] this replica's input
    mean: jax.Array  # [C] global
    rstd: jax.Array  # [C] (var + eps)^(-1/2), global
    gamma: jax.Array  # [C]
    replicas: Replicas

    @property
    def xhat(self):
        return (self.x - self.mean) * self.rstd


MOMENTS = ("two-pass", "one-pass")


def _shard_moments(x, moments: str = "two-pass"):
    """This replica's channel mean and biased variance: ``two-pass`` (mean, then the mean
    squared deviation) or ``one-pass``, E[x^2] - E[x]^2 clamped at 0, both sums read in one
    pass over x (docs/precision.md#gpu-levers)."""
    mu = jnp.mean(x, axis=_ROWS)
    if moments == "one-pass":
        return mu, jnp.maximum(jnp.mean(jnp.square(x), axis=_ROWS) - jnp.square(mu), 0)
    if moments != "two-pass":
        raise ValueError(f"unknown BN moments {moments!r}; choose {' or '.join(MOMENTS)}")
    return mu, jnp.mean(jnp.square(x - mu), axis=_ROWS)


def bn_forward_site(x, replicas: Replicas = SINGLE, *, moments: str) -> BNStats:
    """Global statistics of x [N, H, W, C] over all replicas' rows (one gather collective);
    ``moments``: how each shard's are computed (`_shard_moments`)."""
    mu, var = _shard_moments(x, moments)
    if replicas.bn_synced:  # else this shard's statistics (one device, or the `unsynced` control)
        mu_r, var_r = replicas.gather(jnp.stack([mu, var]), "bn_forward").swapaxes(0, 1)
        mu = jnp.mean(mu_r, axis=0)  # mu_r, var_r: [R, C]
        var = jnp.mean(var_r + jnp.square(mu_r - mu), axis=0)
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    return BNStats(mu, var, rows * (replicas.count if replicas.bn_synced else 1))


def bn_train_forward(x, gamma, beta, replicas: Replicas = SINGLE, *, moments: str):
    """y = xhat * gamma + beta with global batch statistics. Returns (y, BNRes, BNStats).
    ``moments``: `MOMENTS` (`bn_forward_site`)."""
    stats = bn_forward_site(x, replicas, moments=moments)
    res = BNRes(x, stats.mean, lax.rsqrt(stats.var + EPS), gamma, replicas)
    return res.xhat * gamma + beta, res, stats


def bn_backward_site(res: BNRes, dy):
    """dx [N, H, W, C] from dy: the backward statistics averaged over replicas (one collective)."""
    xhat, gdy = res.xhat, res.gamma * dy
    local = jnp.stack([jnp.mean(gdy, axis=_ROWS), jnp.mean(xhat * gdy, axis=_ROWS)])
    m_gdy, m_xgdy = res.replicas.bn_mean(local, "bn_backward")
    return res.rstd * (gdy - m_gdy - xhat * m_xgdy)


def bn_gamma_grad(res: BNRes, dy):
    """This replica's share of d gamma [C]: sum(dy * xhat), xhat from the GLOBAL statistics."""
    xhat = res.xhat
    if res.replicas.control == "shard-gamma":  # the classic bug, kept as a negative control
        mu_r, var_r = _shard_moments(res.x)
        xhat = (res.x - mu_r) * lax.rsqrt(var_r + EPS)
    return jnp.sum(dy * xhat, axis=_ROWS)


def bn_beta_grad(dy):
    return jnp.sum(dy, axis=_ROWS)


def bn_train_vjp(res: BNRes, dy):
    """(dx, d gamma, d beta) of `bn_train_forward`."""
    return bn_backward_site(res, dy), bn_gamma_grad(res, dy), bn_beta_grad(dy)


def bn_eval_forward(x, gamma, beta, running_mean, running_var):
    """Eval mode: normalise by the running statistics. Returns (y, BNRes)."""
    res = BNRes(x, running_mean, lax.rsqrt(running_var + EPS), gamma, SINGLE)
    return res.xhat * gamma + beta, res


def bn_eval_vjp(res: BNRes, dy):
    """(dx, d gamma, d beta) of `bn_eval_forward` (the statistics are constants)."""
    return dy * res.gamma * res.rstd, jnp.sum(dy * res.xhat, axis=_ROWS), bn_beta_grad(dy)


def bn_running_update(running_mean, running_var, stats: BNStats, momentum=MOMENTUM):
    """PyTorch semantics: running <- (1 - m) running + m batch, where the running VARIANCE takes
    the UNBIASED batch variance var * n / (n - 1), n = rows reduced (over all replicas)."""
    n = stats.count
    unbiased = stats.var * (n / max(n - 1, 1))
    return ((1 - momentum) * running_mean + momentum * stats.mean,
            (1 - momentum) * running_var + momentum * unbiased)
