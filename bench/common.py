"""Benchmark helpers: interleaved medians against a peer in the same run, and the RESULTS.md
files that keep each script's latest table under a stable heading."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")  # the benchmarks' (bench/*.py)
PROBE_RESULTS = RESULTS.parent / "probes" / "RESULTS.md"  # the probes' (bench/probes/*.py)
# what a RESULTS.md file says of itself when a script creates it
HEADERS = {
    RESULTS: "# Benchmark results\n\n"
             "The latest table of each benchmark in bench/ (bench/README.md lists them), under a\n"
             "heading that does not change. Ratios compare peers timed in the same run (medians\n"
             "of interleaved runs); absolute times vary run to run on a noisy machine. Each\n"
             "section is rewritten whole by its script; earlier runs are in bench/history/.\n",
    PROBE_RESULTS: "# Probe results\n\n"
                   "The latest table of each probe in bench/probes/, under the script's name,\n"
                   "with the design decision it backs. Ratios compare variants timed in the same\n"
                   "run. Each section is rewritten whole by its script; earlier runs are in\n"
                   "bench/history/.\n",
}


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


def machine_load() -> float:
    """The machine's 1-minute load average: how busy it was while a benchmark ran."""
    return os.getloadavg()[0]


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


def probe_decision(doc: str) -> str:
    """The decision a probe backs, as its section of PROBE_RESULTS opens with it: from the first
    line of the probe's docstring, "Probe for <the decision>:"."""
    return "Decision: " + doc.splitlines()[0].removeprefix("Probe for ").rstrip(":") + "."


def write_results(path: Path, heading: str, what: str, command: str, table_md: str,
                  notes: str = "") -> None:
    """Rewrite the section ``## heading`` of ``path`` (RESULTS or PROBE_RESULTS) with this run:
    ``what`` was measured (the run's settings: nets, resolution, batch, R), when and on which
    machine, the ``command``, the table and ``notes``. The section runs from its heading to the
    next ``## `` line or the end; it is appended when absent, and a missing file is created
    with its header. The heading never carries a run's settings, so docs can cite it."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"## {heading}\n\n{what}\n\n{stamp} — {machine()}\n\n`{command}`\n\n"
               f"{table_md.strip()}\n" + (f"\n{notes.strip()}\n" if notes else ""))
    text = path.read_text() if path.exists() else HEADERS.get(path, "# Results\n")
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == f"## {heading}"), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        after = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + after if after else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(section)
