"""Probe for keeping OIHW kernels untransposed inside the step (_windows, twinstep/ops/conv.py):
where twinstep's train step spends the time the Flax peer's does not, one device (no
collective), f32, timed in one run: the whole train step of each (forward, loss, backward,
AdamW), each one's gradient step alone, and optax's AdamW alone on the same parameters. The
differences split a train-step ratio into its gradient part and the rest: the rest was AdamW
reading every kernel's gradient through a transpose to timm's OIHW, which the matmul path's
windows, taken in the OIHW kernel's own order, no longer need (bench/history/2026-12-03.md).

    python bench/probes/step_parts.py [--net resnet50] [--res 64] [--batch 8] [--runs 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.common import (
    PROBE_RESULTS,
    block,
    interleaved_medians,
    probe_decision,
    write_results,
)
from twinstep import dp, optim, program, recipes, step
from twinstep.nets import get_net, init

CLASSES = 1000


def _stepper(compiled, state, *args):
    """A callable running ``compiled`` on its own (donated) state, one step to completion."""
    box = {"state": state}

    def run():
        box["state"], out = compiled(box["state"], *args)
        block((box["state"], out))

    return run


def parts(name: str, res: int, batch: int) -> dict:
    # the [bench] extra's Flax: imported here, so that --help needs none
    from bench import flax_peer

    net = get_net(name)
    shapes = net.param_shapes(CLASSES)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(),
                                linear=net.LINEAR_INIT)
    buffers = init.init_buffers(shapes)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, res, res, 3)), jnp.float32)
    t = jax.nn.one_hot(jnp.asarray(rng.integers(0, CLASSES, batch)), CLASSES)
    recipe = dataclasses.replace(recipes.parse(f"{name}in_adamdp"), batch=batch)
    opt = optax.adamw(optim.recipe_schedule(recipe), *optim.BETAS, eps=optim.EPS["adamw"],
                      weight_decay=recipe.effective_weight_decay)
    fns = {}
    made = program.train_program(net, recipe, classes=CLASSES, donate=True)
    args = (x[None], t[None], jax.random.key(1))
    state = made.init(*jax.tree.map(jnp.copy, (params, buffers)))
    fns["twinstep train step"] = _stepper(made.step.lower(state, *args).compile(), state, *args)
    ctx = program.Setup().context()
    grad = jax.jit(lambda p, b, x, t: step.grad_step(net, p, b, x, t, ctx=ctx).grads)
    grad = grad.lower(params, buffers, x, t).compile()
    fns["twinstep gradient step"] = lambda: block(grad(params, buffers, x, t))
    model = flax_peer.from_twinstep(name, params, buffers, CLASSES, None)
    fstep, fstate = flax_peer.train_step_fn(name, model, opt, 1, dp.AXIS)
    fns["flax train step"] = _stepper(fstep.lower(fstate, x, t).compile(), fstate, x, t)
    fgrad, gstate = flax_peer.grad_fn(name, flax_peer.from_twinstep(
        name, params, buffers, CLASSES, None), 1, dp.AXIS)
    fgrad = fgrad.lower(gstate, x, t).compile()
    fns["flax gradient step"] = lambda: block(fgrad(gstate, x, t))

    def adamw(state, grads):
        updates, opt_state = opt.update(grads, state[1], state[0])
        return (optax.apply_updates(state[0], updates), opt_state), None

    grads = jax.tree.map(jnp.copy, params)
    ostate = (jax.tree.map(jnp.copy, params), opt.init(params))
    adamw = jax.jit(adamw, donate_argnums=0).lower(ostate, grads).compile()
    fns["optax AdamW alone"] = _stepper(adamw, ostate, grads)
    return fns


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--net", default="resnet50")
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    med = interleaved_medians(parts(args.net, args.res, args.batch), runs=args.runs)
    ref = med["flax train step"]
    rows = [f"| {k} | {v * 1e3:.0f} | {v / ref:.2f} |" for k, v in med.items()]
    write_results(
        PROBE_RESULTS, "step_parts", probe_decision(__doc__) + "\n\nThe train step in parts, "
        f"{args.net} {args.res}², one device, N = {args.batch}, f32.",
        "python " + " ".join(sys.argv),
        "| program | median ms | / flax train step |\n|---|---|---|\n" + "\n".join(rows),
        f"Medians of {args.runs} interleaved runs.")


if __name__ == "__main__":
    main()
