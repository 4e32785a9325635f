"""Many processes on JAX's multi-controller runtime (`jax.distributed`): one process per host
(or several on one, `twinstep launch --local`), one mesh over every process's devices.

Every process runs the same program on the same global arrays; each holds the shards of its own
devices. So a replica mesh takes R / P devices from each of the P processes, in process order
(`replica_devices`): process p holds replicas p R/P .. (p+1) R/P - 1 and, with them, rows
p R N/P .. (p+1) R N/P - 1 of every global batch (`local_rows`) — the only rows it loads. A value
every replica holds (the loss, a replicated state) is read from this process's first shard
(`local_value`); one spread over the processes is gathered (`gathered`). With one process all
of this is the identity.

A process that dies is noticed by the others' coordination service within HEARTBEAT_TIMEOUT_S,
and they abort; `twinstep launch` stops the others at once.
"""

from __future__ import annotations

import os
import re
import sys
import threading

import jax
import numpy as np
from jax._src import distributed  # the runtime's client: no public barrier with a timeout
from jax.experimental import multihost_utils

from twinstep.errors import ClusterError, ExitStatus, UsageError

HEARTBEAT_TIMEOUT_S = 30  # a dead process is noticed this long after its last heartbeat
INIT_TIMEOUT_S = 120  # how long a process waits for all the others to join
BARRIER_TIMEOUT_S = 3600  # how long a process waits at a barrier for the others (compiling)
WATCHDOG_MARGIN_S = 5
_ADDRESS = re.compile(r"^[A-Za-z0-9_.\-]+:\d{1,5}$|^\[[0-9A-Fa-f:.]+\]:\d{1,5}$")
# the variables that name a cluster jax.distributed.initialize() detects by itself
_AUTO_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_STEP_NUM_NODES")


def check_flags(coordinator: str | None, num_processes: int | None,
                process_id: int | None) -> None:
    """The three flags together or none of them, in range (UsageError, before anything runs)."""
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return
    if not all(given):
        raise UsageError("--coordinator, --num-processes and --process-id go together")
    if not _ADDRESS.match(coordinator) or not 0 < int(coordinator.rsplit(":", 1)[1]) < 65536:
        raise UsageError(f"--coordinator {coordinator!r}: HOST:PORT, e.g. node0:12355")
    if num_processes < 1:
        raise UsageError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise UsageError(f"--process-id must be in [0, {num_processes}), got {process_id}")


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join the runtime when the flags name one, or when the environment does (JAX's
    JAX_COORDINATOR_ADDRESS, or a SLURM step, which jax.distributed detects); otherwise stay one
    process. Call before JAX's first operation."""
    check_flags(coordinator, num_processes, process_id)
    if coordinator is None and not any(v in os.environ for v in _AUTO_ENV):
        return
    if num_processes == 1:
        return
    where = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS", "auto-detected")
    # JAX aborts the process (SIGABRT, a C++ stack) when the others do not all join in time:
    # say why in one line just before it would
    watchdog = threading.Timer(INIT_TIMEOUT_S - WATCHDOG_MARGIN_S, _never_joined,
                               (where, process_id, num_processes))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=INIT_TIMEOUT_S,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    except (RuntimeError, ValueError) as e:
        raise ClusterError(f"could not join the runtime at {where} as process {process_id} of "
                           f"{num_processes}: {_first_line(e)}") from None
    finally:
        watchdog.cancel()


def _never_joined(where: str, process_id, num_processes) -> None:
    print(f"twinstep: the runtime at {where} did not gather all {num_processes or 'the'} "
          f"processes within {INIT_TIMEOUT_S - WATCHDOG_MARGIN_S} s (process {process_id} "
          f"waited): is every process started, with the same --coordinator and "
          f"--num-processes?", file=sys.stderr, flush=True)
    os._exit(ExitStatus.INTERNAL)


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def count() -> int:
    """How many processes run together (1 without the runtime — asked without starting JAX's
    backend, so that a caller can still choose its devices)."""
    return jax.process_count() if jax.distributed.is_initialized() else 1


def is_primary() -> bool:
    """Process 0: the one that writes logs, reports and configs."""
    return count() == 1 or jax.process_index() == 0


def replica_devices(replicas: int) -> list:
    """The devices of an R-replica mesh: the first R / P of each process's, in process order (so
    a process holds a contiguous block of replicas). One process: its first R."""
    procs = count()
    if replicas % procs:
        raise UsageError(f"--replicas {replicas} over {procs} processes: each process holds "
                         f"the same number of replicas, so R must be a multiple of {procs}")
    per = replicas // procs
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(procs)]
    short = [p for p, ds in enumerate(by_process) if len(ds) < per]
    if short:
        raise RuntimeError(
            f"{replicas} replicas over {procs} processes need {per} devices in each; process "
            f"{short[0]} has {len(by_process[short[0]])}. On CPU, call twinstep.dp.ensure_devices"
            f"({per}) before any JAX operation, or set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={per}.")
    return [d for ds in by_process for d in ds[:per]]


def local_rows(rows: int) -> slice:
    """This process's rows of a global batch of ``rows`` (its replicas' rows, contiguous)."""
    per = rows // count()
    p = jax.process_index()
    return slice(p * per, (p + 1) * per)


