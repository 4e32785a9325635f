"""The bf16 tie across R x N for both nets (and 64² at R = 2), with the subtle controls: every
tie must hold (no false alarm) and every control must fail. Not a speed benchmark: the table is
the evidence behind docs/tie.md#bf16 and rewrites the section "bf16 tie sweep" of
bench/RESULTS.md. Each R runs in its own process (exactly R virtual devices); `make test-all`
holds the same matrix (tests/test_tie.py::test_bf16_sweep, ::test_bf16_controls_fail).

  worst conv   the largest ratio, over the conv weight gradients, of the error's norm to the
               bf16 bound's norm (docs/tie.md#bf16): near 1 the programs differ by the
               partial-sum boundary itself, as they must

The levers take `twinstep tie`'s flags (`twinstep.cli.options.levers`, one per field of
`twinstep.ops.levers.Levers`): with --gpu-levers both programs are built as a GPU's (cuDNN's
conv paths, symmetric padding, one-pass BN moments) and the table goes to "bf16 tie sweep, a
GPU's levers"; a lever's flag ties one candidate with it, the section named as the lever says
it (--store bf16: ", stored in bf16"; --depthwise-path phased: ", phased depthwise";
--relu-mask bits: ", ReLU masks as bits").

    python bench/bf16_sweep.py [--replicas 2 4 8] [--batches 1 2 3] [--gpu-levers]
                               [--store bf16] [--depthwise-path PATH] [--relu-mask bits] ...
                               [--nets resnet50 mnv4] [--skip NET@R ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.common import RESULTS, write_results

NETS = ("resnet50", "mnv4")
CONTROLS = ("divisor-plus-one", "unsynced")


def _one_r(replicas: int, cases: list, levers) -> list:
    """Run ``cases`` [(net, N, res, control)] at R = ``replicas`` in this process, with
    ``levers`` (`twinstep.ops.levers.Levers`)."""
    import jax

    jax.config.update("jax_num_cpu_devices", replicas)
    import twinstep

    rows = []
    for net, batch, res, control in cases:
        r = twinstep.tie(net, replicas=replicas, batch=batch, res=res, precision="bf16",
                         control=control, fast_compile=net == "mnv4", levers=levers)
        convs = [p for p in r.parameters if len(p["shape"]) == 4]
        rows.append({"net": net, "R": replicas, "N": batch, "res": res, "control": control,
                     "status": r.status, "ok": sum(p["ok"] for p in r.parameters),
                     "tensors": len(r.parameters),
                     "worst": max(p["rel_err"] / p["bound"] for p in convs)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 3])
    from twinstep.cli import options  # imports jax, starts no backend

    options.levers(p, "both programs")
    p.add_argument("--nets", nargs="+", choices=NETS, default=list(NETS))
    p.add_argument("--skip", nargs="+", default=[], metavar="NET@R",
                   help="leave NET's ties at R replicas out, listed as skipped")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one R
    args = p.parse_args()
    given = {k: v for k, v in vars(args).items() if v is not None}
    levers = options.chosen_levers(given)

    def cases(replicas: int) -> list:
        out = [(net, n, 32, "none") for net in args.nets for n in args.batches]
        if replicas == 2:
            out += [(net, 2, 64, "none") for net in args.nets]
            out += [(net, 2, 32, c) for net in args.nets for c in CONTROLS]
        return out

    if args.one is not None:
        _one_r(args.one, [c for c in cases(args.one) if f"{c[0]}@{args.one}" not in args.skip],
               levers)
        return
    rows = []
    for replicas in args.replicas:
        # a child that dies (out of memory) keeps the rows it printed; the rest are not run
        out = subprocess.run([sys.executable, __file__, "--one", str(replicas),
                              *sys.argv[1:]], capture_output=True, text=True)
        done = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        rows += done
        ran = {(r["net"], r["N"], r["res"], r["control"]) for r in done}
        why = "skipped" if out.returncode == 0 else f"not run: exit {out.returncode}"
        rows += [{"net": net, "R": replicas, "N": n, "res": res, "control": control,
                  "status": why} for net, n, res, control in cases(replicas)
                 if (net, n, res, control) not in ran]
    lines = ["| net | R | N | res | control | verdict | tensors within | worst conv |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['net']} | {r['R']} | {r['N']} | {r['res']}² | {r['control']} | "
                     + (f"**{r['status']}** | {r['ok']}/{r['tensors']} | {r['worst']:.2f} |"
                        if "ok" in r else f"{r['status']} | | |"))
    ties = [r for r in rows if r["control"] == "none"]
    controls = [r for r in rows if r["control"] != "none"]
    flags = " --gpu-levers" * bool(args.gpu_levers) + "".join(
        f" --{'no-' * (v is False)}{k.replace('_', '-')}{'' if v in (True, False) else f' {v}'}"
        for k, v in levers.given().items() if getattr(args, k) is not None)
    write_results(RESULTS, "bf16 tie sweep" + "".join(f", {d}" for d in [levers.describe()] if d),
                  f"`twinstep tie NET --precision bf16{flags}` "
                  f"(random-bn state, seed 0, K = 10) for {' and '.join(args.nets)} across R "
                  f"and N, and the subtle controls at R = 2, N = 2.",
                  "python bench/bf16_sweep.py " + " ".join(sys.argv[1:]), "\n".join(lines),
                  f"{sum(r['status'] == 'tied' for r in ties if 'ok' in r)} of "
                  f"{sum('ok' in r for r in ties)} ties run hold"
                  + (f" ({sum('ok' not in r for r in rows)} not run)"
                     if any('ok' not in r for r in rows) else "") + "; "
                  f"{sum(r['status'] == 'NOT tied' for r in controls)} of "
                  f"{sum('ok' in r for r in controls)} "
                  f"controls fail. worst conv: the largest ratio of a conv weight gradient's "
                  f"error norm to its bf16 bound's norm.")


if __name__ == "__main__":
    main()
