"""Probe for dense convolutions in XLA:CPU's canonical NHWC / HWIO form (twinstep/ops/conv.py):
the accumulation scan's body against the same gradient step outside any loop, single device,
f32, timed in one run: ``accumulate`` at k = 1 and k = 2 (the train step's micro-steps, inside a
``lax.scan``) vs ``grad_step`` (the entry computation). XLA:CPU canonicalizes convolution
layouts in the entry computation but not in a while loop's body; a ratio near 1 per micro-step
says the body runs as fast as the step outside it.

    python bench/probes/scan_body.py [--nets resnet50 mnv4] [--res 64] [--batch 4] [--runs 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    PROBE_RESULTS,
    block,
    interleaved_medians,
    probe_decision,
    write_results,
)
from twinstep import program, recipes, step
from twinstep.nets import get_net, init

CLASSES = 1000


def programs(name: str, res: int, batch: int) -> dict:
    net = get_net(name)
    shapes = net.param_shapes(CLASSES)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(),
                                linear=net.LINEAR_INIT)
    buffers = init.init_buffers(shapes)
    rng = np.random.default_rng(0)
    key = jax.random.key(1)
    ctx = program.Setup().context()
    xs = jnp.asarray(rng.standard_normal((2, batch, res, res, 3)), jnp.float32)
    ts = jax.nn.one_hot(jnp.asarray(rng.integers(0, CLASSES, (2, batch))), CLASSES)
    fns = {}
    grad = jax.jit(lambda p, b, x, t: step.grad_step(net, p, b, x, t, ctx=ctx).grads)
    grad = grad.lower(params, buffers, xs[0], ts[0]).compile()
    fns["grad_step"] = lambda: block(grad(params, buffers, xs[0], ts[0]))
    for k in (1, 2):
        named = f"{name}in_accdp{k}x" if k > 1 else f"{name}in_adamdp"
        recipe = dataclasses.replace(recipes.parse(named), batch=batch)
        acc = jax.jit(lambda p, b, x, t, recipe=recipe: step.accumulate(
            net, p, b, x, t, recipe=recipe, key=key, ctx=ctx)[0])
        acc = acc.lower(params, buffers, xs[:k], ts[:k]).compile()
        fns[f"accumulate k={k}"] = lambda acc=acc, k=k: block(acc(params, buffers, xs[:k],
                                                                   ts[:k]))
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"])
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    lines = []
    for name in args.nets:
        med = interleaved_medians(programs(name, args.res, args.batch), runs=args.runs)
        g = med["grad_step"]
        lines.append(f"| {name} | {g * 1e3:.0f} | {med['accumulate k=1'] * 1e3:.0f} | "
                     f"{med['accumulate k=2'] * 1e3:.0f} | **{med['accumulate k=1'] / g:.2f}** | "
                     f"**{med['accumulate k=2'] / (2 * g):.2f}** |")
        print(lines[-1], flush=True)
    write_results(
        PROBE_RESULTS, "scan_body", probe_decision(__doc__) + "\n\nThe accumulation scan's "
        f"body against the step outside it, one device, {args.res}², N = {args.batch}, f32.",
        "python " + " ".join(sys.argv),
        "| net | grad_step ms | accumulate k=1 ms | k=2 ms | k=1 / grad_step | "
        "k=2 / (2 grad_step) |\n|---|---|---|---|---|---|\n" + "\n".join(lines),
        f"Medians of {args.runs} interleaved runs.")


if __name__ == "__main__":
    main()
