"""Probe for grouped depthwise convolutions in IREE renders (twinstep/rendering/render.py):
one recipe, two compilers (issue 17): the R = 1 render of a recipe's whole train step compiled
by XLA:CPU (jax.jit of the export, as 'render' writes it) and by IREE's llvm-cpu backend (the
StableHLO 'render --target iree' compiles, with its flags), run on the same inputs, each with
its inputs already on its device. Compile seconds of each, and the step's median over
interleaved runs; the two steps' losses side by side. The two StableHLO texts are one program
for ResNet-50; for MNv4 they differ in the depthwise convolutions' form (shifted multiply-adds
for XLA:CPU, grouped convolutions for IREE), and each compiler also runs the other's form.

    python bench/probes/iree_step.py [--recipe resnet50in_adamdp8] [--res 64] [--runs 5]
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from bench.common import (
    PROBE_RESULTS,
    block,
    interleaved_medians,
    probe_decision,
    write_results,
)
from twinstep import program, recipes
from twinstep.checking import inputs as tie_inputs
from twinstep.nets import get_net, init
from twinstep.ops.precision import get_precision
from twinstep.rendering import iree, render

CLASSES = 1000


def inputs(recipe, res: int, precision: str = "f32") -> list:
    """The flat inputs of the render: a fresh train state, one batch, a key."""
    net = get_net(recipe.net)
    shapes = net.param_shapes(CLASSES)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(),
                                linear=net.LINEAR_INIT)
    made = program.train_program(net, recipe, program.Setup(precision=precision),
                                 classes=CLASSES)
    state = made.init(params, init.init_buffers(shapes))
    xs, ts = tie_inputs.batch(np.random.default_rng(0), (recipe.accum, recipe.batch), res=res,
                              classes=CLASSES, replicas=1, shift=False,
                              dtype=get_precision(precision).dtype)
    return [*jax.tree.leaves(state), xs, ts, jax.random.key_data(jax.random.key(1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="resnet50in_adamdp8")
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    import iree.runtime as rt

    exports = {t: render.export_step(render.RenderConfig(
        args.recipe, 1, res=args.res, classes=CLASSES, precision="f32", target=t)).exported
        for t in render.TARGETS}
    flat = inputs(recipes.parse(args.recipe), args.res)
    assert [(a.shape, a.dtype) for a in flat] == [(a.shape, a.dtype)
                                                  for a in exports["xla"].in_avals]
    same = exports["xla"].mlir_module() == exports["iree"].mlir_module()
    compile_s, fns, losses = {}, {}, {}
    for label, e in [("XLA:CPU", exports["xla"])] + (
            [] if same else [("XLA:CPU, IREE's form", exports["iree"])]):
        t0 = time.perf_counter()
        compiled = jax.jit(e.call).lower(*flat).compile()
        compile_s[label] = time.perf_counter() - t0
        fns[label] = lambda c=compiled: block(c(*flat))
        losses[label] = float(compiled(*flat)[-2])
    config = rt.Config(iree.DRIVER)
    for label, e in [("IREE llvm-cpu", exports["iree"])] + (
            [] if same else [("IREE llvm-cpu, XLA's form", exports["xla"])]):
        t0 = time.perf_counter()
        vmfb = iree.compile_mlir(e.mlir_module(), "f32")
        compile_s[label] = time.perf_counter() - t0
        module = rt.load_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb), config)
        on_iree = [rt.asdevicearray(config.device, np.asarray(flat[i]))
                   for i in sorted(e.module_kept_var_idx)]
        losses[label] = float(module.main(*on_iree)[-2].to_host())
        fns[label] = lambda m=module, a=on_iree: m.main(*a)
    med = interleaved_medians(fns, runs=args.runs)
    rows = [f"| {k} | {compile_s[k]:.1f} | {v * 1e3:.0f} | {v / med['XLA:CPU']:.2f} | "
            f"{losses[k]:.6f} |" for k, v in med.items()]
    write_results(
        PROBE_RESULTS, "iree_step", probe_decision(__doc__) + "\n\nOne render on XLA:CPU and "
        f"on IREE llvm-cpu: {args.recipe}, R = 1, {args.res}², f32, K = {CLASSES}.",
        "python " + " ".join(sys.argv),
        "| compiler | compile s | step median ms | / XLA | loss |\n|---|---|---|---|---|\n"
        + "\n".join(rows),
        f"Step medians of {args.runs} interleaved runs, inputs already on each device; IREE "
        f"{iree.version()} with {' '.join(iree.flags('f32'))}; XLA at its "
        f"default optimization level.")


if __name__ == "__main__":
    main()
