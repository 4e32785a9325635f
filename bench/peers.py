"""The whole data-parallel train step (forward, loss, backward, gradient all-reduce, AdamW) of
twinstep against its two peers, timed in the same run:

  twinstep   the recipe ``<net>in_adamdp<N>`` on R virtual CPU devices (its explicit backward)
  flax       the natural JAX peer (bench/flax_peer.py): Flax NNX with nnx.BatchNorm(axis_name)
             under shard_map, jax.grad, one pmean per gradient tensor, optax.adamw — for
             ResNet-50 and MobileNetV4-Conv-M only (`flax_peer.NETS`); the other nets' rows
             compare twinstep with torch alone
  torch      timm's model with torch autograd and torch.optim.AdamW, the global batch R N in
             one process (torch's own threads)

All three start from the same parameters and data, run AdamW at the recipe's schedule and
weight decay, and see the same global batch. Reported: step-time medians of interleaved runs, the
median of each round's ratio to twinstep (with its interquartile range), compile time (lower +
compile), and memory: XLA's planned bytes of the compiled program (arguments + outputs +
temporaries) for the JAX peers; for torch the peak resident-set growth in a fresh process over
building the model and two steps. Each replica count runs in a process of its own with exactly
R virtual devices. Rewrites the section "Peers" of bench/RESULTS.md and draws bench/peers.png.

    python bench/peers.py [--nets resnet50 mnv4 ...] [--res 64 128] [--replicas 2 4]
                          [--mnv4-res 64] [--mnv4-replicas 2] [--other-res 64]
                          [--other-replicas 2] [--global-batch 8] [--runs 5] [--xla-flags ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from twinstep.nets import NETS, init  # starts no JAX backend: XLA_FLAGS below still apply


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=list(NETS), choices=list(NETS))
    ap.add_argument("--res", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--mnv4-res", type=int, nargs="+", default=[64],
                    help="MobileNetV4's resolutions: the Flax peer's grouped depthwise "
                         "convolutions take minutes a step on XLA:CPU at 128²")
    ap.add_argument("--mnv4-replicas", type=int, nargs="+", default=[2])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--other-res", type=int, nargs="+", default=[64],
                    help="the resolutions of the nets without a Flax peer")
    ap.add_argument("--other-replicas", type=int, nargs="+", default=[2])
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for every JAX program")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--rows-to", help=argparse.SUPPRESS)  # one replica count's rows, as JSON
    return ap.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.xla_flags:  # before JAX starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + ARGS.xla_flags).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import torch  # noqa: E402

from bench import flax_peer  # noqa: E402
from bench.common import (  # noqa: E402
    RESULTS,
    block,
    interleaved_times,
    paired_ratio,
    write_results,
)
from twinstep import dp, optim, program, recipes  # noqa: E402
from twinstep.checking import parity  # noqa: E402
from twinstep.nets import get_net  # noqa: E402

PEERS = ("twinstep", "flax", "torch")


def _compiled(jitted, *args):
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    planned = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return compiled, seconds, planned


_TORCH_PEAK = """
import sys, timm, torch


def status(key):  # kB; VmHWM is this process's own peak (ru_maxrss carries the parent's over fork)
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024


name, res, batch, classes = sys.argv[1], *map(int, sys.argv[2:])
x, y = torch.randn(batch, 3, res, res), torch.randint(0, classes, (batch,))
base = status("VmRSS:")
model = timm.create_model(name, num_classes=classes).train()
opt = torch.optim.AdamW(model.parameters())
crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
for _ in range(2):
    opt.zero_grad(set_to_none=True)
    crit(model(x), y).backward()
    opt.step()
print(status("VmHWM:") - base)
"""


def _torch_peak(timm_name: str, res: int, batch: int, classes: int) -> int:
    """Peak resident-set growth in a fresh process from before the model is built to after two
    steps: weights, gradients, AdamW's state, activations. (torch's CPU allocator keeps what it
    freed, so growth in this process after other peers ran would read near zero.)"""
    out = subprocess.run([sys.executable, "-c", _TORCH_PEAK, timm_name, str(res), str(batch),
                          str(classes)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


class Runner:
    """One peer's step, closed over its own state; ``__call__`` runs one step to completion."""

    def __init__(self, step, state, *inputs):
        self.step, self.state, self.inputs = step, state, inputs

    def __call__(self):
        self.state, metrics = self.step(self.state, *self.inputs)
        block(metrics)


