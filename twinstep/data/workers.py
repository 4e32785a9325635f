"""Loader worker processes: ``make(i)`` for i in [start, stop), built by W processes a few items
ahead and delivered in order, each array through shared memory.

Why not grain's multiprocess prefetch (which the thread path still uses): on the 2-core machine
this project is measured on, it delivered at most ~36 items a second whatever the item's size
or the number of workers, below one thread's rate for whole training batches
(bench/RESULTS.md#data-pipeline). Here a worker writes each array of an item into a shared
memory block (or builds it there: `shared_zeros`) and sends only the block's name; the parent
maps it as its array. A block is reused: when the last array over it is gone, the parent takes
its name back, and a worker builds a later item there, its pages already in memory — a new
block's pages are faulted in one at a time, which cost the device loader a fifth of its host
time (docs/training.md#device-loader). A stream's blocks are removed when it ends. Shared memory
blocks are files under /dev/shm: Linux.

The parent alone keeps the free blocks, and sends them with the next task, in the same message:
a worker builds an item in the blocks its task came with, makes a new one only where they run
out, and returns those it did not send with the item. So every block freed before a task was
sent is there for it, however the processes are scheduled, and the number of blocks follows from
the order of the consumer's drops and the tasks alone: for items whose arrays keep their sizes,
per array at most the items the consumer holds plus those in flight. (Names handed back on a
queue of their own could reach a worker after a later task did, which then made a block more,
for good: how many, a machine's load decided.)

Every item is a pure function of its index, so which worker builds it cannot change it. A
worker stops when it is told to, when its parent is gone, or at the parent's next failure; an
error in a worker is re-raised in the parent with the worker's message.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import math
import mmap
import multiprocessing
import os
import queue
import secrets
import signal
import weakref
from multiprocessing import resource_tracker, util

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
    procs = [ctx.Process(target=_work, args=(make, tasks, done),
                         kwargs={"parent": os.getpid(), "prefix": prefix}, daemon=True)
             for _ in range(workers)]
    returns = _Returns()
    for p in procs:
        p.start()
    ready: dict = {}  # index -> the item's parts, arrays still in shared memory
    sent = start
    try:
        for i in range(start, stop):
            while sent < stop and sent - i < workers * ahead:
                tasks.put((sent, returns.take()))  # with every block free now
                sent += 1
            while i not in ready:
                j, parts = _receive(done, procs, returns)
                ready[j] = parts
            parts = ready.pop(i)
            # a worker's error is raised in the items' order, whichever worker finished first
            if isinstance(parts, str):
                raise WorkerError(parts)
            if isinstance(parts, UsageError):
                raise parts
            yield tuple(_take(part, returns) for part in parts)
    finally:
        for _ in procs:
            tasks.put(None)
        for p in procs:
            p.join(timeout=STOP_S)
            if p.is_alive():
                p.terminate()
        returns.free = None  # an array dropped from now on frees its memory with it
        _drain(done)
        for path in glob.glob(os.path.join(SHM, f"{prefix}*")):  # arrays still over a block
            _remove(path)  # keep its memory until they go


def abandon() -> None:
    """What closing every stream would do, for a process about to end from another thread
    without closing them (`twinstep.training.watchdog`): its workers killed (a stuck one does
    not stop when asked), their shared memory blocks freed, and multiprocessing's own clean-up
    run (its queues' semaphores: else its resource tracker warns of them as leaked)."""
    for p in multiprocessing.active_children():
        p.kill()
    for path in glob.glob(os.path.join(SHM, f"{BLOCK_PREFIX}{os.getpid()}_*")):
        _remove(path)
    util._exit_function()  # what the interpreter's exit runs; os._exit would skip it


def _remove(path: str) -> None:
    """Remove a block's name, and with it the resource tracker's note of it (a block exists
    only while noted: `_block_array` notes it first), else the tracker warns of it at exit."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
        resource_tracker.unregister(f"/{os.path.basename(path)}", "shared_memory")


def _receive(done, procs, returns: _Returns) -> tuple[int, list]:
    """The next finished item (index, parts — a worker's error: its line, or its UsageError),
    raising a worker's death; the blocks its worker did not send go back to ``returns``."""
    while True:
        try:
            j, parts, unsent = done.get(timeout=POLL_S)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise WorkerError(f"a loader worker died (exit code {dead[0].exitcode})") from None
            continue
        for name in unsent:
            _give_back(returns, name)
        return j, parts


def _drain(done) -> None:
    """Empty ``done`` of items finished after the parent stopped asking (their blocks go with
    the stream's)."""
    while True:
        try:
            done.get_nowait()
        except (queue.Empty, OSError, ValueError):
            return


class _Returns:
    """The parent's free blocks of a stream, names no array is over any more: ``free``, None
    once the stream has ended. A thread that drops an array (a finalizer) may add to it while
    the stream takes from it: a deque's append and popleft are atomic."""

    def __init__(self):
        self.free: collections.deque | None = collections.deque()

    def take(self) -> list:
        """Every block free now, no longer free: a task's to build in."""
        names, free = [], self.free
        while free:
            with contextlib.suppress(IndexError):  # emptied by another thread meanwhile
                names.append(free.popleft())
        return names


def _give_back(returns: _Returns, name: str) -> None:
    free = returns.free
    if free is not None:
        free.append(name)


def _take(part, returns: _Returns):
    """A part of an item as the parent receives it: an array over its shared memory block,
    mapped, not copied (a device loader's batch is 25 MB) — its name handed back to
    ``returns`` when the last array over the mapping is gone —, anything else as it came."""
    if not (isinstance(part, tuple) and part and part[0] == "shm"):
        return part
    _, name, shape, dtype = part
    with open(os.path.join(SHM, name), "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    # the mapping outlives every view of it (numpy keeps it as their base), the array does not
    weakref.finalize(mapped, _give_back, returns, name)
    return np.frombuffer(mapped, np.dtype(dtype), count=math.prod(shape)).reshape(shape)


# in a worker: the item it builds (its blocks' prefix), the blocks it has made for that item
# (their arrays' address -> (name, bytes)), every block it has mapped (name -> mapping), and the
# blocks its task came with, not used yet (bytes -> names)
_building: list = []
_made: dict = {}
_mapped: dict = {}
_spare: dict = {}


def shared_zeros(shape: tuple, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) — in a worker, in a shared memory block, so that an item's large
    array (a device loader's canvases) reaches the parent without a copy."""
    if not _building:
        return np.zeros(shape, dtype)
    array, reused = _block_array(shape, np.dtype(dtype))
    if reused:
        array.fill(0)
    return array


def _block_array(shape: tuple, dtype: np.dtype) -> tuple[np.ndarray, bool]:
    """(an array over a shared memory block of the item being built, whether the block was
    used before — else it reads as zeros): a block of that size that the item's task came with
    when there is one, else a new one."""
    size = max(math.prod(shape) * dtype.itemsize, 1)
    spare = _spare.get(size)
    name = spare.pop() if spare else None
    reused = name is not None
    if not reused:
        name = f"{_building[0]}{os.getpid()}_{len(_mapped)}"
        resource_tracker.register(f"/{name}", "shared_memory")  # removed if we all die
        fd = os.open(os.path.join(SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # a new block reads as zeros
            _mapped[name] = mmap.mmap(fd, size)
        finally:
            os.close(fd)
    array = np.frombuffer(_mapped[name], dtype, count=math.prod(shape)).reshape(shape)
    _made[array.ctypes.data] = (name, size)
    return array, reused


def _lend(names: list) -> None:
    """Make the free blocks a task came with the item's to build in (each kept mapped)."""
    for name in names:
        if name not in _mapped:  # made by another worker, or by this one for an item it sent
            with open(os.path.join(SHM, name), "r+b") as f:
                _mapped[name] = mmap.mmap(f.fileno(), 0)
        _spare.setdefault(len(_mapped[name]), []).append(name)


def _send(part, sent: set):
    """A part of an item as a worker sends it: an array into a shared memory block — or the
    block it is in already (`shared_zeros`) —, its name joining ``sent``; anything else as it
    is."""
    if not isinstance(part, np.ndarray):
        return part
    own = _made.get(part.ctypes.data)
    if own is None or own[0] in sent or not part.flags.c_contiguous or part.nbytes != own[1]:
        block, _ = _block_array(part.shape, part.dtype)
        block[...] = part
        own = _made[block.ctypes.data]
    sent.add(own[0])
    return "shm", own[0], part.shape, part.dtype.str


def _work(make, tasks, done, *, parent: int, prefix: str) -> None:
    """A worker: build the items it is asked for, each in the free blocks its task came with,
    until told to stop or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    while os.getppid() == parent:
        try:
            task = tasks.get(timeout=POLL_S)
        except queue.Empty:
            continue
        if task is None:
            return
        i, free = task
        _lend(free)
        _building[:] = [prefix]
        names: set = set()
        try:
            sent = [_send(part, names) for part in make(i)]
        except UsageError as e:  # bad input: the parent refuses it as its own
            sent = e
        except Exception as e:  # noqa: BLE001 - the parent re-raises it, in one line
            sent = f"loader worker, item {i}: {type(e).__name__}: {e}"
        done.put((i, sent, _release(names if isinstance(sent, list) else set())))


def _release(sent: set) -> list:
    """Forget the blocks of the item just built; those not sent (copied into another array, not
    used, or the item failed) are returned, for the parent to free; a sent one is the parent's
    until no array is over it."""
    _building.clear()
    unsent = [name for name, _ in _made.values() if name not in sent]
    unsent += [name for names in _spare.values() for name in names]
    _made.clear()
    _spare.clear()
    return unsent
