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


def interleaved_times(fns: dict, runs: int = 7, warmup: int = 1) -> dict:
    """Wall seconds of each callable's ``runs`` runs, run round-robin so machine noise hits all
    alike; every other round in reverse order, so that no callable always follows the same one
    (the first run after another program's pays for its caches)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(runs):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def interleaved_medians(fns: dict, runs: int = 7, warmup: int = 1) -> dict:
    """The median of each callable's `interleaved_times`."""
    return {name: statistics.median(ts)
            for name, ts in interleaved_times(fns, runs, warmup).items()}


def paired_ratio(times: list, base: list) -> tuple[float, float, float]:
    """(median, lower quartile, upper quartile) of the ratios of runs timed side by side in one
    round of `interleaved_times`: a slow spell of the machine cancels in each pair."""
    q1, median, q3 = statistics.quantiles([t / b for t, b in zip(times, base, strict=True)],
                                          n=4, method="inclusive")
    return median, q1, q3


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
