"""The convolution IREE's llvm-cpu backend rejects in a twinstep render (issue 17), reduced to one
op: a strided convolution whose padded input has rows no window reads. With k = 3, s = 2, p = 1
on a 2x2 input (ResNet-50's layer4 at 32²: the padded 4x4 input gives a 1x1 output, and its last
padded row and column are never read) iree-compile 3.13 fails with "'linalg.generic' op inferred
input/output operand #1 has shape's dimension #0 to be 4, but found 3". The same convolution with
the unread padding cropped (high padding p - 1) computes the same output and compiles.

    pip install iree-base-compiler   # puts iree-compile on PATH
    python bench/iree_conv.py [--iree-compile PATH]

Exit 0 when the reproduction holds (the first form fails, the cropped form compiles), 1 when it
does not (IREE changed), 2 when iree-compile is missing.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

FORMS = {"padded (1, 1): a row unread": ((1, 1), (1, 1)),
         "cropped (1, 0): every row read": ((1, 0), (1, 0))}
FLAGS = ["--iree-input-type=stablehlo", "--iree-hal-target-device=local",
         "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"]


def compiles(compiler: str, pads, workdir: Path) -> tuple[bool, str]:
    """Whether IREE compiles the stride-2 3x3 convolution of a [2, 2, 2, 8] input at ``pads``;
    and the first error line when not."""
    def conv(x, w):
        return lax.conv_general_dilated(x, w, (2, 2), pads,
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    exported = jax.export.export(jax.jit(conv))(jax.ShapeDtypeStruct((2, 2, 2, 8), jnp.float32),
                                                jax.ShapeDtypeStruct((3, 3, 8, 8), jnp.float32))
    assert exported.out_avals[0].shape == (2, 1, 1, 8)
    src = workdir / "conv.mlir"
    src.write_text(exported.mlir_module())
    p = subprocess.run([compiler, *FLAGS, str(src), "-o", str(workdir / "conv.vmfb")],
                       capture_output=True, text=True)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    return p.returncode == 0, (errors or [""])[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iree-compile", default=shutil.which("iree-compile"))
    args = ap.parse_args()
    if not args.iree_compile:
        print("iree_conv.py: iree-compile not found (pip install iree-base-compiler)",
              file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        results = {label: compiles(args.iree_compile, pads, Path(tmp))
                   for label, pads in FORMS.items()}
    for label, (ok, error) in results.items():
        print(f"{label}: {'compiles' if ok else 'REJECTED: ' + error.split('error: ')[-1]}")
    (bad, _), (good, _) = results.values()
    return 0 if (not bad and good) else 1


if __name__ == "__main__":
    sys.exit(main())
