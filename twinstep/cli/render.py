"""``twinstep render``: a recipe's whole train step exported for an R-device mesh, as StableHLO
text, a serialized jax.export and a manifest (docs/renders.md)."""

from __future__ import annotations

import argparse
import os
import time

from rich.table import Table

from twinstep.cli import options
from twinstep.cli.console import report_console, status
from twinstep.collectives import CONTROLS
from twinstep.errors import ExitStatus
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.processes import disk
from twinstep.rendering import render
from twinstep.rendering.manifest import PLATFORMS


def add(p) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Export a recipe's whole train step — forward, loss, backward with its sync-BN sites, "
        "the gradient\ncollective, k micro-steps, clip, optimizer, EMA — for an R-device mesh "
        "with jax.export, from an\nabstract mesh (no R devices needed). Writes NAME.mlir "
        "(StableHLO), NAME.jaxexport (the serialized\nexport) and NAME.json (the manifest), and "
        "with --target iree NAME.vmfb (docs/renders.md).\n\n"
        + options.exits({ExitStatus.SUCCESS: "every render written",
                         ExitStatus.INTERNAL: "IREE missing or unable to compile the step, or "
                                              "an internal error"}))
    p.add_argument("name", nargs="?", help="a recipe name or preset ('twinstep recipe')")
    p.add_argument("--all", action="store_true",
                   help=f"render the reference names and the presets (docs/recipes.md), at "
                        f"--res {render.SMALL_RES} unless given")
    options.replicas(p, 1, "the mesh the step is rendered for (default 1: no "
                                      "collective)", "R")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    options.count(p, "--res", None, "input resolution (default: the recipe's train resolution)")
    options.count(p, "--classes", render.DEFAULT_CLASSES,
                  f"classes K (default {render.DEFAULT_CLASSES})")
    p.add_argument("--precision", choices=PRECISIONS,
                   help="default: bf16 with the recipe's bf16 token, else f32; an f64 render is "
                        "the one 'twinstep tie --render' ties exactly")
    p.add_argument("--platform", choices=PLATFORMS,
                   help="the backend to lower for (default: this machine's)")
    p.add_argument("--control", choices=sorted(CONTROLS), default="none",
                   help="render a deliberately broken step: a negative control 'twinstep tie "
                        "--render' must fail")
    p.add_argument("--target", choices=render.TARGETS, default="xla",
                   help="xla (default), or iree: also NAME.vmfb, IREE's llvm-cpu build (the "
                        "[iree] extra; R = 1; docs/renders.md#iree)")


def run(args, parser) -> int:
    from twinstep import api  # lazy, the CLI's reason: the whole API, past 'render --help's needs

    if args.all == (args.name is not None):
        parser.error("give a recipe NAME or --all (not both)")
    disk.check_writable_folder(args.out, "--out")
    names = render.all_names() if args.all else [args.name]
    res = args.res or (render.SMALL_RES if args.all else None)
    given = {"res": res, "classes": args.classes, "precision": args.precision,
             "platform": args.platform, "control": args.control, "target": args.target}
    for name in names:  # every configuration checked before the first export
        render.RenderConfig(name, args.replicas, **given)
    rows = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        with status(f"rendering {name} ({i + 1}/{len(names)})"):
            made = api.render(name, args.replicas, args.out, **given)
        rows.append((made.manifest, time.perf_counter() - t0))
    show(rows, args.replicas, args.out)
    return ExitStatus.SUCCESS


def show(rows: list, replicas: int, out: str, console=None) -> None:
    """One row per render written: rows of (manifest, seconds)."""
    console = console or report_console()
    table = Table(title=f"renders for R = {replicas} in {out}",
                  caption="collectives in the program (docs/sync-sites.md's reference: 2 per "
                          "BN + 1 per gradient bucket; +1 for the loss), and per optimizer step")
    for col in ("name", "N x k", "collectives (ref.)", "per step", "convs", "MiB", "s"):
        table.add_column(col, justify="left" if col == "name" else "right", overflow="fold")
    for m, seconds in rows:
        c = m["collectives"]
        exported = next(f for f in m["files"] if f.endswith(".jaxexport"))
        table.add_row(m["name"], f"{m['batch']} x {m['accum']}",
                      f"{c['in_text']} ({c['spec_reference']})",
                      str(c["per_optimizer_step"]["count"]),
                      f"{m['convolutions']['count']} {'/'.join(m['convolutions']['dtypes'])}",
                      f"{m['files'][exported]['bytes'] / 2**20:.1f}", f"{seconds:.0f}")
    console.print(table)
    for m, _ in rows:  # --target iree: the module and what runs it
        vmfb = next((f for f in m["files"] if f.endswith(".vmfb")), None)
        if vmfb:
            console.print(f"{vmfb}: IREE {m['iree']['compiler']} llvm-cpu module, "
                          f"{m['files'][vmfb]['bytes'] / 2**20:.1f} MiB; run it with "
                          f"'twinstep tie --render {os.path.join(out, vmfb)}'",
                          highlight=False, soft_wrap=True)
