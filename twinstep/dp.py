"""The data-parallel layer: a 1-D mesh of R replicas and the replica program over it.

`replica_map` runs a per-replica function inside ``jax.shard_map`` over mesh axis ``AXIS``;
the collectives that function emits all come from `twinstep.collectives.Replicas`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from twinstep.collectives import Replicas
from twinstep.defaults import MAX_REPLICAS
from twinstep.errors import UsageError
from twinstep.processes import cluster, settings

AXIS = "r"


def ensure_devices(count: int) -> None:
    """Ask for ``count`` virtual CPU devices (or keep a larger number already asked for, e.g. by
    JAX_NUM_CPU_DEVICES). Call before JAX's first operation; later it is a no-op (the number of
    devices is then fixed, and `mesh` says if it is too few). Ask for no more than a run uses:
    every virtual device slows the programs of the others (docs/platform.md). More than
    `twinstep.defaults.MAX_REPLICAS` is refused (UsageError). Sets twinstep's XLA flags too
    (`twinstep.processes.settings.OWN_XLA_FLAGS`), which XLA also reads only as it starts."""
    if not 1 <= count <= MAX_REPLICAS:
        raise UsageError(f"replicas must be in [1, {MAX_REPLICAS}], got {count}")
    settings.set_own_xla_flags()
    try:
        jax.config.update("jax_num_cpu_devices", max(count, jax.config.jax_num_cpu_devices))
    except RuntimeError:
        pass


def mesh(count: int) -> Mesh:
    """A 1-D mesh of ``count`` replicas (Auto axes: unsharded inputs are accepted): the first
    ``count`` devices, or with several processes the first count / P of each
    (`twinstep.processes.cluster.replica_devices`)."""
    devices = jax.devices()
    if cluster.count() > 1:
        return Mesh(np.array(cluster.replica_devices(count)), (AXIS,))
    if count > len(devices):
        raise RuntimeError(
            f"{count} replicas need {count} devices; JAX sees {len(devices)}. On CPU, call "
            f"twinstep.dp.ensure_devices({count}) before any JAX operation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count}.")
    return Mesh(np.array(devices[:count]), (AXIS,))


def replicate(tree, count: int):
    """``tree`` replicated on `mesh(count)` (on the first device at one replica). A program's
    outputs live there: called first with arrays placed elsewhere and then with its own outputs,
    jit would compile it twice (for a whole train step, most of a tie's time)."""
    return place(tree, jax.tree.map(lambda _: REPLICATED, tree), count)


def place(tree, specs, count: int):
    """``tree`` (the same full value everywhere) on `mesh(count)`, each leaf laid out as its
    PartitionSpec in ``specs`` (a matching tree) says; at one replica, committed to the first
    device, where the program's outputs are (uncommitted arguments would make jit compile the
    program a second time for its own outputs, a whole compile of a train step)."""
    where = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if count == 1
             else shardings(specs, mesh(count)))
    if cluster.count() > 1:  # each process puts its own devices' shards
        return cluster.placed(tree, where)
    # copied, never aliased with ``tree``'s buffers: a program may donate the placed tree
    # (device_put(may_alias=False) still hands the first device the original buffer, jax
    # 0.10.2). One program copies the whole tree: a copy per leaf is a program per shape, each
    # loaded from the compilation cache at every start.
    return jax.jit(_copied, out_shardings=where)(tree)


def _copied(tree):
    return jax.tree.map(jnp.copy, tree)


def placed_shapes(tree, specs, count: int):
    """The ShapeDtypeStructs of `place`'s result, laid out as it lays them out (``tree``: JAX
    arrays or ShapeDtypeStructs; ``specs``: a matching tree, or one PartitionSpec for every leaf): a
    program compiled ahead from them takes the placed arrays, and refuses others."""
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    where = jax.tree.map(lambda _: one, tree) if count == 1 else shardings(specs, mesh(count))
    return jax.tree.map(lambda a, at: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=at,
                                                           weak_type=a.weak_type), tree, where)


def shardings(specs, on):
    """A tree of PartitionSpecs as NamedShardings on the mesh ``on``."""
    return jax.tree.map(lambda sp: NamedSharding(on, sp), specs,
                        is_leaf=lambda x: isinstance(x, P))


def abstract_mesh(count: int) -> AbstractMesh:
    """The 1-D mesh of ``count`` replicas without devices: a program for R devices can be lowered
    (and exported) in a process that has one."""
    return AbstractMesh((count,), (AXIS,))


