"""Process-wide JAX settings, changed only here and only for the block that needs them."""

from __future__ import annotations

import contextlib

import jax

from twinstep.errors import UsageError


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
