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
                          (the default's step time over the lever's), and "paired": the
                          median and quartiles of each round's own ratio; written once the
                          profile is. --candidates names which instead, also XLA:GPU options
                          (`XLA_CANDIDATES`); one this XLA refuses or that fails gets
                          "refused" or "error" and the next runs

With --hlo, also ``hlo_<net>_<res>.txt.gz``: the default step's optimized HLO, whose fusion
names the profile's kernels carry.

On a GPU the kernels are the device plane's events (each names its HLO op); on a machine without
one the same script is its own CPU twin, reading XLA:CPU's thunks from the host plane (there the
convolutions are fusions or dots, as XLA:CPU runs them).

    python bench/gpu/kernel_profile.py [--nets resnet50 mnv4] [--batch 512] [--res 224]
                                       [--steps 20] [--traced 3] [--limit 250] [--out bench/profile]
    python bench/gpu/kernel_profile.py --batch 4 --res 64 --steps 3 --traced 1   # the CPU twin
    python bench/gpu/kernel_profile.py --nets resnet50 --traced 1 --rounds 5 --steps 8 \
        --candidates store=bf16 relu_mask=bits       # the lease's A/B (bench/gpu/lease.py)
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

from bench.common import paired_ratio
from twinstep import dp
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
# XLA:GPU options timed as candidates, named as XLA_FLAGS spells them less its "--" (how an
# adopted one is set). Each is given to its program's compile alone (``compiler_options``), so
# it and the default share a process and their windows interleave. Convolutions inside CUDA
# graphs: XLA leaves CONVOLUTION out of the command buffer's default set, so every cuDNN call
# splits the graph; cuDNN's fused convolution with its pointwise epilogue (experimental).
XLA_CANDIDATES = ("xla_gpu_enable_command_buffer=+CONVOLUTION",
                  "xla_gpu_experimental_enable_conv_fusion=true")
# the CPU twin's compiles (bench/gpu/lease.py --twin): XLA:CPU at -O0, a third of the time; it
# runs the code, its times mean nothing
TWIN_OPTIONS = dp.FAST_COMPILE
# XLA's default command buffer set in JAX 0.11.2's XLA, the lent GPUs' (read from a compile for
# an H100 in .venv-gpu, tests/test_gpu_lease.py): where a compile dumps no module config (XLA:CPU)
COMMAND_BUFFER_DEFAULT = ("CONDITIONAL", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL",
                          "DYNAMIC_SLICE_FUSION", "FUSION")


def command_buffer_set(dump_dir: str) -> tuple[str, ...] | None:
    """The command buffer types of a module config XLA dumped (``*config.pbtxt``, which a GPU
    compile writes under ``xla_dump_to``), in its order; None where there is none."""
    for path in sorted(glob.glob(os.path.join(dump_dir, "*config.pbtxt"))):
        with open(path) as f:
            return tuple(re.findall(r"^\s*xla_gpu_enable_command_buffer: (\w+)", f.read(), re.M))
    return None


def command_buffer_default() -> tuple[str, ...]:
    """This XLA's default command buffer set, read off a tiny compile's dumped module config;
    `COMMAND_BUFFER_DEFAULT` where the backend dumps none."""
    import jax

    with tempfile.TemporaryDirectory() as dump:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options={"xla_dump_to": dump})
        return command_buffer_set(dump) or COMMAND_BUFFER_DEFAULT


def xla_options(flag: str, default_set=COMMAND_BUFFER_DEFAULT) -> dict:
    """{option: value} for ``compiler_options`` of an XLA flag ("name=value", with or without
    XLA_FLAGS's "--"): "+T" (XLA_FLAGS's edit of the command buffer's default set) becomes the
    whole set, which compiler_options take."""
    name, value = flag.removeprefix("--").split("=", 1)
    if value.startswith("+"):
        value = ",".join([*default_set, *(v for v in value[1:].split(",+")
                                          if v not in default_set)])
    return {name: {"true": True, "false": False}.get(value, value)}


def xla_refuses(options: dict) -> str | None:
    """Why this XLA refuses ``options`` (an unknown option or value: its error's first line),
    from a tiny compile; None when it takes them."""
    import jax

    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=options)
    except Exception as e:  # XLA's INVALID_ARGUMENT, as JaxRuntimeError
        return str(e).strip().splitlines()[0][:300]
    return None