def global_array(local: np.ndarray, sharding, global_shape: tuple, axis: int = 0):
    """A global array from this process's rows along ``axis`` (`local_rows`); with one process,
    ``local`` is the whole array and is placed as ``sharding`` says."""
    if count() == 1:
        return jax.device_put(local, sharding)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def placed(tree, sharding):
    """``tree`` (the same full value in every process) placed as ``sharding`` (one for every
    leaf, or a tree of them matching ``tree``): each process puts its own devices' shards. A
    leaf already spread over the processes is laid out as ``sharding`` says."""
    if count() == 1:
        return jax.device_put(tree, sharding)
    if isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.tree.map(lambda _: sharding, tree)

    def one(a, where):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return jax.device_put(a, where)  # already global: as is, or laid out anew
        whole = np.asarray(a)
        return jax.make_array_from_callback(whole.shape, where, lambda idx: whole[idx])

    return jax.tree.map(one, tree, sharding)


def local_value(a) -> np.ndarray:
    """A value every replica holds (the loss, a replicated parameter), read here: from this
    process's first shard."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        a = a.addressable_shards[0].data
    return np.asarray(a)


def whole(a) -> np.ndarray:
    """``a`` complete here, as NumPy: a replicated array read from this process's first shard
    (`local_value`), one spread over the processes gathered from all of them (every process
    calls this together)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable and (
            not a.sharding.is_fully_replicated):
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return local_value(a)


def local_rows_of(a, rows: slice) -> np.ndarray:
    """Rows ``rows`` (this process's, `local_rows`) of a program's output, as NumPy, however the
    output is laid out — sharded by rows as its input was, or replicated."""
    if not isinstance(a, jax.Array) or a.is_fully_addressable:
        return np.asarray(a)[rows]
    out = np.empty((rows.stop - rows.start, *a.shape[1:]), a.dtype)
    for shard in a.addressable_shards:
        lo, hi, _ = shard.index[0].indices(a.shape[0]) if shard.index else (0, a.shape[0], 1)
        top, bottom = max(lo, rows.start), min(hi, rows.stop)
        if top < bottom:
            out[top - rows.start:bottom - rows.start] = np.asarray(shard.data)[top - lo:bottom - lo]
    return out


def gathered(tree):
    """``tree`` with every leaf complete in this process (NumPy where it was spread over the
    processes): what the report of a tie compares."""
    if count() == 1:
        return tree

    def one(a):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            return a
        return whole(a)

    return jax.tree.map(one, tree)


def total(values: np.ndarray) -> np.ndarray:
    """The element-wise sum of ``values`` over the processes (every process gets it)."""
    if count() == 1:
        return np.asarray(values)
    return each(values).sum(0)


def each(values: np.ndarray) -> np.ndarray:
    """Every process's ``values`` (of one shape in all), stacked [processes, ...] in process
    order (every process gets it)."""
    if count() == 1:
        return np.asarray(values)[None]
    return np.asarray(multihost_utils.process_allgather(np.asarray(values)))


def barrier(name: str) -> None:
    """Wait until every process gets here (e.g. process 0 has written what the others read), for
    up to BARRIER_TIMEOUT_S: a barrier of the runtime's coordination service, which — unlike a
    collective over gloo, given up after 30 s — waits as long as a slower process needs."""
    if count() == 1:
        return
    client, key = _meeting(name)
    client.wait_at_barrier(key, BARRIER_TIMEOUT_S * 1000)


def from_primary(name: str, value: str | None) -> str:
    """Process 0's ``value`` (a string; the others pass None) in every process, through the
    runtime's key-value store, waited for as long as `barrier` waits. Process 0 returns only
    once every other process has said it holds the value, and the others' last call to the
    runtime has then returned: process 0 hosts the runtime's service and may leave at once (a
    failed run `os._exit`s), which would break a read still under way."""
    if count() == 1:
        return value
    client, key = _meeting(name)
    if is_primary():
        client.key_value_set(key, value)
        for other in range(1, count()):
            client.blocking_key_value_get(f"{key}/read/{other}", BARRIER_TIMEOUT_S * 1000)
        return value
    value = client.blocking_key_value_get(key, BARRIER_TIMEOUT_S * 1000)
    client.key_value_set(f"{key}/read/{jax.process_index()}", "1")
    return value


def _meeting(name: str) -> tuple:
    """(the runtime's client, the key of this meeting of ``name``: each has its own)."""
    _barriers[name] = _barriers.get(name, 0) + 1
    return distributed.global_state.client, f"twinstep/{name}/{_barriers[name]}"


_barriers: dict[str, int] = {}  # how often each barrier or handover was met
_compiled: dict = {}


def run_together(program, *args):
    """``program(*args)`` (a jitted program over every process's devices): compiled ahead, and
    run once every process has compiled it (`barrier`). A process that compiles slower than
    another — a compilation-cache miss, a slower host — would otherwise leave the other waiting
    inside the program's first collective, where gloo gives up after 30 s. A step that is not
    itself one program (a render's, `twinstep.rendering.reader.step`) runs its program this
    way itself and is called as it is."""
    if count() == 1 or not hasattr(program, "lower"):
        return program(*args)
    leaves = jax.tree.leaves(args)
    key = (program, jax.tree.structure(args),
           tuple((np.shape(a), str(getattr(a, "dtype", "")), getattr(a, "sharding", None))
                 for a in leaves))
    if key not in _compiled:
        _compiled[key] = program.lower(*args).compile()
        barrier("compiled")
    return _compiled[key](*args)
