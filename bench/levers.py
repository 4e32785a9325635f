"""XLA:CPU levers on twinstep's whole DP train step, each a variant compiled in the same process
and timed interleaved with the default: the oneDNN and XNNPACK paths of the installed jaxlib
(per-compile options, so one run compares them), one thread per device for XLA's kernels
(``xla_cpu_multi_thread_eigen`` off), state donation, copy insertion without region analysis
(XLA's default, which copies donated weights: `twinstep.dp.CPU_OPTIONS`), dense convolutions
as XLA convolutions (the ``conv`` path) instead of the CPU default, every replica holding and
updating the whole optimizer state instead of a 1/R slice of it; and sync-BN's overhead, the
gradient step with BN synchronised vs per-replica statistics (the `unsynced` control), with
XLA's intra-op threads and without.

    python bench/levers.py [--nets resnet50 mnv4] [--res 64] [--replicas 2] [--global-batch 8]
                           [--runs 7] [--sync-bn-only]

Sync-BN's overhead is the median of the per-round ratios synced / unsynced (rounds alternate
their order), with its interquartile range: ``--sync-bn-only --runs 21`` measures only that.
The table rewrites the section "Levers" of bench/RESULTS.md, or "Sync-BN overhead" with
--sync-bn-only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import RESULTS, block, interleaved_times, paired_ratio, write_results
from twinstep import dp, program, recipes
from twinstep.nets import get_net, init
from twinstep.ops.levers import Levers

VARIANTS = {  # name: (XLA compiler options, donate the state, dense conv path, shard optimizer)
    "default (donated)": ({}, True, None, True),
    "not donated": ({}, False, None, True),
    "copy insertion without region analysis": (
        {k: False for k in dp.CPU_OPTIONS}, True, None, True),
    "xla_cpu_use_onednn": ({"xla_cpu_use_onednn": True}, True, None, True),
    "xla_cpu_use_xnnpack": ({"xla_cpu_use_xnnpack": True}, True, None, True),
    "dense path conv": ({}, True, "conv", True),
    # one thread per device for XLA's dot / conv kernels: with as many replicas as cores, each
    # device's thread has a core, and no intra-op pool competes with the other devices for it
    "xla_cpu_multi_thread_eigen off": ({"xla_cpu_multi_thread_eigen": False}, True, None, True),
    "optimizer state replicated": ({}, True, None, False),
}
# the gradient step synced and unsynced, each compiled with these options (label suffix: options)
GRAD_STEP_OPTIONS = {"": {}, ", eigen off": VARIANTS["xla_cpu_multi_thread_eigen off"][0]}


def grad_label(synced: bool, suffix: str = "") -> str:
    return f"grad step, BN {'synced' if synced else 'unsynced'}{suffix}"


def variants(name: str, res: int, replicas: int, global_batch: int, classes: int,
             sync_bn_only: bool = False) -> dict:
    net = get_net(name)
    recipe = dataclasses.replace(recipes.parse(f"{name}in_adamdp"), batch=global_batch // replicas)
    shapes = net.param_shapes(classes)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(),
                                linear=net.LINEAR_INIT)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((1, global_batch, res, res, 3)), jnp.float32)
    ts = jax.nn.one_hot(jnp.asarray(rng.integers(0, classes, (1, global_batch))), classes)
    key = jax.random.key(1)
    fns = {}
    for label, (options, donate, dense_path, shard_optimizer) in (
            {} if sync_bn_only else VARIANTS).items():
        setup = program.Setup(replicas=replicas, precision="f32",
                              levers=Levers(dense_path=dense_path))
        made = program.train_program(net, recipe, setup, classes=classes, donate=donate,
                                     shard_optimizer=shard_optimizer)
        # a copy for each variant: a donated state frees its arrays, the originals included
        state = made.place(made.init(*jax.tree.map(jnp.copy, (
            params, init.init_buffers(shapes)))))
        try:
            compiled = made.step.lower(state, xs, ts, key).compile(compiler_options=options)
        except Exception as e:  # an option this jaxlib does not take: reported, not timed
            print(f"{label}: {type(e).__name__}: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        box = {"state": state}

        def run(compiled=compiled, box=box):
            box["state"], metrics = compiled(box["state"], xs, ts, key)
            block(metrics)

        fns[label] = run
    # sync-BN's cost: the gradient step with BN synchronised vs per-replica (`unsynced`)
    p, b = dp.replicate((params, init.init_buffers(shapes)), replicas)
    for control in ("none", "unsynced"):
        setup = program.Setup(replicas=replicas, precision="f32", control=control)
        grad = program.grad_program(net, setup, loss="ce", per_replica=True)
        for suffix, options in GRAD_STEP_OPTIONS.items():
            compiled = grad.lower(p, b, xs[0], ts[0]).compile(compiler_options=options)
            fns[grad_label(control == "none", suffix)] = (
                lambda compiled=compiled: block(compiled(p, b, xs[0], ts[0]).grads))
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"])
    ap.add_argument("--res", type=int, nargs="+", default=[64])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--sync-bn-only", action="store_true",
                    help="time only the synced and unsynced gradient steps")
    args = ap.parse_args()
    dp.ensure_devices(args.replicas)
    lines = []
    for name in args.nets:
        for res in args.res:
            fns = variants(name, res, args.replicas, args.global_batch, args.classes,
                           args.sync_bn_only)
            times = interleaved_times(fns, runs=args.runs)
            for label in times:
                lines.append(_row(name, res, label, times))
                print(lines[-1], flush=True)
    write_results(
        RESULTS, "Sync-BN overhead" if args.sync_bn_only else "Levers",
        ("Sync-BN's overhead: the gradient step with BN synchronised against per-replica "
         "statistics" if args.sync_bn_only else "XLA:CPU levers on the whole train step")
        + f", R = {args.replicas}, global batch {args.global_batch}, f32.",
        "python " + " ".join(sys.argv),
        "| net | res | variant | ms/step | time / default (paired: median [IQR]) |\n"
        "|---|---|---|---|---|\n" + "\n".join(lines),
        f"Medians of {args.runs} interleaved runs; time / default < 1: faster. The ratio is the "
        "median of the rounds' ratios and its interquartile range; the grad-step rows are "
        "against the unsynced one compiled alike: sync-BN's overhead.")


def _row(name: str, res: int, label: str, times: dict) -> str:
    """A table row: the median, and the paired ratio against the row's baseline."""
    # a grad-step row against the unsynced one compiled alike: sync-BN's overhead
    suffix = next((x for x in GRAD_STEP_OPTIONS if x and label.endswith(x)), "")
    base = (grad_label(False, suffix) if label.startswith("grad step")
            else "default (donated)")
    ratio, q1, q3 = paired_ratio(times[label], times[base])
    return (f"| {name} | {res}² | {label} | {statistics.median(times[label]) * 1e3:.0f} | "
            f"{ratio:.3f} [{q1:.3f}, {q3:.3f}] |")


if __name__ == "__main__":
    main()