def ab_entries(net_name: str, names=None) -> list[tuple[str, dict, str | None]]:
    """(name, `Levers` fields, XLA flag or None) of each A/B for ``net_name``: every `LEVERS`
    entry that applies to it, or the ``names`` given (of `LEVERS` and `XLA_CANDIDATES`), in
    their order."""
    if names is None:
        return [(n, kw, None) for n, (kw, nets) in LEVERS.items() if net_name in nets]
    return [(n, {}, n) if n in XLA_CANDIDATES else (n, LEVERS[n][0], None) for n in names]


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
    base = TWIN_OPTIONS if args.cpu_twin else {}
    compiled, call_args, macs = build(net_name, args.batch, args.res, args.classes, base or None)
    compile_s = time.perf_counter() - t0
    times, call_args = time_steps(compiled, call_args, args.steps)
    step_s = statistics.median(times)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out = {"net": net_name, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "batch": args.batch, "res": args.res, "compile_s": compile_s,
           "step_ms": step_s * 1e3, "img_per_s": args.batch / step_s,
           "useful_mfu": 2 * macs["useful_macs"] / step_s / (args.peak_tflops * 1e12),
           "useful_gflop_per_image": 2 * macs["useful_macs"] / args.batch / 1e9,
           "gflop_per_image_with_dilated_zeros": 2 * macs["macs"] / args.batch / 1e9,
           "bandwidth_gb_s": float(cost.get("bytes accessed", 0.0)) / step_s / 1e9}
    if args.traced:
        trace = tempfile.mkdtemp(prefix="twinstep-trace-")
        state, xs, ts, key = call_args
        jax.profiler.start_trace(trace)
        for _ in range(args.traced):
            state, metrics = compiled(state, xs, ts, key)
        jax.block_until_ready((state, metrics))
        jax.profiler.stop_trace()
        call_args = (state, xs, ts, key)  # the traced steps donated the state before them
        out |= {**summarise(kernel_events(trace), args.traced, args.top),
                "trace_lines": trace_lines(trace)}
        if args.keep_trace:
            out["trace"] = trace
    if args.hlo:
        with gzip.open(args.out / f"hlo_{net_name}_{args.res}.txt.gz", "wt") as f:
            f.write(compiled.as_text())
    write(out)
    if args.ab or args.candidates:
        out["ab"], default_set = {}, None
        for name, kwargs, flag in ab_entries(net_name, args.candidates):
            options = None
            if flag:
                default_set = default_set or command_buffer_default()
                options = xla_options(flag, default_set)
                why = xla_refuses(options)
                if why:  # an option this XLA does not know: the next candidate runs
                    out["ab"][name] = {"options": options, "refused": why}
                    write(out)
                    continue
            try:
                out["ab"][name], call_args = lever_ab(net_name, args, compiled, call_args,
                                                      kwargs, {**base, **(options or {})})
            except Exception as e:  # a candidate that does not compile (or run) here
                out["ab"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            if options:
                out["ab"][name]["options"] = options
            write(out)
    return out


def lever_ab(net_name: str, args, compiled, call_args, kwargs, options=None) -> dict:
    """The step built with ``kwargs`` (and compiled with XLA ``options``) against ``compiled``
    (the default's), each timed in windows of --steps steps, interleaved, --rounds of each:
    (medians and each round's paired ratio, the default's arguments now: its steps donated
    those it was given)."""
    from bench.gpu.step import build, time_steps

    other, other_args, _ = build(net_name, args.batch, args.res, args.classes, options or None,
                                 **kwargs)
    times: dict = {"default": [], "lever": []}
    for _ in range(args.rounds):
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
             "speedup": default / lever,
             "paired": list(paired_ratio(times["default"], times["lever"])),
             "rounds": args.rounds}, call_args)


def print_profile(p: dict) -> None:
    print(f"{p['net']}: batch {p['batch']} at {p['res']}² on {p['device']}: "
          f"{p['img_per_s']:,.0f} img/s, {p['step_ms']:.1f} ms/step, useful MFU "
          f"{p['useful_mfu']:.1%}, {p['bandwidth_gb_s']:,.0f} GB/s"
          + (f"; kernels {p['kernel_ms_per_step']:.1f} ms/step" if "categories" in p else ""),
          flush=True)
    for name, c in p.get("categories", {}).items():
        print(f"  {name:22s} {c['ms_per_step']:9.2f} ms/step {c['share']:6.1%}", flush=True)
    for lever, r in p.get("ab", {}).items():
        if "speedup" in r:
            print(f"  A/B {lever}: {r['step_ms']:.1f} against {r['default_step_ms']:.1f} "
                  f"ms/step, speedup {r['speedup']:.3f}", flush=True)
        else:
            print(f"  A/B {lever}: {r.get('refused') or r.get('error')}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20,
                   help="timed steps, in 3 windows (an A/B's window: all of them)")
    p.add_argument("--traced", type=int, default=3, help="steps traced by the profiler (0: no "
                   "trace, no kernel summary)")
    p.add_argument("--top", type=int, default=40, help="kernels listed by time")
    p.add_argument("--limit", type=int, default=250, help="seconds each net may take")
    p.add_argument("--peak-tflops", type=float, default=989.4,
                   help="the device's dense bf16 peak, for MFU (default: H200's)")
    p.add_argument("--keep-trace", action="store_true", help="keep the profiler's trace")
    p.add_argument("--hlo", action="store_true", help="also write the optimized HLO, gzipped")
    p.add_argument("--ab", action="store_true",
                   help=f"also time each lever against the default ({', '.join(LEVERS)})")
    p.add_argument("--candidates", nargs="+", choices=[*LEVERS, *XLA_CANDIDATES],
                   metavar="NAME", help="time these against the default instead, in this "
                   f"order: of --ab's and the XLA options {', '.join(XLA_CANDIDATES)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each A/B")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "profile")
    p.add_argument("--cpu-twin", action="store_true", help=argparse.SUPPRESS)  # lease.py --twin
    p.add_argument("--one", help=argparse.SUPPRESS)  # the net this process profiles
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds: at least 2, for the paired ratios' quartiles")
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
