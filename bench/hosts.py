"""The cost of many processes: the same R replicas of N run as 1 process x R devices and as
P processes x R/P devices each (`twinstep launch --local P`), the step time read from each run's
metrics.jsonl (img/s past the first, compiling, step). Runs interleave (1 process, P processes,
1, P, ...) and the medians are compared; the table rewrites the section "Many processes" of
bench/RESULTS.md.

What differs between the two: within one process XLA:CPU's all-reduce runs in shared memory;
across processes the collectives go over gloo (TCP on localhost), and each process also runs
its own loader and Python loop.

    python bench/hosts.py [--recipe mnv4in_momdp8] [--replicas 4] [--processes 2] [--res 32]
                          [--steps 20] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.common import RESULTS, write_results


def step_seconds(cmd: list[str], run_dir: str, rows: int, env: dict) -> float:
    """Run ``cmd`` (a train into ``run_dir``); its steady step time, from its last record."""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if '"eval"' not in line][-1]
    return rows / last["img_per_s"]


def bitwise(a: str, b: str) -> tuple[int, int]:
    """How many of two runs' final state tensors are bitwise equal, of how many."""
    import numpy as np
    from jax import tree

    from twinstep.training.checkpoint import load_state

    leaves = [tree.leaves(load_state(d)) for d in (a, b)]
    return sum(np.array_equal(x, y) for x, y in zip(*leaves, strict=True)), len(leaves[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="mnv4in_momdp8")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--res", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from twinstep import recipes

    recipe = recipes.parse(args.recipe)
    rows = args.replicas * recipe.batch * recipe.accum
    twinstep = [sys.executable, "-m", "twinstep.cli"]
    times: dict[str, list[float]] = {"one": [], "many": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.path.join(tmp, "cache"),
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # compile once per topology
        for repeat in range(args.repeats + 1):  # the first fills the compilation cache
            for kind in ("one", "many"):
                run_dir = os.path.join(tmp, f"{kind}{repeat}")
                train = ["train", args.recipe, "--data", "digits", "--replicas",
                         str(args.replicas), "--res", str(args.res), "--steps", str(args.steps),
                         "--eval-every", str(args.steps), "--ckpt-every", str(args.steps),
                         "--log-every", str(args.steps), "--out", run_dir]
                cmd = twinstep + (train if kind == "one" else
                                  ["launch", "--local", str(args.processes), "--", *train])
                seconds = step_seconds(cmd, run_dir, rows, env)
                if repeat:
                    times[kind].append(seconds)
                print(f"{kind} #{repeat}: {seconds * 1e3:.1f} ms/step", flush=True)
            same, total = bitwise(*(os.path.join(tmp, f"{k}{repeat}") for k in ("one", "many")))
            print(f"#{repeat}: {same}/{total} state tensors bitwise equal", flush=True)
    one, many = (statistics.median(times[k]) for k in ("one", "many"))
    p, per = args.processes, args.replicas // args.processes
    table = ("| topology | step (median ms) | runs (ms) |\n|---|---:|---|\n"
             f"| 1 process x {args.replicas} devices | {one * 1e3:.1f} | "
             f"{', '.join(f'{t * 1e3:.0f}' for t in times['one'])} |\n"
             f"| {p} processes x {per} devices (gloo) | {many * 1e3:.1f} | "
             f"{', '.join(f'{t * 1e3:.0f}' for t in times['many'])} |\n\n"
             f"{p} processes / 1 process: **{many / one:.2f}x** the step time "
             f"({(many - one) * 1e3:+.1f} ms a step). The final states of each pair (f32, "
             f"{args.steps} steps): {same} of {total} tensors bitwise equal.")
    write_results(RESULTS, "Many processes",
                  f"{args.recipe} on {args.replicas} replicas, 1 process against {p} (digits, "
                  f"{args.res}², f32).",
                  f"python bench/hosts.py --recipe {args.recipe} --replicas {args.replicas} "
                  f"--processes {p} --res {args.res} --steps {args.steps} "
                  f"--repeats {args.repeats}", table)


if __name__ == "__main__":
    main()
