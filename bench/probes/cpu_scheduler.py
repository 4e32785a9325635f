"""Probe for the XLA:CPU instruction order twinstep asks for (a memory-minimising scheduler):
`twinstep.processes.settings.OWN_XLA_FLAGS` against XLA's concurrency-optimised default, on the
programs of two bf16 ties at R replicas of N (the tie's own `single_program` and
`replica_program`, float64 around the bf16 convolutions):

- MobileNetV4 with a GPU's levers (`--gpu-levers`: its depthwise convolutions grouped, which
  XLA:CPU expands to dense C x C kernels in float64), compiled at -O0 as its ties are;
- ResNet-50 on this machine's levers, at the default optimisation.

Each variant in a fresh process per round (XLA reads its flags once, as it starts), rounds
interleaved: per program, XLA's temporaries per device (its memory analysis; R devices hold R
times that), the process's peak RSS, and the time of the program's first run.

    python bench/probes/cpu_scheduler.py [--replicas 2] [--batch 1] [--res 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from twinstep.ops.levers import Levers  # imports JAX, starts no backend

FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
# variant: XLA_FLAGS for its process ("" leaves the flag to twinstep)
VARIANTS = {"concurrency-optimised (XLA's default)": f"--{FLAG}=true",
            "memory-minimising (twinstep's)": ""}
# (net, the tie's settings beyond R, N and the resolution)
PROGRAMS = (("mnv4", {"precision": "bf16", "levers": Levers.of("gpu"), "fast_compile": True}),
            ("resnet50", {"precision": "bf16"}))


def _measure(args) -> dict:
    """Every program of PROGRAMS in this process: {net: {side: temp MiB, run s}, peak MiB}."""
    import jax

    from twinstep import dp

    dp.ensure_devices(args.replicas)  # twinstep's flags, unless XLA_FLAGS names them
    jax.config.update("jax_enable_x64", True)
    from twinstep.checking import inputs, tie
    from twinstep.nets import get_net

    out = {"xla_flags": os.environ.get("XLA_FLAGS", "")}
    for name, settings in PROGRAMS:
        cfg = tie.TieConfig(net=name, replicas=args.replicas, batch=args.batch, res=args.res,
                            **settings)
        net, prec = get_net(name), inputs.tie_precision(cfg.precision)
        params, buffers, x, t = inputs.setup(cfg, net)
        for side, build in (("single", tie.single_program), ("replica", tie.replica_program)):
            compiled = build(net, cfg, prec).lower(params, buffers, x, t).compile()
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, buffers, x, t))
            out[f"{name} {side}"] = {
                "temp_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
                "run_s": time.perf_counter() - t0}
    out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return out


def main() -> None:
    from bench.common import PROBE_RESULTS, probe_decision, write_results

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="rows per replica")
    p.add_argument("--res", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(_measure(args)))
        return
    found = {v: [] for v in VARIANTS}
    for n in range(args.rounds):
        for v, flags in VARIANTS.items():
            env = {k: x for k, x in os.environ.items() if k != "XLA_FLAGS"}
            done = subprocess.run(
                [sys.executable, __file__, "--variant", v, "--replicas", str(args.replicas),
                 "--batch", str(args.batch), "--res", str(args.res)],
                env={**env, **({"XLA_FLAGS": flags} if flags else {})},
                capture_output=True, text=True, check=True)
            found[v].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {n + 1} {v}: {found[v][-1]}", file=sys.stderr, flush=True)

    def med(v, key, field=None):
        return statistics.median(f[key][field] if field else f[key] for f in found[v])

    rows = ["| program | scheduler | temporaries per device MiB | run s |", "|---|---|---:|---:|"]
    for name, _ in PROGRAMS:
        for side in ("single", "replica"):
            for v in VARIANTS:
                rows.append(f"| {name} {side} | {v} | {med(v, f'{name} {side}', 'temp_mib'):.0f}"
                            f" | {med(v, f'{name} {side}', 'run_s'):.2f} |")
    rows += ["", "| scheduler | the process's peak MiB |", "|---|---:|"]
    rows += [f"| {v} | {med(v, 'peak_mib'):.0f} |" for v in VARIANTS]
    xla, ours = VARIANTS
    ratio = med(xla, "mnv4 replica", "temp_mib") / med(ours, "mnv4 replica", "temp_mib")
    notes = (f"Medians of {args.rounds} interleaved rounds, each variant in a fresh process. "
             f"MobileNetV4's replica program holds {ratio:.1f}x the temporaries in XLA's "
             "default order; each of R devices holds its own.")
    write_results(PROBE_RESULTS, "cpu_scheduler", probe_decision(__doc__) + "\n\n"
                  f"The programs of `twinstep tie NET --precision bf16` at R = {args.replicas}, "
                  f"N = {args.batch}, {args.res}²: MobileNetV4 with `--gpu-levers "
                  "--fast-compile`, ResNet-50 on this machine's levers.",
                  "python bench/probes/cpu_scheduler.py " + " ".join(sys.argv[1:]),
                  "\n".join(rows), notes)


if __name__ == "__main__":
    main()
