"""Benchmark helpers: interleaved medians against a peer in the same run, and RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def block(tree):
    import jax

    return jax.block_until_ready(tree)


def op_chain(forward, vjp, strides):
    """A jitted (xs, ws) -> the sum of every layer's y, dx and dw: each layer's forward
    ``forward(x, w, stride) -> (y, res)`` and its ``vjp(res, dy) -> (dx, dw)``, timed whole."""
    import jax
    import jax.numpy as jnp

    def f(xs, ws):
        total = 0.0
        for x, w, s in zip(xs, ws, strides, strict=True):
            y, res = forward(x, w, s)
            dx, dw = vjp(res, jnp.ones_like(y))
            total = total + y.sum() + dx.sum() + dw.sum()
        return total

    return jax.jit(f)


def interleaved_medians(fns: dict, runs: int = 7, warmup: int = 1) -> dict:
    """Median wall seconds of each callable, run round-robin so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} cores; jax {jax.__version__} on "
            f"{jax.default_backend()}; python {platform.python_version()}")


def append_results(title: str, command: str, table_md: str, notes: str = "") -> None:
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"\n## {title}\n\n{stamp} — {machine()}\n\n`{command}`\n\n{table_md}\n"
            + (f"\n{notes}\n" if notes else ""))
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nAppended by the scripts in bench/. Ratios "
                           "compare peers timed in the same run (medians of interleaved runs); "
                           "absolute times vary run to run on this noisy machine.\n")
    with RESULTS.open("a") as f:
        f.write(text)
    print(text)
