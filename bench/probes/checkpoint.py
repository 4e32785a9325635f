"""Probe for checkpoints of one host copy, not R replicas, uncompressed
(twinstep/training/checkpoint.py): a checkpoint of the train state written by orbax in the
three ways the trainer could: the R replicated device arrays as they are, or one host copy
(NumPy), zstd-compressed (orbax's default) or not (what `twinstep train` writes). Save (until
orbax returns), the wait for its background write, and a restore of it as NumPy, each the
median of interleaved saves; the first save of each way (which compiles orbax's per-shape
device programs) apart; the CPU time of the save and write, all threads (what a write in
flight takes from the steps and the data loader); and the size on disk. The state's floats
are those of a digits run after --steps steps.

    python bench/probes/checkpoint.py [--recipe mnv4in_momdp2] [--replicas 4] [--precision f64]
                                      [--runs 5] [--steps 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="mnv4in_momdp2")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--precision", default="f64", choices=["f64", "f32"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2, help="the state checkpointed: after these "
                    "steps of `twinstep train` on the digits")
    return ap.parse_args()


def main(args) -> None:
    import jax

    jax.config.update("jax_enable_x64", args.precision == "f64")
    import numpy as np
    import orbax.checkpoint as ocp

    from bench.common import PROBE_RESULTS, probe_decision, write_results
    from twinstep import api, dp, program, recipes
    from twinstep.nets import get_net, init
    from twinstep.ops.precision import get_precision
    from twinstep.training.checkpoint import Checkpoints

    dp.ensure_devices(args.replicas)
    recipe = recipes.parse(args.recipe)
    net, dtype = get_net(recipe.net), get_precision(args.precision).dtype
    shapes = net.param_shapes(10)
    setup = program.Setup(replicas=args.replicas, precision=args.precision)
    made = program.train_program(net, recipe, setup, classes=10)
    state = made.init(init.init_params(jax.random.key(0), shapes, net.zero_init_bns(), dtype,
                                         linear=net.LINEAR_INIT),
                      init.init_buffers(shapes, dtype))
    # a trained state, not the initial one: its zero moments compress away, as no state's
    # after the first step do
    with tempfile.TemporaryDirectory() as run:
        api.train(args.recipe, run, replicas=args.replicas, steps=args.steps,
                  precision=args.precision, ckpt_every=args.steps, eval_every=args.steps)
        with Checkpoints(run, 1) as saved:
            host = jax.tree.map(np.asarray, saved.restore(jax.tree.map(np.asarray, state)))
    state = made.place(host)
    target = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), host)
    ways = {  # (the tree to save, compressed)
        "replicated device arrays, zstd": (state, True), "one host copy, zstd": (host, True),
        "one host copy, uncompressed": (host, False)}
    times = {k: {"save": [], "write": [], "cpu": [], "restore": [], "first": 0.0} for k in ways}
    with tempfile.TemporaryDirectory() as root:
        managers = {k: ocp.CheckpointManager(
            f"{root}/{i}", item_handlers=ocp.PyTreeCheckpointHandler(use_compression=zstd))
            for i, (k, (_, zstd)) in enumerate(ways.items())}
        for run in range(args.runs + 1):
            for k, (tree, _) in ways.items():
                t0, c0 = time.perf_counter(), time.process_time()
                managers[k].save(run, args=ocp.args.PyTreeSave(tree))
                t1 = time.perf_counter()
                managers[k].wait_until_finished()
                t2, c2 = time.perf_counter(), time.process_time()
                managers[k].restore(run, args=ocp.args.PyTreeRestore(
                    target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
                t3 = time.perf_counter()
                if run == 0:
                    times[k]["first"] = t2 - t0
                    continue
                for part, seconds in (("save", t1 - t0), ("write", t2 - t1),
                                      ("cpu", c2 - c0), ("restore", t3 - t2)):
                    times[k][part].append(seconds)
        sizes = {k: sum(f.stat().st_size for f in Path(f"{root}/{i}/{args.runs}").rglob("*")
                        if f.is_file()) for i, k in enumerate(ways)}
        for m in managers.values():
            m.close()
    rows = []
    for k, t in times.items():
        s, w, c, r = (statistics.median(t[part]) for part in ("save", "write", "cpu", "restore"))
        rows.append(f"| {k} | {s:.2f} | {w:.2f} | {s + w:.2f} | {c:.2f} | {t['first']:.1f} | "
                    f"{r:.2f} | {sizes[k] / 2**20:.0f} |")
    leaves = len(jax.tree.leaves(state))
    write_results(
        PROBE_RESULTS, "checkpoint", probe_decision(__doc__) + "\n\nCheckpoint writes: "
        f"{args.recipe}'s train state on R = {args.replicas}, {args.precision} ({leaves} "
        f"arrays), after {args.steps} steps on the digits.", "python " + " ".join(sys.argv),
        "| written as | save s | background write s | total s | CPU s (all threads) | first "
        "save s | restore s | MiB |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows),
        f"Medians of {args.runs} interleaved saves after a first one.")


if __name__ == "__main__":
    main(_args())
