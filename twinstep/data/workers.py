"""Loader worker processes: ``make(i)`` for i in [start, stop), built by W processes a few items
ahead and delivered in order, each array through shared memory.

Why not grain's multiprocess prefetch (which the thread path still uses): on the 2-core machine
this project is measured on, it delivered at most ~36 items a second whatever the item's size
or the number of workers, below one thread's rate for whole training batches
(bench/RESULTS.md#data-pipeline). Here a worker writes each array of an item into a shared
memory block of its own (or builds it there: `shared_zeros`) and sends only the block's name;
the parent maps it as its array and removes the name. Shared memory blocks are files under
/dev/shm: Linux.

Every item is a pure function of its index, so which worker builds it cannot change it. A
worker stops when it is told to, when its parent is gone, or at the parent's next failure; an
error in a worker is re-raised in the parent with the worker's message.
"""

from __future__ import annotations

import contextlib
import glob
import math
import mmap
import multiprocessing
import os
import queue
import secrets
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from twinstep.errors import UsageError

BLOCK_PREFIX = "twinstep"  # shared memory blocks are named twinstep<pid>_<stream>_<item>_<part>
SHM = "/dev/shm"  # where POSIX shared memory blocks are files (Linux)
POLL_S = 1.0  # how often a waiting process checks that the other side is still alive
STOP_S = 10.0  # how long a worker told to stop may take to finish the item it builds


class WorkerError(RuntimeError):
    """A loader worker failed or died; the message is the worker's."""


def stream(make, start: int, stop: int, workers: int, ahead: int):
    """A generator of ``make(i)`` for i in [start, stop), in order, built by ``workers``
    processes with at most ``ahead`` items in flight per worker; close it to stop them. ``make``
    must pickle (a module function or a partial of one) and return a tuple."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running XLA's threads
    tasks, done = ctx.Queue(), ctx.Queue()
    prefix = f"{BLOCK_PREFIX}{os.getpid()}_{secrets.token_hex(3)}_"  # this stream's blocks
    procs = [ctx.Process(target=_work, args=(make, tasks, done, os.getpid(), prefix),
                         daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    ready: dict = {}  # index -> the item's parts, arrays still in shared memory
    sent = start
    try:
        for i in range(start, stop):
            while sent < stop and sent - i < workers * ahead:
                tasks.put(sent)
                sent += 1
            while i not in ready:
                j, parts = _receive(done, procs)
                ready[j] = parts
            yield tuple(_take(part) for part in ready.pop(i))
    finally:
        for _ in procs:
            tasks.put(None)
        for p in procs:
            p.join(timeout=STOP_S)
            if p.is_alive():
                p.terminate()
        for parts in ready.values():
            for part in parts:
                _take(part)  # frees its block
        _drain(done)
        for path in glob.glob(f"/dev/shm/{prefix}*"):  # a worker stopped while writing one
            os.unlink(path)


def abandon() -> None:
    """What closing every stream would do, for a process about to end from another thread
    without closing them (`twinstep.training.watchdog`): its workers killed (a stuck one does
    not stop when asked), their shared memory blocks freed, and multiprocessing's own clean-up
    run (its queues' semaphores: else its resource tracker warns of them as leaked)."""
    for p in multiprocessing.active_children():
        p.kill()
    for path in glob.glob(f"/dev/shm/{BLOCK_PREFIX}{os.getpid()}_*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
    from multiprocessing import util

    util._exit_function()  # what the interpreter's exit runs; os._exit would skip it


def _receive(done, procs) -> tuple[int, list]:
    """The next finished item (index, parts), raising a worker's error or death."""
    while True:
        try:
            j, parts = done.get(timeout=POLL_S)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise WorkerError(f"a loader worker died (exit code {dead[0].exitcode})") from None
            continue
        if isinstance(parts, str):
            raise WorkerError(parts)
        if isinstance(parts, UsageError):
            raise parts
        return j, parts


def _drain(done) -> None:
    """Free the blocks of items finished after the parent stopped asking."""
    while True:
        try:
            _, parts = done.get_nowait()
        except (queue.Empty, OSError, ValueError):
            return
        if isinstance(parts, list):
            for part in parts:
                _take(part)


def _take(part):
    """A part of an item as the parent receives it: an array over its shared memory block,
    mapped, not copied (a device loader's batch is 25 MB) — the block's name is removed at once,
    its memory goes with the array —, anything else as it came."""
    if not (isinstance(part, tuple) and part and part[0] == "shm"):
        return part
    _, name, shape, dtype = part
    path = os.path.join(SHM, name)
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    os.unlink(path)
    resource_tracker.unregister(f"/{name}", "shared_memory")  # as SharedMemory.unlink does
    return np.frombuffer(mapped, np.dtype(dtype), count=math.prod(shape)).reshape(shape)


# in a worker: the item it builds (its blocks' prefix), and the blocks `shared_zeros` made
# for it: their arrays' address -> (name, bytes)
_building: list = []
_made: dict = {}


def shared_zeros(shape: tuple, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) — in a worker, in a shared memory block of its own, so that an
    item's large array (a device loader's canvases) reaches the parent without a copy. The
    array owns its mapping; the block's name is the parent's to remove once sent, else
    `_release` removes it."""
    if not _building:
        return np.zeros(shape, dtype)
    name, dtype = f"{_building[0]}z{len(_made)}", np.dtype(dtype)
    size = max(math.prod(shape) * dtype.itemsize, 1)
    fd = os.open(os.path.join(SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)  # a new block reads as zeros
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    resource_tracker.register(f"/{name}", "shared_memory")  # removed if we all die
    array = np.frombuffer(mapped, dtype, count=math.prod(shape)).reshape(shape)
    _made[array.ctypes.data] = (name, size)
    return array


def _send(part, name: str, sent: set):
    """A part of an item as a worker sends it: an array into a shared memory block ``name`` of
    its own (by name) — or the block it is in already (`shared_zeros`; its name joins
    ``sent``) —, anything else as it is."""
    if not isinstance(part, np.ndarray):
        return part
    own = _made.get(part.ctypes.data)
    if own is not None and part.flags.c_contiguous and part.nbytes == own[1]:
        sent.add(own[0])
        return "shm", own[0], part.shape, part.dtype.str
    block = shared_memory.SharedMemory(name=name, create=True, size=max(part.nbytes, 1))
    try:
        np.ndarray(part.shape, part.dtype, block.buf)[...] = part
        return "shm", block.name, part.shape, part.dtype.str
    finally:
        block.close()


def _work(make, tasks, done, parent: int, prefix: str) -> None:
    """A worker: build the items it is asked for until told to stop or orphaned."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    while os.getppid() == parent:
        try:
            i = tasks.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if i is None:
            return
        _building[:] = [f"{prefix}{i}_"]
        names: set = set()
        try:
            sent = [_send(part, f"{prefix}{i}_{k}", names) for k, part in enumerate(make(i))]
        except UsageError as e:  # bad input: the parent refuses it as its own
            sent = e
        except Exception as e:  # noqa: BLE001 - the parent re-raises it, in one line
            sent = f"loader worker, item {i}: {type(e).__name__}: {e}"
        _release(names if isinstance(sent, list) else set())
        done.put((i, sent))


def _release(sent: set) -> None:
    """Forget the blocks `shared_zeros` made for the item just built, removing those not sent
    (copied into another array, or the item failed); a sent one is the parent's."""
    _building.clear()
    for name, _ in _made.values():
        if name not in sent:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM, name))
            resource_tracker.unregister(f"/{name}", "shared_memory")
    _made.clear()
