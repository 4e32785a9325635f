"""Probe for XLA -O0 only where compiling dominates (dp.FAST_COMPILE, --fast-compile):
XLA -O0 (`twinstep.dp.FAST_COMPILE`) against XLA's default optimization, for the programs the
ties compile: the single-device whole train step of each net in f64 (the tie's set-up, R N = 8
at 32²). Compile seconds once each; run seconds as medians of interleaved runs. A tie that runs
its program n times pays compile + n x run: -O0 pays only where the compile dominates (the
suite compiles MobileNetV4's ties at -O0, ResNet-50's at the default: tests/conftest.py).

    python bench/probes/opt_level.py [--nets resnet50 mnv4] [--runs 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

from twinstep import dp  # noqa: E402

dp.ensure_devices(4)  # train_programs builds the R = 4 replica program too (not compiled here)

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    PROBE_RESULTS,
    block,
    interleaved_medians,
    probe_decision,
    write_results,
)
from twinstep import recipes  # noqa: E402
from twinstep.checking import inputs, tie, trajectory  # noqa: E402
from twinstep.nets import NETS, get_net  # noqa: E402

RECIPES = {"resnet50": "resnet50in_adamdp2", "mnv4": "mnv4in_adamdp2"}


def programs(name: str):
    """{level: (compile s, callable)} of the single-device train step at 4 x 2 rows."""
    r = recipes.parse(RECIPES[name])
    cfg = tie.TieConfig(net=name, replicas=4, batch=r.batch, recipe=RECIPES[name])
    net = get_net(name)
    params, buffers, _, _ = inputs.setup(cfg, net)
    n = cfg.replicas * cfg.batch
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((1, n, cfg.res, cfg.res, 3))
    ts = np.eye(cfg.classes)[rng.integers(0, cfg.classes, (1, n))]
    out = {}
    for level, fast in (("-O0", True), ("default", False)):
        single, _ = trajectory.train_programs(net, r, dataclasses.replace(cfg, fast_compile=fast),
                                              inputs.tie_precision("f64"))
        args = (single.init(params, buffers), xs, ts, jax.random.key(0), np.arange(n))
        lowered = single.step.lower(*args)
        t0 = time.perf_counter()
        compiled = lowered.compile(dp.compiler_options(fast))
        seconds = time.perf_counter() - t0
        # train_programs donate the state: each run steps a fresh copy of it
        out[level] = (seconds, lambda c=compiled, a=args: block(c(*_copy(a))))
    return out


def _copy(args):
    state, *rest = args
    return (jax.device_put(state, may_alias=False), *rest)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=sorted(NETS), choices=sorted(NETS))
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = []
    for name in args.nets:
        progs = programs(name)
        med = interleaved_medians({k: fn for k, (_, fn) in progs.items()}, runs=args.runs)
        (c0, _), (c2, _) = progs["-O0"], progs["default"]
        r0, r2 = med["-O0"], med["default"]
        # -O0 wins while compile + n run is smaller: n < (c2 - c0) / (r0 - r2)
        even = (c2 - c0) / (r0 - r2) if r0 > r2 else float("inf")
        rows.append(f"| {name} | {c0:.1f} | {c2:.1f} | {r0:.2f} | {r2:.2f} | {r0 / r2:.1f} | "
                    f"{even:.1f} |")
        print(rows[-1], flush=True)
    table = ("| net | compile -O0 s | compile default s | run -O0 s | run default s | "
             "run -O0 / default | runs at which they break even |\n"
             "|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    write_results(PROBE_RESULTS, "opt_level",
                  probe_decision(__doc__) + "\n\nXLA -O0 against the default: the "
                  "single-device f64 train step (Adam, 8 rows, 32²).",
                  "python bench/probes/opt_level.py " + " ".join(sys.argv[1:]), table,
                  "The ties run each program 3-8 times (reference, nudged and reordered "
                  "trajectories; noise floors): -O0 only where it breaks even above that.")


if __name__ == "__main__":
    main()
