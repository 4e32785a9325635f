"""Probe for the recipes 'render --target iree' refuses (iree_refusal, rendering/render.py):
which renders IREE compiles and runs (issue 17): every reference name and preset ('render
--all') at R = 1, 32², K = 1000, its default precision, in the form 'render --target iree'
exports (grouped depthwise convolutions), compiled by IREE's llvm-cpu backend, then one step run
by IREE's runtime from a fresh state. The recipes 'render --target iree' refuses (masks in
k >= 2 micro-steps: `twinstep.rendering.render.iree_refusal`) are compiled and run too, to show why.

    python bench/probes/iree_renders.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from bench.common import PROBE_RESULTS, probe_decision, write_results
from bench.probes.iree_step import CLASSES, inputs
from twinstep.errors import BackendError
from twinstep.rendering import iree, render

RES = 32


def one(name: str) -> str:
    """A table row: the render's precision, IREE's compile seconds, and its first step."""
    refusal = render.iree_refusal(render.RenderConfig(name, 1, res=RES).recipe)
    real, render.iree_refusal = render.iree_refusal, lambda recipe: None
    try:  # compile the refused ones too
        cfg = render.RenderConfig(name, 1, res=RES, classes=CLASSES, target="iree")
    finally:
        render.iree_refusal = real
    e = render.export_step(cfg).exported
    row = f"| `{name}` | {cfg.precision} | {'refused' if refusal else 'rendered'} |"
    t0 = time.perf_counter()
    try:
        vmfb = iree.compile_mlir(e.mlir_module(), cfg.precision)
    except BackendError as err:
        return f"{row} fails: {str(err)[:120]} | |"
    row += f" {time.perf_counter() - t0:.0f} |"
    flat = inputs(cfg.recipe, RES, cfg.precision)
    try:
        out = iree.load(vmfb)(*(np.asarray(flat[i]) for i in
                                         sorted(e.module_kept_var_idx)))
    except BackendError as err:
        return f"{row} fails: {str(err).split('validation.c')[-1][:90]} |"
    loss = float(out[-2])
    return f"{row} {'loss ' + format(loss, '.4f') if math.isfinite(loss) else 'NON-FINITE'} |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="these names instead of all")
    args = ap.parse_args()
    rows = []
    for name in args.only or render.all_names():
        rows.append(one(name))
        print(rows[-1], flush=True)
    write_results(
        PROBE_RESULTS, "iree_renders", probe_decision(__doc__) + "\n\nRenders on IREE "
        f"llvm-cpu: R = 1, {RES}², K = {CLASSES}, each recipe's precision.",
        "python " + " ".join(sys.argv),
        "| name | precision | `--target iree` | compile s | first step on IREE's runtime |\n"
        "|---|---|---|---|---|\n" + "\n".join(rows),
        f"IREE {iree.version()}; the depthwise convolutions grouped, as 'render --target "
        f"iree' exports them; flags as `twinstep.rendering.iree.flags` gives them per precision.")


if __name__ == "__main__":
    main()