def replicas(count: int, control: str = "none") -> Replicas:
    return Replicas(AXIS, count, control)


# XLA:CPU with LLVM at -O0 and the legacy loop emitters: the same numerics, a shorter compile and a
# slower program — for checks whose wall time is compile time (bench/probes/opt_level.py). The
# XLA of JAX 0.12 has no legacy emitters, nor their switch (`compiler_options` drops it).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# XLA:CPU's copy insertion without region analysis copies every donated parameter the backward
# still reads (its update does not depend on that read): 163 of MobileNetV4's 233, on every
# replica, each step. With it none is copied (docs/platform.md).
CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def compiler_options(fast_compile: bool = False) -> dict | None:
    """The XLA options every program here is compiled with, on this process's backend: those of
    CPU_OPTIONS and (``fast_compile``) FAST_COMPILE that its XLA knows."""
    if jax.default_backend() != "cpu":
        return None
    options = {**CPU_OPTIONS, **(FAST_COMPILE if fast_compile else {})}
    return {k: v for k, v in options.items() if _known(k, v)}


@functools.cache
def _known(option: str, value) -> bool:
    """Whether this process's XLA compiles with ``option`` (XLA refuses one it does not know)."""
    try:
        jax.jit(lambda x: x).lower(np.float32(0)).compile({option: value})
    except jax.errors.JaxRuntimeError:
        return False
    return True


def jit(fn, fast_compile: bool = False, donate: tuple = ()):
    """jax.jit; ``donate``: the argument numbers whose buffers the program may reuse (a caller
    that steps a state and drops the old one holds one state, not two, while the step runs)."""
    return jax.jit(fn, compiler_options=compiler_options(fast_compile), donate_argnums=donate)


def replica_map(fn, count: int, in_specs, out_specs, *, fast_compile: bool = False,
                on=None, donate: tuple = ()):
    """jit(shard_map(fn)) over `mesh(count)` (or the mesh ``on``, e.g. `abstract_mesh`);
    ``BATCH`` specs shard the leading axis; ``donate`` as in `jit`.

    At one replica there is nothing to map: ``Replicas`` emits no collective, so the replica
    program is the single-device program, jit(fn), and is built as exactly that.
    """
    if count == 1:
        return jit(fn, fast_compile, donate)
    return jit(per_replica(fn, on or mesh(count), in_specs, out_specs), fast_compile, donate)


def per_replica(fn, on, in_specs, out_specs):
    """shard_map(fn) over the mesh ``on``: fn runs once per replica on its shards."""
    return jax.shard_map(fn, mesh=on, in_specs=in_specs, out_specs=out_specs, check_vma=True)


def laid_out_jit(fn, on, in_specs, out_specs, *, fast_compile: bool = False,
                 donate: tuple = ()):
    """`jit` of a global-view ``fn`` (XLA partitions it over the mesh ``on``) whose arguments
    and results are laid out as the PartitionSpec trees ``in_specs`` / ``out_specs`` say; an
    argument laid out otherwise is refused, so callers place it first (`place`)."""
    return jax.jit(fn, in_shardings=shardings(in_specs, on),
                   out_shardings=shardings(out_specs, on),
                   compiler_options=compiler_options(fast_compile), donate_argnums=donate)


def slice_dim(shape: tuple, count: int) -> int | None:
    """The dimension along which an optimizer-state tensor of ``shape`` is spread over ``count``
    replicas, each holding a 1/count slice: the first one ``count`` divides; None (the whole
    tensor on every replica) for a scalar or a shape with no such dimension."""
    return next((d for d, n in enumerate(shape) if n % count == 0), None)


def slice_spec(shape: tuple, count: int) -> P:
    """`slice_dim`'s layout as a PartitionSpec."""
    d = slice_dim(shape, count)
    return REPLICATED if d is None else P(*([None] * d + [AXIS]))


BATCH = P(AXIS)  # sharded along the batch (leading) axis
MICRO_BATCH = P(None, AXIS)  # micro-batches [k, R N, ...]: sharded along their rows
REPLICATED = P()  # the same on every replica


def shift_shards(x, count: int, shift: float):
    """Add r * shift to replica r's shard of x, so per-replica means differ by O(shift)."""
    n = x.shape[0] // count
    offs = jnp.repeat(jnp.arange(count, dtype=x.dtype) * shift, n)
    return x + offs.reshape((-1,) + (1,) * (x.ndim - 1))
