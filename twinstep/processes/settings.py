"""Process-wide JAX settings, changed only here and only for the block that needs them."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import subprocess
import sys
import time

import jax
from jax.experimental import serialize_executable

from twinstep.errors import BackendError, UsageError


@contextlib.contextmanager
def jax_settings(**updates):
    """Set JAX config options (e.g. ``jax_enable_x64=True``) for the block, then restore what
    was set before, so a library call never leaves the caller's process changed."""
    before = {name: getattr(jax.config, name) for name in updates}
    try:
        for name, value in updates.items():
            jax.config.update(name, value)
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


CACHE_BYTES = 4 * 2**30  # the compilation cache's bound: least recently used programs go first


def compile_cache_dir() -> str | None:
    """Where the CLI keeps compiled programs (docs/speed.md#compilation-cache):
    $TWINSTEP_COMPILE_CACHE, else $XDG_CACHE_HOME/twinstep/jax (~/.cache/twinstep/jax); None
    when TWINSTEP_NO_COMPILE_CACHE is set, or when JAX_COMPILATION_CACHE_DIR names the user's
    own (JAX then uses that)."""
    if os.environ.get("TWINSTEP_NO_COMPILE_CACHE") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    if os.environ.get("TWINSTEP_COMPILE_CACHE"):
        return os.environ["TWINSTEP_COMPILE_CACHE"]
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "twinstep", "jax")


def use_compile_cache() -> None:
    """Keep every compiled program in `compile_cache_dir` (before JAX compiles anything): a
    resumed run, a restart or a repeated tie loads its programs instead of compiling them.
    Bounded by CACHE_BYTES; with a bound JAX reads, writes and evicts entries under a file lock
    (without one it does not lock, and a reader can meet a half-written entry), so processes
    share it. A folder that cannot be made leaves the cache off."""
    path = compile_cache_dir()
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # small ones add up
    jax.config.update("jax_compilation_cache_max_size", CACHE_BYTES)


def compiled(lowered, devices: list, folder: str | None = None):
    """``lowered.compile()`` (a `jax.stages.Lowered` for ``devices``, in its device order),
    loaded from the compilation cache (``folder``, by default JAX's) in every process of a
    launch. JAX's own entries are written by process 0 alone, and on the CPU each process's key
    differs (it hashes the process's own devices), so every other process compiled the step
    again at each start, a restart's too. Such a process keeps its own copy of the executable
    among JAX's entries, named as JAX names them (``KEY-cache`` and its last use,
    ``KEY-atime``) so that JAX's size bound evicts it too; KEY is ``twinstep-process-`` and a
    hash of the program's text, the devices and their processes, JAX's version and XLA_FLAGS.
    An entry that cannot be read or written is compiled as without a cache
    (docs/speed.md#compilation-cache)."""
    folder = folder or jax.config.jax_compilation_cache_dir
    if jax.process_index() == 0 or not folder:
        return lowered.compile()
    place = [(d.id, d.process_index, d.platform) for d in devices]
    text = "\n".join([lowered.as_text(), repr(place), str(jax.process_index()),
                      jax.__version__, jax.lib.__version__, os.environ.get("XLA_FLAGS", "")])
    key = os.path.join(folder, "twinstep-process-" + hashlib.sha256(text.encode()).hexdigest())

    def used() -> None:  # the time JAX's eviction orders entries by (its last use)
        with open(f"{key}-atime", "wb") as f:
            f.write(time.time_ns().to_bytes(8, "little"))

    in_tree = jax.tree.structure(lowered.args_info)
    try:
        with open(f"{key}-cache", "rb") as f:
            done = serialize_executable.deserialize_and_load(
                f.read(), in_tree, lowered.out_tree, execution_devices=devices)
        with contextlib.suppress(OSError):
            used()
        return done
    except Exception:  # noqa: BLE001 - absent, cut short or stale: compile as without a cache
        pass
    done = lowered.compile()
    with contextlib.suppress(Exception):
        payload, _, _ = serialize_executable.serialize(done)
        used()  # first: JAX's eviction reads the last use of every entry it finds
        with open(f"{key}.{os.getpid()}.tmp", "wb") as f:
            f.write(payload)
        os.replace(f"{key}.{os.getpid()}.tmp", f"{key}-cache")  # whole, or not there
    return done


# XLA flags twinstep sets for every process it configures, unless XLA_FLAGS names them already:
# XLA:CPU's memory-minimising instruction order (docs/platform.md#scheduling-on-cpu).
OWN_XLA_FLAGS = {"xla_cpu_enable_concurrency_optimized_scheduler": "false"}


def _own_flags() -> dict:
    """{name: "--name=value"} of `OWN_XLA_FLAGS`, as XLA_FLAGS spells them."""
    return {name: f"--{name}={value}" for name, value in OWN_XLA_FLAGS.items()}


def set_own_xla_flags() -> None:
    """Add `OWN_XLA_FLAGS` to XLA_FLAGS (the processes this one starts inherit them). XLA reads
    XLA_FLAGS once, when its backend starts: later this changes nothing for this process."""
    given = os.environ.get("XLA_FLAGS", "")
    mine = [flag for name, flag in _own_flags().items()
            if f"--{name}=" not in given and f"--{name} " not in f"{given} "]
    if mine:
        os.environ["XLA_FLAGS"] = " ".join([given.strip(), *mine]).strip()


def check_xla_flags() -> None:
    """XLA reads XLA_FLAGS when its backend starts and aborts the process on a flag it does not
    know, with its own log line and no exit status of ours. When XLA_FLAGS holds more than
    `OWN_XLA_FLAGS`, a throw-away process starts XLA first (about a second); a refusal is
    BackendError (an environment error, `ExitStatus.INTERNAL`, in one line)."""
    if not set(os.environ.get("XLA_FLAGS", "").split()) - set(_own_flags().values()):
        return
    try:
        done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BackendError(f"cannot start XLA to check XLA_FLAGS: {e}") from None
    if done.returncode != 0:
        said = [line for line in done.stderr.splitlines() if "XLA_FLAGS" in line]
        why = said[-1].split("] ", 1)[-1] if said else f"exit status {done.returncode}"
        raise BackendError(f"XLA refuses XLA_FLAGS={os.environ['XLA_FLAGS']!r}: {why}")


def available_memory() -> int | None:
    """Bytes this machine can still give a process (Linux's MemAvailable), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(need: int, advice: str) -> None:
    """Refuse, before compiling, a run whose lower bound ``need`` (bytes) exceeds what is
    available (UsageError, one line with both numbers and ``advice``)."""
    have = available_memory()
    if have is not None and need > have:
        raise UsageError(f"this run needs at least {need / 2**30:.1f} GiB and "
                         f"{have / 2**30:.1f} GiB is available: {advice}")


_trim = None  # glibc's malloc_trim once looked up; False where there is none


def release_freed_memory() -> None:
    """Hand the heap memory this process has freed back to the operating system (glibc's
    malloc_trim; nothing elsewhere): glibc keeps freed blocks resident in its per-thread arenas,
    after XLA's compiles most of all (docs/speed.md#memory)."""
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _trim = False
    if _trim:
        _trim(0)
