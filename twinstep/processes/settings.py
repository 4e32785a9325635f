"""Process-wide JAX settings, changed only here and only for the block that needs them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import jax

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


def check_xla_flags() -> None:
    """XLA reads XLA_FLAGS when its backend starts and aborts the process on a flag it does not
    know, with its own log line and no exit status of ours. When XLA_FLAGS is set, a throw-away
    process starts XLA first (about a second); a refusal is BackendError (exit 3, one line)."""
    if not os.environ.get("XLA_FLAGS", "").strip():
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
