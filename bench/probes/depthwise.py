"""Probe for the CPU default of the depthwise convolution (the shift path, twinstep/ops/conv.py):
every depthwise path (`conv.DEPTHWISE_PATHS`: grouped convolutions, k^2 shifted multiply-adds,
and their GPU candidates), forward + both VJPs, on MobileNetV4-Conv-M's depthwise layers at a
small input.

    python bench/probes/depthwise.py [--res 64] [--batch 8] [--runs 7] [--precision f32]
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
from twinstep.ops import conv
from twinstep.ops.levers import Levers
from twinstep.ops.precision import get_precision

# (channels, kernel, stride, grid divisor): MNv4-Conv-M's start / middle depthwise layers of a
# few representative rows, the grid given as input resolution // divisor.
LAYERS = [(48, 3, 1, 4), (192, 5, 2, 4), (80, 3, 1, 8), (480, 5, 2, 8), (160, 3, 1, 16),
          (640, 3, 1, 16), (160, 5, 1, 16), (960, 5, 2, 16), (256, 5, 1, 32), (1024, 5, 1, 32)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--res", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    precision = get_precision(args.precision)
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((args.batch, max(args.res // d, 1),
                                           max(args.res // d, 1), c)), jnp.float32)
          for c, _, _, d in LAYERS]
    ws = [jnp.asarray(rng.standard_normal((c, 1, k, k)), jnp.float32) for c, k, _, _ in LAYERS]
    strides = [s for _, _, s, _ in LAYERS]
    fns = {p: op_chain(lambda x, w, s, p=p: conv.depthwise_forward(x, w, s, precision, path=p,
                                                                       crop_unread=True),
                       conv.depthwise_vjp, strides) for p in conv.DEPTHWISE_PATHS}
    compiled = {p: (lambda f=f: block(f(xs, ws))) for p, f in fns.items()}
    med = interleaved_medians(compiled, runs=args.runs)
    table = ("| path | median s (fwd + input-VJP + weight-VJP, 10 layers) | vs shift |\n"
             "|---|---|---|\n" + "".join(f"| {p} | {t:.4f} | {t / med['shift']:.2f}x |\n"
                                        for p, t in med.items()))
    write_results(PROBE_RESULTS, "depthwise",
                  probe_decision(__doc__) + "\n\nDepthwise paths, MNv4-Conv-M layers, batch "
                  f"{args.batch} at {args.res}², {args.precision}.",
                  f"python bench/probes/depthwise.py --res {args.res} --batch {args.batch} "
                  f"--runs {args.runs} --precision {args.precision}", table,
                  f"Platform default on {jax.default_backend()}: "
                  f"{Levers().on().depthwise_path}.")


if __name__ == "__main__":
    main()
