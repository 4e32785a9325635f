"""The trainer's costs, timed in one run against its peers (medians of interleaved repeats);
the tables rewrite the sections "Training loop" and "Data pipeline" of bench/RESULTS.md.

1. The loop's overhead: a step of `twinstep train` (data from the loader's background thread,
   put on the devices a step ahead; metrics read back at log, eval and checkpoint steps) against
   the bare compiled step dispatched back to back on a batch already on the devices — the same
   compiled program, captured from the trainer — and against that step with a read-back after
   each call.
2. The data pipeline alone: images per second of timm's train transform + RandAugment + mixup
   on JPEGs at 224, by loader worker count.

    python bench/train.py [--recipe mnv4in_adamdp16] [--replicas 4] [--res 32] [--steps 20]
                          [--repeats 5] [--workers 0 1 2] [--images 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from common import RESULTS, write_results  # noqa: E402


def loop_overhead(args) -> str:
    """The loop's ms per step (from its last train record: img/s over every step after the
    first, read back at the end) against the same compiled step dispatched back to back on a
    batch already on the devices, and against that step with its loss read back after every
    call (what the loop did until it stopped waiting for the device). Interleaved repeats."""
    import json

    import jax

    from twinstep import api, dp, program
    from twinstep.data import loader
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
    times: dict = {"loop": [], "bare": [], "read": []}
    cfg = {"replicas": args.replicas, "res": args.res, "steps": args.steps,
           "eval_every": args.steps, "ckpt_every": args.steps, "log_every": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats + 1):  # the first compiles: left out
            out = os.path.join(tmp, str(repeat))
            api.train(args.recipe, out, **cfg)
            with open(os.path.join(out, "metrics.jsonl")) as f:
                last = [r for r in map(json.loads, f) if "loss" in r][-1]
            tc = TrainConfig(args.recipe, os.path.join(tmp, "bare"), **cfg)
            prog, recipe = made["train"], tc.parsed_recipe()
            src = loader.source("digits", args.res)
            state = prog.place(state_dict.initial_state(tc, get_net(recipe.net), prog,
                                                        src.classes))
            xs, ts, _ = loader.train_batch(src, loader.Augment(), 0, 0, recipe.accum, tc.rows,
                                           np.float32)
            xs, ts = jax.device_put((xs, ts), jax.sharding.NamedSharding(
                dp.mesh(args.replicas), dp.MICRO_BATCH))
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
                times["bare"].append(bare["s"])
                times["read"].append(read["s"])
    lo, ba, rd = (statistics.median(times[k]) for k in ("loop", "bare", "read"))
    return ("| recipe | R | res | loop ms / step | bare step ms | loop overhead | bare step with "
            "a read-back each step, ms | its cost |\n|---|---|---|---|---|---|---|---|\n"
            f"| {args.recipe} | {args.replicas} | {args.res}² | {lo * 1e3:.1f} | "
            f"{ba * 1e3:.1f} | {lo / ba - 1:+.1%} | {rd * 1e3:.1f} | {rd / ba - 1:+.1%} |")


def pipeline(args) -> str:
    from PIL import Image
    from sklearn.datasets import load_digits

    from twinstep.data import loader, mix

    rows = 32
    with tempfile.TemporaryDirectory() as tmp:
        d, rng = load_digits(), np.random.default_rng(0)
        for i in range(args.images):  # 500 x 375 JPEGs, ImageNet's typical size
            a = (d.images[i] * 16).astype(np.uint8)
            big = np.asarray(Image.fromarray(a).resize((500, 375)), np.float32)
            rgb = np.stack([big, big[::-1, ::-1], 255 - big], -1) + rng.normal(0, 20, (375, 500, 3))
            for split in ("train", "val"):
                os.makedirs(os.path.join(tmp, split, str(i % 4)), exist_ok=True)
                Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(
                    os.path.join(tmp, split, str(i % 4), f"{i}.jpg"), quality=90)
        src = loader.Folder(tmp, 224)
        augment = loader.Augment(9, mix.MixParams(0.2, 1.0))
        rates: dict = {w: [] for w in args.workers}
        starts: dict = {w: [] for w in args.workers}
        for _ in range(args.repeats):
            for w in args.workers:
                t0 = time.perf_counter()
                stream = loader.train_stream(src, augment, 0, 0, args.pipeline_steps, 1, rows,
                                             np.float32, w)
                next(stream)
                t1 = time.perf_counter()
                for _batch in stream:
                    pass
                starts[w].append(t1 - t0)
                rates[w].append((args.pipeline_steps - 1) * rows / (time.perf_counter() - t1))
    head = ("| workers | img/s after the first batch (median) | vs 0 workers | first batch s |"
            "\n|---|---|---|---|\n")
    base = statistics.median(rates[args.workers[0]])
    return head + "\n".join(f"| {w} | {statistics.median(r):.0f} | "
                            f"{statistics.median(r) / base:.2f}x | "
                            f"{statistics.median(starts[w]):.1f} |" for w, r in rates.items())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="mnv4in_adamdp16")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--res", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--pipeline-steps", type=int, default=12)
    p.add_argument("--only", choices=("loop", "pipeline"))
    args = p.parse_args()
    command = "python bench/train.py " + " ".join(sys.argv[1:])
    if args.only != "pipeline":
        write_results(RESULTS, "Training loop",
                      "The training loop against the bare step (digits, f32).", command,
                      loop_overhead(args),
                      "Loop: `twinstep train`'s ms per step over every step after the first "
                      "(which compiles), from its last train record (img/s, read back at the "
                      "end). Bare: the same compiled step dispatched back to back on one batch "
                      "on the devices; with a read-back: the loss read after each call. "
                      "Medians of interleaved repeats.")
    if args.only == "loop":
        return
    write_results(RESULTS, "Data pipeline",
                  "The data pipeline alone: timm's train transform, RandAugment m9, mixup / "
                  "CutMix, 500 x 375 JPEGs to 224².", command, pipeline(args),
                  "Images per second through `twinstep.data.loader.train_stream`, 32 rows a "
                  "step, once the first batch is out, by loader worker processes (0: one "
                  "background thread); the first batch's wait (the processes start) apart.")


if __name__ == "__main__":
    main()
