"""Probe for the CPU default of the dense convolution (the matmul path, twinstep/ops/conv.py):
the two dense conv paths (one XLA convolution per product vs windows times the kernel matrix),
forward + both VJPs, on ResNet-50's 53 convolutions at its shapes for a given input.

    python bench/probes/dense_paths.py [--res 64 128] [--batch 8] [--runs 5] [--precision f32]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    PROBE_RESULTS,
    block,
    interleaved_medians,
    op_chain,
    probe_decision,
    write_results,
)
from twinstep.nets import get_net
from twinstep.ops import conv
from twinstep.ops.levers import Levers
from twinstep.ops.precision import get_precision


def resnet50_convs(res: int) -> list[tuple[str, int, int]]:
    """(weight name, stride, input grid) of every ResNet-50 convolution at ``res``²."""
    out, grid = [("conv1.weight", 2, res)], conv.conv_out_size(conv.conv_out_size(res, 7, 2), 3, 2)
    block, block_grid, stride = None, grid, 1
    for name in get_net("resnet50").param_shapes(10):
        if not name.startswith("layer") or not ("conv" in name or "downsample.0" in name):
            continue
        if ".".join(name.split(".")[:2]) != block:  # a new bottleneck: input = the last output
            block = ".".join(name.split(".")[:2])
            block_grid = conv.conv_out_size(block_grid, 1, stride)
            stride = 2 if block.endswith(".0") and not block.startswith("layer1") else 1
        conv3 = name.endswith("conv3.weight")
        out.append((name, 1 if conv3 or "conv1" in name else stride,
                    conv.conv_out_size(block_grid, 1, stride) if conv3 else block_grid))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    precision = get_precision(args.precision)
    shapes = get_net("resnet50").param_shapes(10)
    rng = np.random.default_rng(0)
    rows = ""
    for res in args.res:
        convs = resnet50_convs(res)
        xs = [jnp.asarray(rng.standard_normal((args.batch, g, g, shapes[n][1])), jnp.float32)
              for n, _, g in convs]
        ws = [jnp.asarray(rng.standard_normal(shapes[n]) / np.sqrt(np.prod(shapes[n][1:])),
                          jnp.float32) for n, _, _ in convs]
        strides = [s for _, s, _ in convs]
        fns = {p: op_chain(lambda x, w, s, p=p: conv.conv2d_forward(x, w, s, precision, path=p,
                                                                    crop_unread=True),
                           conv.conv2d_vjp, strides) for p in conv.DENSE_PATHS}
        med = interleaved_medians({p: (lambda f=f, xs=xs, ws=ws: block(f(xs, ws)))
                                   for p, f in fns.items()}, runs=args.runs)
        rows += "".join(f"| {res}² | {p} | {t * 1e3:.0f} | {t / med['conv']:.2f} |\n"
                        for p, t in med.items())
    table = ("| input | path | median ms (fwd + input-VJP + weight-VJP, 53 convolutions) "
             "| vs conv |\n|---|---|---|---|\n" + rows)
    write_results(PROBE_RESULTS, "dense_paths",
                  probe_decision(__doc__) + "\n\nDense conv paths, ResNet-50's convolutions, "
                  f"batch {args.batch}, {args.precision}.",
                  f"python bench/probes/dense_paths.py --res {' '.join(map(str, args.res))} "
                  f"--batch {args.batch} --runs {args.runs} --precision {args.precision}", table,
                  f"Platform default on {jax.default_backend()}: "
                  f"{Levers().on().dense_path}.")


if __name__ == "__main__":
    main()
