"""On a GPU: images per second and MFU of twinstep's bf16 train step at 224², one device.

For each net, the recipe ``<net>in_adamdp<N>bf16`` (AdamW, k = 1, bf16 convolutions, f32 master
weights, statistics and optimizer) is compiled at a probe batch; XLA's memory analysis of that
program gives the bytes per example, and the step is compiled again at the largest batch (a
multiple of 32, at most --max-batch) whose estimate fits in --memory-fraction of the device.
Synthetic inputs live on the device already: this times the step, not an input pipeline. The
state is donated, as the trainer does.

MFU = 2 x (the program's useful multiply-accumulates: forward, input and weight gradients,
counted in its StableHLO by `twinstep.rendering.stablehlo.macs`, without the zeros a strided
convolution's input gradient dilates its cotangent with) per step / step time / the device's
dense bf16 peak. The JSON also holds the count with those zeros ("tflop_per_step"), which the
first lease reported as MFU. Steps are timed in one window blocked once at its end, as the
trainer runs them (it blocks only at a log or checkpoint step). --recipe-res adds a row per
net at its recipe's own train resolution (MobileNetV4-Conv-M: 256²).

    python bench/gpu/step.py [--nets resnet50 mnv4] [--res 224] [--steps 30] [--batch N]
                             [--recipe-res] [--peak-tflops 989]

Prints one line per net and writes bench/gpu_step.json (or --json PATH) after each net. Exit 0
when it ran, 2 without a GPU, 3 when a net failed (its error is printed and the other nets still
run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import dp, program, recipes
from twinstep.nets import NETS, get_net, init
from twinstep.ops.levers import Levers
from twinstep.rendering import render, stablehlo

# H200 SXM (as H100 SXM): 989.4 dense bf16 TFLOP/s, NVIDIA's datasheet figure without sparsity
H200_BF16_TFLOPS = 989.4
GOALS = {"resnet50": 8000, "mnv4": 15000}  # img/s on one H200 (issue 16); the other nets: none


def build(net_name: str, batch: int, res: int, classes: int, options: dict | None = None,
          **levers):
    """(compiled step, its arguments, {"macs", "useful_macs"} per step) at ``batch`` examples
    of ``res``²; ``options``: XLA compiler options for this compile only; ``levers``: the
    `twinstep.ops.levers.Levers` set over the platform's (crop_unread, store, ...)."""
    recipe = dataclasses.replace(recipes.parse(f"{net_name}in_adamdpbf16"), batch=batch)
    net = get_net(net_name)
    setup = program.Setup(precision="bf16", levers=Levers(**levers))
    made = program.train_program(net, recipe, setup, classes=classes, donate=True)
    shapes = net.param_shapes(classes)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(),
                                linear=net.LINEAR_INIT)
    state = made.init(params, init.init_buffers(shapes))
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((1, batch, res, res, 3)), jnp.float32)
    ts = jax.nn.one_hot(jnp.asarray(rng.integers(0, classes, (1, batch))), classes)
    key = jax.random.key(1)
    lowered = made.step.lower(state, xs, ts, key)
    text = lowered.as_text()
    if Levers().on().dense_path != "conv":  # counted as a GPU's program computes it
        gpu = program.Setup(precision="bf16", levers=Levers.of("gpu"))
        text = program.train_program(net, recipe, gpu, classes=classes).step.lower(
            state, xs, ts, key).as_text()
    macs = {"macs": stablehlo.macs(text), "useful_macs": stablehlo.macs(text, useful=True)}
    return lowered.compile(compiler_options=options), (state, xs, ts, key), macs


def device_bytes() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0))


