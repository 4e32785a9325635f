"""Every place where replicas talk.

A `Replicas` context is handed to the ops that need the batch across replicas (the BatchNorm
sites) and to the step's gradient collective. With ``axis=None`` it is the single device and
emits no collective at all, so the same op code is the single-device program and, inside
``jax.shard_map`` over a named mesh axis, the replica program.

Three collective kinds, in the dtype of the statistic they carry (f32, or f64 in the exact
checks; never bf16 — the callers keep BN and gradients in f32): a MEAN over the replica axis (an
all-reduce); for a BN's forward moments a GATHER (an all-gather) of every replica's row, which
each replica then combines itself in the same order, so that the two-round exact combination costs
one round; and where the optimizer state is spread over the replicas in slices, a gradient
bucket's mean SCATTERED (a reduce-scatter): each replica receives only its slices.

``control`` deliberately breaks one sync site, so that the checks that say "equal" can be shown
to catch the classic data-parallel bugs (see `CONTROLS`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

# A control names one classic bug; the tie and the certification must FAIL under each.
CONTROLS = {
    "none": "every site synchronised as designed",
    "unsynced": "BatchNorm uses per-replica statistics (forward and backward)",
    "shard-gamma": "BN's gamma gradient reads this shard's statistics, not the global ones",
    "sum": "every replica collective sums where it must average",
    "wrong-divisor": "each replica divides its loss by the global batch R*N",
    "divisor-plus-one": "replica 0 divides its loss by N+1 (a subtle bug: every gradient off "
                        "by about 1/(R(N+1)))",
    "replicated-masks": "every replica takes the first N rows of the drop-path / dropout masks",
}
MASK_CONTROLS = ("replicated-masks",)  # visible only when a recipe draws masks
# Under these the replicas' running statistics diverge, so a whole step cannot return one
# replicated state: they are tied gradient by gradient only (`twinstep tie NET --control`).
GRADIENT_ONLY_CONTROLS = ("unsynced",)

# The sync sites (docs/sync-sites.md), each collective emitted under a ``jax.named_scope`` of its
# site's name so that a render's StableHLO says which site every collective belongs to.
SITES = {
    "bn_forward": "a BN's shard moments [mu_r, var_r], gathered from every replica (one per BN)",
    "bn_backward": "a BN's backward pair [mean(g dy), mean(xhat g dy)] (one per BN)",
    "grad": "a bucket of parameter gradients, all-reduced by its mean once per optimizer step "
            "(each gradient element in exactly one bucket), or reduce-scattered into the slices "
            "each replica updates",
    "loss": "the reported loss, the mean of the replicas' losses (one per micro-step)",
}
# The sites inside the accumulation scan (once per micro-step); "grad" is after it, once per
# optimizer step.
MICRO_STEP_SITES = ("bn_forward", "bn_backward", "loss")

# Gradients travel in buckets of at most this many bytes (PyTorch DDP's default cap): a few large
# all-reduces instead of one per tensor, each small enough not to hold a second copy of every
# gradient at once. Within one process a collective is a copy between the devices' memories and
# packing a bucket is one more copy, so there the sliced step reduces each tensor alone
# (``packed=False``, bench/history/2026-12-03.md).
GRAD_BUCKET_BYTES = 25 * 2**20


def grad_buckets(leaves, packed: bool = True) -> list[list[int]]:
    """The gradient buckets: lists of leaf positions, consecutive leaves of one dtype up to
    `GRAD_BUCKET_BYTES` (a larger leaf is a bucket alone; with ``packed=False`` every leaf is).
    ``leaves``: anything with ``shape`` and ``dtype`` (arrays, ShapeDtypeStructs), in
    ``jax.tree.leaves`` order."""
    buckets, size, dtype = [], 0, None
    cap = GRAD_BUCKET_BYTES if packed else 0
    for i, leaf in enumerate(leaves):
        nbytes = math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        if not buckets or leaf.dtype != dtype or size + nbytes > cap:
            buckets.append([])
            size, dtype = 0, leaf.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _site(site: str):
    """The named scope that labels a collective with its sync site."""
    if site not in SITES:
        raise ValueError(f"unknown sync site {site!r}; choose from {sorted(SITES)}")
    return jax.named_scope(site)


@dataclasses.dataclass(frozen=True)
class Replicas:
    """R replicas on mesh axis ``axis`` (``None``: one device, no collective)."""

    axis: str | None = None
    count: int = 1
    control: str = "none"

    def __post_init__(self):
        if self.control not in CONTROLS:
            raise ValueError(f"unknown control {self.control!r}; choose from {sorted(CONTROLS)}")
        if self.axis is None and self.count != 1:
            raise ValueError("a Replicas context without a mesh axis is a single device (count 1)")

    @property
    def synced(self) -> bool:
        """Whether collectives are emitted at all (R > 1 on a mesh axis)."""
        return self.axis is not None and self.count > 1

    @property
    def bn_synced(self) -> bool:
        return self.synced and self.control != "unsynced"

    def mean(self, x: jax.Array, site: str) -> jax.Array:
        """The mean over replicas of ``x`` (identity on one device); ``site`` (a key of `SITES`)
        names the all-reduce in the lowered program."""
        if not self.synced:
            return x
        with _site(site):
            if self.control == "sum":
                return lax.psum(x, self.axis)
            return lax.pmean(x, self.axis)

    def gather(self, x: jax.Array, site: str) -> jax.Array:
        """[R, *x.shape]: every replica's ``x``, in replica order, the same on every replica
        (typed replicated); ``x[None]`` on one device. An all-gather named by ``site``."""
        if not self.synced:
            return x[None]
        with _site(site):
            return lax.all_gather(x, self.axis, to="invarying")

    def bn_mean(self, x: jax.Array, site: str) -> jax.Array:
        """A BatchNorm statistic's mean over replicas; per-replica under the `unsynced` control."""
        return self.mean(x, site) if self.bn_synced else x

    def loss_rows(self, n: int):
        """The rows this replica divides its loss by: its own N — or, under a control, the
        global R N (`wrong-divisor`), or N + 1 on replica 0 (`divisor-plus-one`)."""
        if self.control == "wrong-divisor":
            return n * self.count
        if self.control == "divisor-plus-one" and self.synced:
            return n + (self.index() == 0)
        return n

    def grad_mean(self, grads, slice_dims=None, packed: bool = True):
        """The parameter-gradient collective: every element of ``grads`` (a pytree) reduced by its
        mean exactly once, the leaves packed into `grad_buckets` (one collective each; one per
        leaf with ``packed=False``).

        ``slice_dims`` (a tree like ``grads``, an int or None per leaf): a leaf with a dimension
        d comes back as only this replica's slice of it — block r of R along d, a reduce-scatter
        per bucket of such leaves; a leaf with None comes back whole (an all-reduce per bucket).
        """
        if not self.synced:
            return grads
        leaves, tree = jax.tree.flatten(grads)
        dims = ([None] * len(leaves) if slice_dims is None
                else tree.flatten_up_to(slice_dims))
        out = [None] * len(leaves)
        whole = [i for i, d in enumerate(dims) if d is None]
        for bucket in grad_buckets([leaves[i] for i in whole], packed):
            idx = [whole[j] for j in bucket]
            flat = self.mean(jnp.concatenate([leaves[i].reshape(-1) for i in idx]), "grad")
            start = 0
            for i in idx:
                out[i] = flat[start:start + leaves[i].size].reshape(leaves[i].shape)
                start += leaves[i].size
        # [R, size / R] per sliced leaf: row r is block r along its dimension
        moved = {i: jnp.moveaxis(leaves[i], d, 0) for i, d in enumerate(dims) if d is not None}
        rows = {i: m.reshape(self.count, -1) for i, m in moved.items()}
        split = list(rows)
        for bucket in grad_buckets([rows[i] for i in split], packed):
            idx = [split[j] for j in bucket]
            mine = self._mean_scatter(jnp.concatenate([rows[i] for i in idx], axis=1))
            start = 0
            for i in idx:
                size, m = rows[i].shape[1], moved[i]
                block = mine[start:start + size].reshape(m.shape[0] // self.count, *m.shape[1:])
                out[i] = jnp.moveaxis(block, 0, dims[i])
                start += size
        return jax.tree.unflatten(tree, out)

    def _mean_scatter(self, x: jax.Array) -> jax.Array:
        """Row r of the replicas' mean of x [R, n] on replica r: [n]."""
        with _site("grad"):
            total = lax.psum_scatter(x, self.axis, scatter_dimension=0)
        return total if self.control == "sum" else total / self.count

    def varying(self, tree):
        """``tree`` (the same on every replica) typed as varying over the replicas, e.g. a scan's
        zeros into which each replica sums its own gradients; as is on one device."""
        if not self.synced:
            return tree
        return jax.tree.map(lambda x: lax.pcast(x, self.axis, to="varying"), tree)

    def shard_rows(self, x: jax.Array, axis: int = 0) -> jax.Array:
        """This replica's rows of ``x`` drawn for the GLOBAL batch (``axis`` holds R*N rows):
        masks are drawn once for the global batch and sharded with it."""
        if not self.synced:
            return x
        n = x.shape[axis] // self.count
        start = 0 if self.control == "replicated-masks" else self.index() * n
        return lax.dynamic_slice_in_dim(x, start, n, axis)

    def index(self) -> jax.Array | int:
        """This replica's position on the axis (0 on one device)."""
        return lax.axis_index(self.axis) if self.synced else 0


SINGLE = Replicas()
