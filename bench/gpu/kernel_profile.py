"""Where the bf16 train step's time goes on one device: a profile of each net's step.

For each net, in a process of its own under --limit seconds (a slow compile of one keeps the
other's result): the recipe ``<net>in_adamdp<N>bf16`` at --batch and --res, compiled as
bench/gpu/step.py compiles it; --steps steps timed in windows blocked once each; then --traced
steps traced with ``jax.profiler`` and the trace read back here. Per net, one JSON file
``profile_<net>_<res>.json`` under --out:

  img_per_s, step_ms      the timed windows' median
  useful_mfu              2 x the useful multiply-accumulates (`twinstep.rendering.stablehlo
                          .macs`, useful=True) per step / step time / --peak-tflops
  bandwidth_gb_s          XLA's bytes accessed per step (its cost analysis) / step time
  categories              ms per step by kind of kernel (`CATEGORIES`: the first whose pattern
                          an op's HLO name or its kernel's name matches), and their share
  top                     the --top kernels by time: name, HLO op, category, count, ms per step
  top_conv_calls          the --top convolution and GEMM calls by time, each by its HLO op's
                          own name
  ab                      with --ab, each lever (`LEVERS`: `twinstep.ops.levers.Levers` fields)
                          against the default, windows interleaved: its step_ms and speedup
                          (the default's step time over the lever's), written once the
                          profile is

With --hlo, also ``hlo_<net>_<res>.txt.gz``: the default step's optimized HLO, whose fusion
names the profile's kernels carry.

On a GPU the kernels are the device plane's events (each names its HLO op); on a machine without
one the same script is its own CPU twin, reading XLA:CPU's thunks from the host plane (there the
convolutions are fusions or dots, as XLA:CPU runs them).

    python bench/gpu/kernel_profile.py [--nets resnet50 mnv4] [--batch 512] [--res 224]
                                       [--steps 20] [--traced 3] [--limit 250] [--out bench/profile]
    python bench/gpu/kernel_profile.py --batch 4 --res 64 --steps 3 --traced 1   # the CPU twin
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twinstep.ops import levers
from twinstep.ops.levers import Levers

# (category, pattern of an HLO op's name or its kernel's): the first that matches either names
# it. XLA:GPU names cuDNN's convolutions cudnn-conv (forward, also with a fused bias and
# activation), cudnn-conv-bw-input and cudnn-conv-bw-filter; cuDNN's kernels say fprop, dgrad
# and wgrad, also where XLA made the call a fusion.
CATEGORIES = (
    ("conv backward-input", r"bw-input|dgrad"),
    ("conv backward-filter", r"bw-filter|wgrad"),
    ("conv forward", r"cudnn-conv|fprop|^convolution"),
    ("gemm", r"gemm|cublas|^dot|triton_gemm"),
    ("collectives", r"all-reduce|all-gather|reduce-scatter|all-to-all|nccl|collective"),
    ("copies and pads", r"^(copy|pad|slice|transpose|concatenate|dynamic-slice|"
                        r"dynamic-update-slice|wrapped_copy)|copy_fusion|transpose_fusion"),
    ("XLA fusions", r"fusion"),
)
AGGREGATE_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "TraceMe")
# the levers --ab times against the default, in this order: {name: (`Levers` fields, the nets
# it applies to)}. The default is this platform's (`Levers.on`); each lever the first lease
# timed one at a time (bench/RESULTS.md#gpu-profile) is adopted on a GPU now: the step without
# them (on the GPU's conv paths) is the "before". Then every candidate value not yet timed
# (`levers.candidates`), in the order of the bytes bench/gpu/twin.py predicts they save (a
# part's time limit may cut the last): bf16 storage between ops, ReLU masks kept as bits, both
# (ResNet-50: on MobileNetV4 the store moves no bytes), then the depthwise paths (MobileNetV4).
ADOPTED = ("crop_unread", "bn_moments")
_CANDIDATES = sorted(levers.candidates().items(), key=lambda c: "depthwise_path" in c[1])
LEVERS = {"without the GPU's levers": ({k: getattr(Levers.of("cpu"), k) for k in ADOPTED},
                                       ("resnet50", "mnv4")),
          **{name: (given, ("resnet50", "mnv4")) for name, given in _CANDIDATES
             if "depthwise_path" not in given},
          "store=bf16, relu_mask=bits": ({"store": "bf16", "relu_mask": "bits"},
                                         ("resnet50",)),
          **{name: (given, ("mnv4",)) for name, given in _CANDIDATES
             if "depthwise_path" in given}}


def category(op: str, kernel: str) -> str:
    """The first `CATEGORIES` entry that a kernel's HLO op's name or its own name matches."""
    for name, pattern in CATEGORIES:
        if re.search(pattern, op) or re.search(pattern, kernel):
            return name
    return "other"


def _planes(trace_dir: str) -> list:
    import jax

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {trace_dir}")
    return list(jax.profiler.ProfileData.from_file(paths[0]).planes)


def trace_lines(trace_dir: str) -> dict:
    """{"plane | line": events} of a trace's device planes (or its host plane): what
    `kernel_events` chose from, kept in the JSON to check its choice."""
    planes = _planes(trace_dir)
    gpu = [p for p in planes if p.name.startswith("/device:")]
    return {f"{p.name} | {line.name}": len(list(line.events))
            for p in gpu or [p for p in planes if p.name == "/host:CPU"] for line in p.lines}


def kernel_events(trace_dir: str) -> list[tuple[str, str, float]]:
    """(HLO op, kernel name, ns) of every timed kernel in a jax.profiler trace: on a GPU, every
    event of its device plane's streams (the op "" where the kernel names none, a copy say);
    without one, the host plane's events that name an HLO op (the aggregate lines, which repeat
    them, left out)."""
    planes = _planes(trace_dir)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    out = []
    for plane in gpu or [p for p in planes if p.name == "/host:CPU"]:
        lines = [line for line in plane.lines if not line.name.startswith(AGGREGATE_LINES)]
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams if gpu and streams else lines:
            for event in line.events:
                op = dict(event.stats).get("hlo_op")
                if op is not None or (gpu and streams):
                    out.append((str(op or ""), event.name, float(event.duration_ns)))
    return out


def summarise(events, steps: int, top: int) -> dict:
    """{"categories": {name: {"ms_per_step", "share"}}, "top": [...], "top_conv_calls": [...]}
    of ``steps`` traced steps' `kernel_events`; the conv and GEMM calls by their own HLO op (its
    name as the optimized HLO has it, to read its shapes there)."""
    by_category = collections.Counter()
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    by_conv_call = collections.Counter()
    for op, kernel, ns in events:
        kind = category(op, kernel)
        by_category[kind] += ns
        key = (kernel, re.sub(r"\.\d+$", "", op))
        by_kernel[key][0] += 1
        by_kernel[key][1] += ns
        if kind.startswith("conv") or kind == "gemm":  # XLA:CPU's convolutions are dots
            by_conv_call[(op, kind)] += ns
    total = sum(by_category.values()) or 1.0
    cats = {name: {"ms_per_step": ns / steps / 1e6, "share": ns / total}
            for name, ns in by_category.most_common()}
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernel_ms_per_step": total / steps / 1e6, "categories": cats,
            "top": [{"kernel": k[:160], "op": op, "category": category(op, k),
                     "count_per_step": n / steps, "ms_per_step": ns / steps / 1e6}
                    for (k, op), (n, ns) in ranked],
            "top_conv_calls": [{"op": op, "category": kind, "ms_per_step": ns / steps / 1e6}
                               for (op, kind), ns in by_conv_call.most_common(top)]}


def profile_net(net_name: str, args, write) -> dict:
    """One net's profile (the module docstring's fields), in this process; ``write(profile)``
    after the profile and again after each lever's A/B."""
    import jax

    from bench.gpu.step import build, time_steps

    t0 = time.perf_counter()
    compiled, call_args, macs = build(net_name, args.batch, args.res, args.classes)
    compile_s = time.perf_counter() - t0
    times, call_args = time_steps(compiled, call_args, args.steps)
    step_s = statistics.median(times)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    trace = tempfile.mkdtemp(prefix="twinstep-trace-")
    state, xs, ts, key = call_args
    jax.profiler.start_trace(trace)
    for _ in range(args.traced):
        state, metrics = compiled(state, xs, ts, key)
    jax.block_until_ready((state, metrics))
    jax.profiler.stop_trace()
    call_args = (state, xs, ts, key)  # the traced steps donated the state before them
    out = {"net": net_name, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "batch": args.batch, "res": args.res, "compile_s": compile_s,
           "step_ms": step_s * 1e3, "img_per_s": args.batch / step_s,
           "useful_mfu": 2 * macs["useful_macs"] / step_s / (args.peak_tflops * 1e12),
           "useful_gflop_per_image": 2 * macs["useful_macs"] / args.batch / 1e9,
           "gflop_per_image_with_dilated_zeros": 2 * macs["macs"] / args.batch / 1e9,
           "bandwidth_gb_s": float(cost.get("bytes accessed", 0.0)) / step_s / 1e9,
           **summarise(kernel_events(trace), args.traced, args.top),
           "trace_lines": trace_lines(trace)}
    if args.keep_trace:
        out["trace"] = trace
    if args.hlo:
        with gzip.open(args.out / f"hlo_{net_name}_{args.res}.txt.gz", "wt") as f:
            f.write(compiled.as_text())
    write(out)
    if args.ab:
        out["ab"] = {}
        for lever, (kwargs, nets) in LEVERS.items():
            if net_name in nets:
                out["ab"][lever], call_args = lever_ab(net_name, args, compiled, call_args,
                                                       kwargs)
            write(out)
    return out