def program_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def largest_batch(net_name, res, classes, probe, fraction, most) -> tuple[int, dict]:
    """The batch whose estimated footprint fits: bytes(N) = fixed + N x per example, from the
    probe batch and half of it (compiled without autotuning, which only picks kernels)."""
    quick = {"xla_gpu_autotune_level": 0}
    sizes = {n: program_bytes(build(net_name, n, res, classes, quick)[0])
             for n in (probe // 2, probe)}
    per_example = (sizes[probe] - sizes[probe // 2]) / (probe - probe // 2)
    fixed = sizes[probe] - probe * per_example
    budget = fraction * device_bytes()
    batch = int((budget - fixed) // max(per_example, 1)) // 32 * 32
    return max(32, min(most, batch)), {"bytes_per_example": per_example, "fixed_bytes": fixed,
                                       "device_bytes": device_bytes()}


def time_steps(compiled, args, steps: int, windows: int = 3) -> tuple[list[float], tuple]:
    """(seconds per step of each of ``windows`` windows of ``steps`` // ``windows`` steps, each
    blocked once at its end; the arguments after them, the state stepped)."""
    state, xs, ts, key = args
    for _ in range(3):  # warm-up (autotuning, first-touch allocations)
        state, metrics = compiled(state, xs, ts, key)
    jax.block_until_ready(metrics)
    times, each = [], max(1, steps // windows)
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(each):
            state, metrics = compiled(state, xs, ts, key)
        jax.block_until_ready((state, metrics))
        times.append((time.perf_counter() - t0) / each)
    if not math.isfinite(float(metrics["loss"])):
        raise RuntimeError("the loss is not finite")
    return times, (state, xs, ts, key)


def run_net(net_name: str, args, res: int) -> dict:
    t0 = time.perf_counter()
    if args.batch:
        batch, memory = args.batch, {"device_bytes": device_bytes()}
    else:
        batch, memory = largest_batch(net_name, res, args.classes, args.probe,
                                      args.memory_fraction, args.max_batch)
    # the CPU twin (lease.py --twin) compiles at XLA:CPU's -O0: it runs the code, fast
    compiled, call_args, macs = build(net_name, batch, res, args.classes,
                                      dp.FAST_COMPILE if args.cpu_twin else None)
    compile_s = time.perf_counter() - t0
    times, _ = time_steps(compiled, call_args, args.steps)
    step_s = statistics.median(times)
    ips = batch / step_s
    mfu = 2 * macs["useful_macs"] / step_s / (args.peak_tflops * 1e12)
    return {"net": net_name, "batch": batch, "res": res, "step_ms": step_s * 1e3,
            "img_per_s": ips, "goal_img_per_s": GOALS.get(net_name), "mfu": mfu,
            "useful_tflop_per_step": 2 * macs["useful_macs"] / 1e12,
            "tflop_per_step": 2 * macs["macs"] / 1e12, "compile_and_sizing_s": compile_s,
            "step_ms_min_max": [min(times) * 1e3, max(times) * 1e3], **memory}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"], choices=list(NETS),
                   help="any of the catalogue's nets (default: resnet50 mnv4)")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=30, help="timed steps (median reported)")
    p.add_argument("--probe", type=int, default=128, help="the batch the memory is probed at")
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--batch", type=int, help="this batch, without the memory sizing (which "
                   "compiles each net twice more)")
    p.add_argument("--memory-fraction", type=float, default=0.8)
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                   help="the device's dense bf16 peak, for MFU (default: H200's)")
    p.add_argument("--recipe-res", action="store_true",
                   help="also each net at its recipe's own train resolution")
    p.add_argument("--json", type=Path,
                   default=Path(__file__).resolve().parents[1] / "gpu_step.json")
    p.add_argument("--cpu-twin", action="store_true", help=argparse.SUPPRESS)  # lease.py --twin
    args = p.parse_args(argv)
    if render.local_platform() not in ("cuda", "rocm") and not args.cpu_twin:
        print(f"no GPU: JAX runs on {jax.default_backend()}", file=sys.stderr)
        return 2
    rows, failed = [], 0
    runs = [(n, args.res) for n in args.nets]
    if args.recipe_res:
        runs += [(n, r) for n in args.nets
                 if (r := recipes.parse(f"{n}in_adamdpbf16").train_res) != args.res]
    for net_name, res in runs:
        try:
            row = run_net(net_name, args, res)
        except Exception as e:  # one net's failure (out of memory, say) leaves the other's row
            print(f"{net_name}: FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            failed += 1
            continue
        rows.append(row)
        goal = f" (goal {row['goal_img_per_s']:,})" if row["goal_img_per_s"] else ""
        print(f"{net_name}: batch {row['batch']} at {res}², bf16: {row['img_per_s']:,.0f} "
              f"img/s{goal}, {row['step_ms']:.1f} ms/step, useful "
              f"MFU {row['mfu']:.1%}, compile + sizing {row['compile_and_sizing_s']:.0f} s",
              flush=True)
        # after each net: a run cut short by its time limit keeps what it measured
        args.json.write_text(json.dumps({"device": str(jax.devices()[0].device_kind),
                                         "jax": jax.__version__, "rows": rows}, indent=1))
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
