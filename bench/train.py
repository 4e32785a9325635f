"""The training loop's cost, timed in one run against its peers (medians of interleaved
repeats); the table rewrites the section "Training loop" of bench/RESULTS.md (the data pipeline
is bench/loader.py's).

A step of `twinstep train` (data from the loader's background thread, put on the devices a step
ahead; metrics read back at log, eval and checkpoint steps) against the bare compiled step
dispatched back to back on a batch already on the devices — the same compiled program, captured
from the trainer — and against that step with a read-back after each call; and the loop with a
checkpoint in flight every 2 steps against the loop.

    python bench/train.py [--recipe mnv4in_adamdp16] [--replicas 4] [--res 32] [--steps 20]
                          [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from bench.common import RESULTS, write_results


def loop_overhead(args) -> str:
    """The loop's ms per step (from its last train record: img/s over every step after the
    first, read back at the end) against the same compiled step dispatched back to back on a
    batch already on the devices, and against that step with its loss read back after every
    call (what the loop did until it stopped waiting for the device). Interleaved repeats."""
    import json

    import jax

    from twinstep import api, dp, program
    from twinstep.data import loader, sources
    from twinstep.nets import get_net
    from twinstep.training import state_dict
    from twinstep.training.config import TrainConfig

    dp.ensure_devices(args.replicas)
    made: dict = {}
    build_train, build_eval = program.train_program, program.eval_program

    def train_program(*a, **kw):  # one compile for every repeat: the same program
        if "train" not in made:
            made["train"] = build_train(*a, **kw)
        return made["train"]

    def eval_program(*a, **kw):
        if "eval" not in made:
            made["eval"] = build_eval(*a, **kw)
        return made["eval"]

    program.train_program, program.eval_program = train_program, eval_program
    times: dict = {"loop": [], "bare": [], "read": [], "ckpt": []}
    cfg = {"replicas": args.replicas, "res": args.res, "steps": args.steps,
           "eval_every": args.steps, "ckpt_every": args.steps, "log_every": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):  # the first compiles: left out
            out = os.path.join(tmp, str(repeat))
            api.train(args.recipe, out, **cfg)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                last = [r for r in map(json.loads, f) if "loss" in r][-1]
            saving = os.path.join(tmp, f"{repeat}-ckpt")  # a checkpoint in flight every 2 steps
            api.train(args.recipe, saving, **{**cfg, "ckpt_every": 2})
            with open(os.path.join(saving, "metrics.jsonl")) as f:
                last_saving = [r for r in map(json.loads, f) if "loss" in r][-1]
            tc = TrainConfig(args.recipe, os.path.join(tmp, "bare"), **cfg)
            prog, recipe = made["train"], tc.parsed_recipe()
            src = sources.get_source("digits", args.res)
            state = prog.place(state_dict.initial_state(tc, get_net(recipe.net), prog,
                                                        src.classes))
            b = loader.train_batch(src, sources.Augment(), seed=0, step=0, micro=recipe.accum,
                                   rows=tc.rows)
            xs, ts = program.prepare_program(src.classes, tc.setup)(
                *jax.device_put((b.xs, b.labels), jax.sharding.NamedSharding(
                    dp.mesh(args.replicas), dp.MICRO_BATCH)), b.mix, b.box,
                jax.device_put(b.plan, jax.sharding.NamedSharding(
                    dp.mesh(args.replicas), dp.MICRO_BATCH)))
            key = jax.random.key(0)
            state, m = prog.step(state, xs, ts, key)
            jax.block_until_ready(state)
            bare, read = {}, {}
            for kind, spent in (("bare", bare), ("read", read)):
                t0 = time.perf_counter()
                for _ in range(args.steps - 1):
                    state, m = prog.step(state, xs, ts, key)
                    if kind == "read":
                        float(m["loss"])
                jax.block_until_ready(state)
                spent["s"] = (time.perf_counter() - t0) / (args.steps - 1)
            if repeat:
                times["loop"].append(tc.rows * recipe.accum / last["img_per_s"])
                times["ckpt"].append(tc.rows * recipe.accum / last_saving["img_per_s"])
                times["bare"].append(bare["s"])
                times["read"].append(read["s"])
    lo, ba, rd, ck = (statistics.median(times[k]) for k in ("loop", "bare", "read", "ckpt"))
    return ("| recipe | R | res | loop ms / step | bare step ms | loop overhead | bare step with "
            "a read-back each step, ms | its cost | loop with a checkpoint every 2 steps, ms | "
            "its cost |\n|---|---|---|---|---|---|---|---|---|---|\n"
            f"| {args.recipe} | {args.replicas} | {args.res}² | {lo * 1e3:.1f} | "
            f"{ba * 1e3:.1f} | {lo / ba - 1:+.1%} | {rd * 1e3:.1f} | {rd / ba - 1:+.1%} | "
            f"{ck * 1e3:.1f} | {ck / lo - 1:+.1%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="mnv4in_adamdp16")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--res", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    command = "python bench/train.py " + " ".join(sys.argv[1:])
    write_results(RESULTS, "Training loop",
                  "The training loop against the bare step (digits, f32).", command,
                  loop_overhead(args),
                  "Loop: `twinstep train`'s ms per step over every step after the first "
                  "(which compiles), from its last train record (img/s, read back at the "
                  "end). Bare: the same compiled step dispatched back to back on one batch "
                  "on the devices; with a read-back: the loss read after each call. With a "
                  "checkpoint every 2 steps: the loop again, its state copied to the host and "
                  "written by orbax's thread while the next steps run (its cost: against the "
                  "loop). "
                  "Medians of interleaved repeats.")


if __name__ == "__main__":
    main()
