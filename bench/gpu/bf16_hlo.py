"""On a GPU machine: do bf16 renders still have bf16 convolutions after XLA optimizes them?

XLA:CPU upcasts bf16 convolutions to f32 when it compiles (docs/platform.md), so the test suite
checks the bf16 policy in the StableHLO only (tests/test_render.py). This script renders each net's
bf16 step for the local GPU (one device, k = 1, N = 8 at 64²), compiles it, and reads the
OPTIMIZED HLO: every convolution XLA kept as a convolution (cuDNN custom-calls, or plain
``convolution`` ops) must take bf16 operands and give a bf16 result, and the convolutions plus
the bf16 GEMMs (1x1 convolutions XLA may rewrite as GEMMs) must account for every convolution of
the StableHLO — so a compile that upcast some, or a reader that found none, fails. The
classifier's GEMM is f32 by the policy and is listed, not counted. cuDNN fusions that XLA names
only in backend_config are not recognised: they would show up as missing convolutions.

    python bench/gpu/bf16_hlo.py [--nets resnet50 mnv4] [--hlo-dir DIR]

Exit 0 when every convolution is bf16, 1 when one is not, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import jax

from twinstep.nets import NETS
from twinstep.rendering import render, stablehlo

_DTYPE = r"(bf16|f16|f32|f64)\[[\d,]*\]"


def conv_like(hlo: str):
    """Yield (kind, operand dtypes, result dtypes) for every convolution and GEMM of an optimized
    HLO module's text. Newer XLA prints operands by name only (``custom-call(%a, %b)``): their
    dtypes are then read from the instructions that define them (names are unique in a
    module)."""
    defined = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = \(?" + _DTYPE, hlo, re.M))
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target and ("conv" in target.group(1) or "gemm" in target.group(1)
                       or "matmul" in target.group(1)):
            kind = target.group(1)
        elif re.search(r"\bconvolution\(", line):
            kind = "convolution"
        else:
            continue
        call = re.search(r"\b(custom-call|convolution)\(", line)
        result = line[line.index("=") + 1:call.start()]
        operands = line[call.end():].split(")")[0]
        dtypes = re.findall(_DTYPE, operands) or [
            defined.get(name, "?") for name in re.findall(r"%[\w.\-]+", operands)]
        yield kind, tuple(dtypes), tuple(re.findall(_DTYPE, result))


def check(optimized: str, expected: int) -> tuple[bool, collections.Counter, int]:
    """(every convolution bf16 and ``expected`` of them found, the ops counted by (kind, operand
    dtypes, result dtypes), how many were bf16) for an optimized HLO module's text."""
    counts, accounted, ok = collections.Counter(), 0, True
    for kind, operands, result in conv_like(optimized):
        counts[(kind, "/".join(operands), "/".join(result))] += 1
        bf16 = set(operands) == {"bf16"} and result[:1] == ("bf16",)
        accounted += bf16
        ok = ok and (bf16 or "conv" not in kind)
    return ok and accounted >= expected, counts, accounted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"], choices=list(NETS),
                   help="any of the catalogue's nets (default: resnet50 mnv4)")
    p.add_argument("--hlo-dir", help="also write each optimized HLO module there")
    args = p.parse_args(argv)
    if render.local_platform() not in ("cuda", "rocm"):
        print(f"no GPU: JAX runs on {jax.default_backend()}", file=sys.stderr)
        return 2
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
    ok = True
    for net in args.nets:
        recipe = f"{net}in_adamdp8bf16"
        cfg = render.RenderConfig(recipe, 1, res=64, classes=1000, precision="bf16")
        exported = render.export_step(cfg).exported
        expected = len(stablehlo.convolutions(exported.mlir_module()))
        compiled = jax.jit(exported.call).lower(*exported.in_avals).compile()
        optimized = compiled.as_text()
        if args.hlo_dir:
            with open(f"{args.hlo_dir}/{recipe}.optimized.hlo", "w") as f:
                f.write(optimized)
        net_ok, counts, accounted = check(optimized, expected)
        ok = ok and net_ok
        print(f"{net}: {expected} convolutions in the StableHLO; {accounted} bf16 convolution / "
              f"GEMM ops in the optimized HLO")
        for (kind, ops, res), n in sorted(counts.items()):
            print(f"  {n:4d}  {kind:<40} operands {ops:<16} result {res}")
    print("every convolution bf16" if ok else "a convolution is NOT bf16 (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
