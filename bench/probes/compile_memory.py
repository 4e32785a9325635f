"""Probe for where `twinstep train`'s memory goes beyond timm's (the compile of its step):
one process's resident memory (RSS; its peak from getrusage) through a short run of
`twinstep.train` on the digits, each variant in a fresh process with its own empty compilation
cache, in interleaved rounds:

- compile only: the train step compiled ahead of time from its arguments' shapes
  (`program.compile_step`), then the freed memory handed back (`settings.release_freed_memory`,
  glibc's malloc_trim);
- compiled at step 1: the run with its step compiled by jit at the first step, on top of the
  state, the data and the smaller programs (the trainer until 2026-12-04);
- cold: the run as `twinstep train` makes it with an empty cache (the step compiled first,
  before the state and the data exist, then malloc_trim);
- warm: the run again on the cache a cold run left.

Each at every --replicas (the same global batch): beside the process's memory, "compile only"
reports the step's own buffers as XLA's memory analysis gives them, its arguments and
temporaries on every device (R x per device), the floor any run of that program stands on.

    python bench/probes/compile_memory.py [--recipe mnv4in_adamdp16] [--batch 64] [--res 32]
                                          [--replicas 1 4] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("compile only", "compiled at step 1", "cold", "warm")


def _mib() -> tuple[float, float]:
    """(this process's RSS, its peak RSS so far) in MiB."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def _compile_only(args) -> dict:
    """The train step compiled from shapes alone, as the trainer compiles it first, then the
    memory the compiler freed given back: {rss after compile, peak, rss after malloc_trim}."""
    from twinstep import program
    from twinstep.nets import get_net
    from twinstep.processes import settings
    from twinstep.training.config import TrainConfig

    cfg = TrainConfig(args.recipe, "unused", replicas=args.replicas, batch=args.batch,
                      res=args.res, steps=args.steps)
    recipe = cfg.parsed_recipe()
    prog = program.train_program(get_net(recipe.net), recipe, program.Setup(replicas=args.replicas),
                                 classes=10)
    compiled = program.compile_step(prog, program.Setup(replicas=args.replicas),
                                    micro=(recipe.accum, cfg.rows), res=args.res, classes=10)
    rss, peak = _mib()
    m = compiled.memory_analysis()  # per device; the outputs alias the donated arguments
    buffers = args.replicas * (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**20
    settings.release_freed_memory()
    return {"compiled_rss": rss, "compile_peak": peak, "trimmed_rss": _mib()[0],
            "step_buffers": buffers}


def _variant(args) -> dict:
    """One variant in this (fresh) process, on the cache in TWINSTEP_COMPILE_CACHE."""
    from twinstep import dp
    from twinstep.processes import settings

    dp.ensure_devices(args.replicas)
    settings.use_compile_cache()
    t0, out = time.perf_counter(), {}
    if args.variant == "compile only":
        out |= _compile_only(args)
    else:
        from twinstep import api
        from twinstep.training import loop

        if args.variant == "compiled at step 1":  # the step left to jit
            loop._compiled_step = lambda cfg, prog, classes: prog

        first = {}

        def progress(step, metrics):
            if step == 1 and not first:
                first["rss"] = _mib()[0]

        with tempfile.TemporaryDirectory() as run:
            api.train(args.recipe, run, replicas=args.replicas, batch=args.batch, res=args.res,
                      steps=args.steps, eval_every=args.steps, progress=progress)
        out["step1_rss"] = first["rss"]
    out["peak"], out["wall"] = _mib()[1], time.perf_counter() - t0
    return out


def main() -> None:
    from bench.common import PROBE_RESULTS, probe_decision, write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="mnv4in_adamdp16")
    p.add_argument("--batch", type=int, default=64, help="the global batch, R x N")
    p.add_argument("--res", type=int, default=32)
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        args.replicas = args.replicas[0]
        print(json.dumps(_variant(args)))
        return
    found = {(r, v): [] for r in args.replicas for v in VARIANTS}
    for n in range(args.rounds):
        for r in args.replicas:
            with tempfile.TemporaryDirectory() as tmp:
                for v in VARIANTS:  # each its own empty cache, but warm reads the one cold left
                    cache = os.path.join(tmp, "cold" if v == "warm" else v.replace(" ", "-"))
                    env = {k: x for k, x in os.environ.items()
                           if k not in ("JAX_COMPILATION_CACHE_DIR", "TWINSTEP_NO_COMPILE_CACHE")}
                    done = subprocess.run(
                        [sys.executable, __file__, "--variant", v, "--recipe", args.recipe,
                         "--batch", str(args.batch // r), "--res", str(args.res), "--replicas",
                         str(r), "--steps", str(args.steps)],
                        env={**env, "TWINSTEP_COMPILE_CACHE": cache},
                        capture_output=True, text=True, check=True)
                    found[r, v].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"round {n + 1} R = {r} {v}: {found[r, v][-1]}", file=sys.stderr,
                          flush=True)

    def med(r, v, k):
        values = [f[k] for f in found[r, v] if k in f]
        return f"{statistics.median(values):.0f}" if values else ""

    rows = ["| R x N | variant | peak MiB | RSS after the step's compile MiB | after malloc_trim "
            "MiB | RSS after step 1 MiB | the step's buffers MiB | wall s |",
            "|---|---|---|---|---|---|---|---|"]
    rows += [f"| {r} x {args.batch // r} | {v} | {med(r, v, 'peak')} | "
             f"{med(r, v, 'compiled_rss')} | {med(r, v, 'trimmed_rss')} | "
             f"{med(r, v, 'step1_rss')} | {med(r, v, 'step_buffers')} | {med(r, v, 'wall')} |"
             for r in args.replicas for v in VARIANTS]
    write_results(
        PROBE_RESULTS, "compile_memory", probe_decision(__doc__) + "\n\n"
        f"`{args.recipe}` at a global batch of {args.batch}, {args.res}², {args.steps} "
        "steps, f32, on the digits; one process's RSS.",
        "python bench/probes/compile_memory.py " + " ".join(sys.argv[1:]), "\n".join(rows),
        f"Medians of {args.rounds} interleaved rounds, each variant in a fresh process.")


if __name__ == "__main__":
    main()