def peers(name: str, res: int, replicas: int, global_batch: int, classes: int) -> dict:
    """{peer: (runner, compile s, memory bytes)} at R replicas of N = global_batch / R."""
    net = get_net(name)
    n = global_batch // replicas
    recipe = dataclasses.replace(recipes.parse(f"{name}in_adamdp"), batch=n)
    shapes = net.param_shapes(classes)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(),
                                linear=net.LINEAR_INIT)
    buffers = init.init_buffers(shapes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((global_batch, res, res, 3)).astype(np.float32)
    labels = rng.integers(0, classes, global_batch)
    t = np.eye(classes, dtype=np.float32)[labels]
    out = {}

    made = program.train_program(net, recipe, program.Setup(replicas=replicas, precision="f32"),
                                 classes=classes, donate=True)
    # a copy: the step donates its state, which must not free the arrays the peers start from
    state = made.place(made.init(*jax.tree.map(jnp.copy, (params, buffers))))
    args = (jnp.asarray(x[None]), jnp.asarray(t[None]), jax.random.key(1))
    compiled, seconds, planned = _compiled(made.step, state, *args)
    out["twinstep"] = (Runner(compiled, state, *args), seconds, planned)

    if name in flax_peer.NETS:
        # the peer's own AdamW (optax's, no mask: the recipe decays every tensor) at the
        # schedule
        opt = optax.adamw(optim.recipe_schedule(recipe), *optim.BETAS, eps=optim.EPS["adamw"],
                          weight_decay=recipe.effective_weight_decay)
        model = flax_peer.from_twinstep(name, params, buffers, classes, dp.AXIS if replicas > 1
                                        else None)
        step, fstate = flax_peer.train_step_fn(name, model, opt, replicas, dp.AXIS)
        fargs = (jnp.asarray(x), jnp.asarray(t))
        compiled, seconds, planned = _compiled(step, fstate, *fargs)
        out["flax"] = (Runner(compiled, fstate, *fargs), seconds, planned)

    tmodel = parity.to_timm(net, params, buffers, classes, "float32").train()
    topt = torch.optim.AdamW(tmodel.parameters(), lr=float(recipe.lr), betas=optim.BETAS,
                             eps=optim.EPS["adamw"], weight_decay=recipe.effective_weight_decay)
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    tx, tl = torch.tensor(x.transpose(0, 3, 1, 2)), torch.tensor(labels)

    def torch_step():
        topt.zero_grad(set_to_none=True)
        crit(tmodel(tx), tl).backward()
        topt.step()

    out["torch"] = (torch_step, 0.0, _torch_peak(net.TIMM_NAME, res, global_batch, classes))
    return out


def _png(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['net']} {r['res']}² R={r['replicas']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    y = np.arange(len(rows))
    for i, peer in enumerate(("flax", "torch")):
        ax.barh(y + 0.2 * (2 * i - 1), [r["ratios"].get(peer, (np.nan,))[0] for r in rows],
                height=0.4, label=f"{peer} time / twinstep time")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, labels)
    ax.set_xlabel("step-time ratio (> 1: twinstep is faster)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _row(row: dict, n: int, made: dict) -> str:
    """A table row: the medians, the paired ratios [interquartile range], compile seconds and
    MiB."""
    mib = {p: f"{made[p][2] / 2**20:.0f}" if p in made else "–" for p in PEERS}
    ratio = {p: "**{:.2f}** [{:.2f}, {:.2f}]".format(*row["ratios"][p]) if p in row["ratios"]
             else "–" for p in PEERS}
    ms = {p: f"{row[p] * 1e3:.0f}" if p in row else "–" for p in PEERS}
    flax_compile = f"{made['flax'][1]:.0f}" if "flax" in made else "–"
    return (f"| {row['net']} | {row['res']}² | {row['replicas']} × {n} | {ms['twinstep']} | "
            f"{ms['flax']} | {ms['torch']} | {ratio['flax']} | {ratio['torch']} | "
            f"{made['twinstep'][1]:.0f} / {flax_compile} | "
            f"{mib['twinstep']} / {mib['flax']} / {mib['torch']} |")


def _measure(args, configs) -> tuple[list, list]:
    """(rows, table lines) of the configs, all at one replica count, in this process."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows, lines = [], []
    for name, res, r in configs:
        made = peers(name, res, r, args.global_batch, args.classes)
        times = interleaved_times({p: made[p][0] for p in PEERS if p in made}, runs=args.runs)
        med = {p: statistics.median(ts) for p, ts in times.items()}
        ratios = {p: paired_ratio(times[p], times["twinstep"]) for p in ("flax", "torch")
                  if p in times}
        rows.append({"net": name, "res": res, "replicas": r, **med, "ratios": ratios})
        lines.append(_row(rows[-1], args.global_batch // r, made))
        print(lines[-1], flush=True)
        del made
    return rows, lines


def _in_process_per_count(args, configs) -> tuple[list, list]:
    """Each replica count's configs in a process of its own, with exactly R virtual devices:
    every device more than a program uses slows it (docs/platform.md)."""
    rows, lines = [], []
    for r in dict.fromkeys(c[2] for c in configs):
        nets = list(dict.fromkeys(c[0] for c in configs if c[2] == r))
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rows.json"
            subprocess.run([sys.executable, __file__, "--nets", *nets, "--replicas", str(r),
                            "--mnv4-replicas", str(r), "--other-replicas", str(r),
                            "--res", *map(str, args.res), "--mnv4-res", *map(str, args.mnv4_res),
                            "--other-res", *map(str, args.other_res), "--global-batch",
                            str(args.global_batch), "--runs", str(args.runs), "--classes",
                            str(args.classes), "--rows-to", str(out)], check=True)
            got = json.loads(out.read_text())
        rows += got["rows"]
        lines += got["lines"]
    return rows, lines


def main(args) -> None:
    def grid(name):  # (resolutions, replica counts) of a net's rows
        if name not in flax_peer.NETS:
            return args.other_res, args.other_replicas
        return ((args.mnv4_res, args.mnv4_replicas) if name == "mnv4"
                else (args.res, args.replicas))

    configs = [(name, res, r) for name in args.nets for res in grid(name)[0]
               for r in grid(name)[1]]
    if args.rows_to:  # a child of `_in_process_per_count`: one replica count
        dp.ensure_devices(configs[0][2])
        rows, lines = _measure(args, configs)
        Path(args.rows_to).write_text(json.dumps({"rows": rows, "lines": lines}))
        return
    rows, lines = _in_process_per_count(args, configs)
    table = ("| net | res | R × N | twinstep ms | flax ms | torch ms | flax / twinstep | "
             "torch / twinstep | compile s (twinstep / flax) | MiB (twinstep / flax / torch) |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines))
    flags = os.environ.get("XLA_FLAGS", "")
    write_results(
        RESULTS, "Peers", f"The whole DP train step, three peers, f32, global batch "
        f"{args.global_batch}" + (f", XLA_FLAGS={flags}" if flags else "") + ".",
        "python " + " ".join(sys.argv), table,
        f"Medians of {args.runs} interleaved runs; a ratio is the median of the rounds' paired "
        "ratios (a round runs each peer once) [their interquartile range]; above 1 means "
        "twinstep is faster. "
        "Each replica count ran in a process of its own with exactly R virtual devices. "
        "Memory: XLA's planned bytes (arguments + outputs + temporaries) of the compiled "
        "program for the JAX peers; for torch the peak resident-set growth in a fresh process "
        "over building the model and two steps (weights, gradients, AdamW's state, "
        "activations). torch compiles nothing.")
    if not args.no_png:
        _png(rows, RESULTS.with_name("peers.png"))


if __name__ == "__main__":
    main(ARGS)
