"""Probe for checkpoints of one host copy, not R replicas (twinstep/training/checkpoint.py):
a checkpoint of the train state written by orbax in the two ways the trainer could: the R
replicated device arrays as they are, or one host copy (NumPy; what `twinstep train` writes).
Save (until orbax returns) and the wait for its background write, each the median of interleaved
saves; the first save of each way (which compiles orbax's per-shape device programs) apart.

    python bench/probes/checkpoint.py [--recipe mnv4in_momdp2] [--replicas 4] [--precision f64]
                                      [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="mnv4in_momdp2")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--precision", default="f64", choices=["f64", "f32"])
    ap.add_argument("--runs", type=int, default=5)
    return ap.parse_args()


def main(args) -> None:
    import jax

    jax.config.update("jax_enable_x64", args.precision == "f64")
    import numpy as np
    import orbax.checkpoint as ocp
    from common import PROBE_RESULTS, probe_decision, write_results

    from twinstep import dp, program, recipes
    from twinstep.nets import get_net, layers
    from twinstep.ops.precision import get_precision

    dp.ensure_devices(args.replicas)
    recipe = recipes.parse(args.recipe)
    net, dtype = get_net(recipe.net), get_precision(args.precision).dtype
    shapes = net.param_shapes(1000)
    made = program.train_program(net, recipe, 1000, args.replicas, args.precision)
    state = made.place(made.init(
        layers.init_params(jax.random.key(0), shapes, net.zero_init_bns(), dtype,
                           linear=net.LINEAR_INIT),
        layers.init_buffers(shapes, dtype)))
    trees = {"replicated device arrays": lambda: state,
             "one host copy": lambda: jax.tree.map(np.asarray, state)}
    times = {k: ([], [], 0.0) for k in trees}
    with tempfile.TemporaryDirectory() as root:
        managers = {k: ocp.CheckpointManager(f"{root}/{i}") for i, k in enumerate(trees)}
        for run in range(args.runs + 1):
            for k, tree in trees.items():
                t0 = time.perf_counter()
                managers[k].save(run, args=ocp.args.StandardSave(tree()))
                t1 = time.perf_counter()
                managers[k].wait_until_finished()
                t2 = time.perf_counter()
                saves, waits, first = times[k]
                if run == 0:
                    times[k] = (saves, waits, t2 - t0)
                else:
                    saves.append(t1 - t0)
                    waits.append(t2 - t1)
        for m in managers.values():
            m.close()
    rows = []
    for k, (saves, waits, first) in times.items():
        s, w = statistics.median(saves), statistics.median(waits)
        rows.append(f"| {k} | {s:.2f} | {w:.2f} | {s + w:.2f} | {first:.1f} |")
    leaves = len(jax.tree.leaves(state))
    write_results(
        PROBE_RESULTS, "checkpoint", probe_decision(__doc__) + "\n\nCheckpoint writes: "
        f"{args.recipe}'s train state on R = {args.replicas}, {args.precision} ({leaves} "
        "arrays).", "python " + " ".join(sys.argv),
        "| written as | save s | background write s | total s | first save s |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows),
        f"Medians of {args.runs} interleaved saves after a first one.")


if __name__ == "__main__":
    main(_args())
