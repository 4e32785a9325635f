"""Process-wide settings: JAX options changed only for the block that needs them, XLA flags set
once before JAX starts, and the memory check before a compile."""

from __future__ import annotations

import contextlib
import os

from twinstep.errors import UsageError


@contextlib.contextmanager
def jax_settings(**updates):
    """Set JAX config options (e.g. ``jax_enable_x64=True``) for the block, then restore what
    was set before, so a library call never leaves the caller's process changed."""
    import jax  # here: the CLI imports this module before it needs JAX

    before = {name: getattr(jax.config, name) for name in updates}
    try:
        for name, value in updates.items():
            jax.config.update(name, value)
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


# XLA:CPU's multi-output fusion, off by default in this jaxlib: sibling loops that read the same
# operands (AdamW's two moments and its parameter update, each read the gradient) run as one
# kernel that reads them once — the step is memory-bound there (bench/xla_flags.py). An XLA
# backend option, so process-wide: read from XLA_FLAGS once, when JAX starts its backend.
XLA_CPU_FLAG = "--xla_backend_extra_options=xla_cpu_use_multi_output_fusion"


def use_xla_flags() -> None:
    """Append twinstep's XLA flags to XLA_FLAGS: `XLA_CPU_FLAG`, or what TWINSTEP_XLA_FLAGS says
    (set it empty for none). Effective only before JAX's first operation (XLA reads its flags
    once); nothing is added when XLA_FLAGS already sets xla_backend_extra_options (XLA takes
    one value of it)."""
    ours = os.environ.get("TWINSTEP_XLA_FLAGS", XLA_CPU_FLAG)
    flags = os.environ.get("XLA_FLAGS", "")
    if ours and "xla_backend_extra_options" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {ours}".strip()


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
