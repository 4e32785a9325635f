"""Probe for the hand-written backward chain instead of jax.grad (twinstep/step.py, ops/):
one training step (forward + backward to every parameter gradient, f32, CPU) of the explicit
chain against two peers timed in the same run: ``jax.grad`` of the same forward, and timm's
model with torch autograd. Medians of interleaved runs; the ratios rewrite the section "step"
of bench/probes/RESULTS.md.

    python bench/probes/step.py [--nets resnet50 mnv4] [--res 32 64] [--batch 8] [--runs 7]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from bench.common import (
    PROBE_RESULTS,
    block,
    interleaved_medians,
    probe_decision,
    write_results,
)
from twinstep import program
from twinstep.checking import parity
from twinstep.nets import NETS, init, layers
from twinstep.ops import loss
from twinstep.ops.levers import Levers

K = 10


def peers(net, res, batch, depthwise_path=None):
    shapes = net.param_shapes(K)
    params = init.init_params(jax.random.key(0), shapes, linear=net.LINEAR_INIT)
    buffers = init.init_buffers(shapes)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, res, res, 3)).astype(np.float32)
    labels = rng.integers(0, K, batch)
    t = jnp.asarray(np.eye(K, dtype=np.float32)[labels])
    xj = jnp.asarray(x)
    ctx = layers.Ctx(levers=Levers(depthwise_path=depthwise_path).on())
    # twinstep's step at one device: forward, loss, the explicit backward chain (+ the running
    # statistics' update and the loss value, which the peers skip)
    setup = program.Setup(levers=Levers(depthwise_path=depthwise_path))
    explicit = program.grad_program(net, setup, loss="ce")

    @jax.jit
    def autodiff(p):
        return jax.grad(lambda p: loss.smoothed_ce(net.forward(p, buffers, xj, ctx)[0], t)[0])(p)

    model = parity.to_timm(net, params, buffers, K, "float32").train()
    crit = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    tx, tl = torch.tensor(x.transpose(0, 3, 1, 2)), torch.tensor(labels)

    def torch_step():
        model.zero_grad(set_to_none=True)
        crit(model(tx), tl).backward()

    fns = {"explicit chain": lambda: block(explicit(params, buffers, xj, t).grads),
           "jax.grad": lambda: block(autodiff(params)),
           "timm + torch autograd": torch_step}
    if net.NAME == "mnv4":
        # The same chain with feature_group_count depthwise convs: the path XLA:CPU runs slowly
        # (docs/platform.md).
        grouped = program.grad_program(net, program.Setup(levers=Levers(depthwise_path="grouped")),
                                       loss="ce")
        fns["explicit chain, grouped depthwise"] = lambda: block(
            grouped(params, buffers, xj, t).grads)
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=sorted(NETS), choices=sorted(NETS))
    ap.add_argument("--res", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name in args.nets:
        for res in args.res:
            med = interleaved_medians(peers(NETS[name], res, args.batch), runs=args.runs)
            e = med["explicit chain"]
            rows.append(f"| {name} | {res}² | {e * 1e3:.0f} | {med['jax.grad'] * 1e3:.0f} | "
                        f"{med['timm + torch autograd'] * 1e3:.0f} | "
                        f"{e / med['jax.grad']:.2f} | {e / med['timm + torch autograd']:.2f} | "
                        + (f"{med['explicit chain, grouped depthwise'] / e:.2f} |"
                           if "explicit chain, grouped depthwise" in med else "— |"))
            print(rows[-1], flush=True)
    table = ("| net | res | explicit ms | jax.grad ms | timm+torch ms | explicit / jax.grad | "
             "explicit / torch | grouped-depthwise chain / explicit |\n"
             "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    write_results(PROBE_RESULTS, "step", probe_decision(__doc__) + "\n\nThe train step "
                  f"(forward + backward), f32, batch {args.batch}.",
                  "python bench/probes/step.py " + " ".join(sys.argv[1:]), table)


if __name__ == "__main__":
    main()
