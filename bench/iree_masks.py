"""The IREE runtime failure behind renders that draw masks in k >= 2 micro-steps (issue 17),
reduced to a few ops: a scan whose body folds its step counter into a threefry key and draws
bits from it. Exported with jax_enable_x64 (as every f64 render is), IREE 3.13 compiles it and
its runtime fails on the first call with "OUT_OF_RANGE; indirect buffer reference slot 0 is out
range of the declared binding capacity of the command buffer 0; while invoking native function
hal.command_buffer.copy_buffer" — with IREE's default flags and with twinstep's f64 ones alike.
The same function exported without x64 (f32) runs, and draws XLA's bits; whole f32 renders of
such recipes (resnet50in_accdp2x8drop) fail the same way, but did not reduce to a small program.

    pip install 'twinstep[iree]'
    python bench/iree_masks.py

Exit 0 when the reproduction holds (x64 fails, f32 runs and matches), 1 when it does not (IREE
changed: try f64 renders with masks again), 2 when IREE is missing.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import sys
import jax, jax.numpy as jnp, numpy as np
x64 = sys.argv[1] == "x64"
jax.config.update("jax_enable_x64", x64)
from twinstep.rendering import iree
from twinstep.errors import BackendError
dtype = jnp.float64 if x64 else jnp.float32

def f(xs, key_data):
    key = jax.random.wrap_key_data(key_data)
    def body(carry, x):
        i, total = carry
        bits = jax.random.bits(jax.random.fold_in(key, i), (8, 1), jnp.uint32)
        return (i + 1, total + (x + bits.astype(x.dtype)).sum()), bits
    (_, total), bits = jax.lax.scan(body, (jnp.uint32(0), jnp.zeros((), dtype)), xs)
    return total, bits

args = (np.ones((2, 8, 4), dtype), np.asarray(jax.random.key_data(jax.random.key(1))))
exported = jax.export.export(jax.jit(f))(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args))
call = iree.load(iree.compile_mlir(exported.mlir_module(), "f64" if x64 else "f32"))
try:
    _, bits = call(*args)
except BackendError as e:
    print("FAILS:", str(e).split("c/runtime/src/")[-1][:160])
    sys.exit(1)
same = np.array_equal(bits, np.asarray(jax.jit(f)(*args)[1]))
print("runs, its bits", "equal to XLA's" if same else "DIFFER from XLA's")
"""


def main() -> int:
    try:
        import iree.compiler  # noqa: F401
        import iree.runtime  # noqa: F401
    except ImportError:
        print("iree_masks.py: IREE is not installed (pip install 'twinstep[iree]')",
              file=sys.stderr)
        return 2
    codes = {}
    for mode in ("x64", "f32"):  # one process each: x64 is process-wide
        p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True)
        print(f"{mode}: {(p.stdout.strip().splitlines() or [p.stderr.strip()[-300:]])[-1]}")
        codes[mode] = (p.returncode, p.stdout)
    holds = codes["x64"][0] == 1 and codes["f32"][0] == 0 and "equal" in codes["f32"][1]
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