def lever_ab(net_name: str, args, compiled, call_args, kwargs) -> dict:
    """The step built with ``kwargs`` against ``compiled`` (the default's), each timed in
    windows of --steps // 3 steps, interleaved, three of each: (medians, the default's
    arguments now: its steps donated those it was given)."""
    from bench.gpu.step import build, time_steps

    other, other_args, _ = build(net_name, args.batch, args.res, args.classes, **kwargs)
    times: dict = {"default": [], "lever": []}
    for _ in range(3):
        for name, fn in (("default", compiled), ("lever", other)):
            got, stepped = time_steps(fn, call_args if name == "default" else other_args,
                                      args.steps, windows=1)
            times[name] += got
            if name == "default":
                call_args = stepped
            else:
                other_args = stepped
    default, lever = (statistics.median(times[k]) for k in ("default", "lever"))
    return ({"step_ms": lever * 1e3, "default_step_ms": default * 1e3,
             "speedup": default / lever}, call_args)


def print_profile(p: dict) -> None:
    print(f"{p['net']}: batch {p['batch']} at {p['res']}² on {p['device']}: "
          f"{p['img_per_s']:,.0f} img/s, {p['step_ms']:.1f} ms/step, useful MFU "
          f"{p['useful_mfu']:.1%}, {p['bandwidth_gb_s']:,.0f} GB/s; kernels "
          f"{p['kernel_ms_per_step']:.1f} ms/step", flush=True)
    for name, c in p["categories"].items():
        print(f"  {name:22s} {c['ms_per_step']:9.2f} ms/step {c['share']:6.1%}", flush=True)
    for lever, r in p.get("ab", {}).items():
        print(f"  A/B {lever}: {r['step_ms']:.1f} against {r['default_step_ms']:.1f} ms/step, "
              f"speedup {r['speedup']:.3f}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20, help="timed steps, in 3 windows")
    p.add_argument("--traced", type=int, default=3, help="steps traced by the profiler")
    p.add_argument("--top", type=int, default=40, help="kernels listed by time")
    p.add_argument("--limit", type=int, default=250, help="seconds each net may take")
    p.add_argument("--peak-tflops", type=float, default=989.4,
                   help="the device's dense bf16 peak, for MFU (default: H200's)")
    p.add_argument("--keep-trace", action="store_true", help="keep the profiler's trace")
    p.add_argument("--hlo", action="store_true", help="also write the optimized HLO, gzipped")
    p.add_argument("--ab", action="store_true",
                   help=f"also time each lever against the default ({', '.join(LEVERS)})")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "profile")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the net this process profiles
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        path = args.out / f"profile_{args.one}_{args.res}.json"
        profile = profile_net(args.one, args,
                              lambda p: path.write_text(json.dumps(p, indent=1)))
        print_profile(profile)
        return 0
    failed = 0
    for net_name in args.nets:
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
               "--one", net_name]
        try:
            failed += subprocess.run(cmd, timeout=args.limit).returncode != 0
        except subprocess.TimeoutExpired:
            print(f"{net_name}: cut at {args.limit} s", flush=True)
            failed += 1
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
