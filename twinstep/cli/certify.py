"""``twinstep certify``: the op library's hand-written VJPs and data-parallel facts, in float64,
with the negative controls that must break them (docs/tie.md#certification)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from twinstep.checking import picture
from twinstep.cli import options
from twinstep.cli.console import mark, report_console, status
from twinstep.errors import ExitStatus, UsageError
from twinstep.processes import disk


def add(p) -> None:
    p.description = ("Check every op's hand-written VJP against jax.vjp and central finite "
                     "differences, the four data-parallel facts under jax.shard_map on R virtual "
                     "devices, and that each negative control is caught "
                     "(docs/tie.md#certification). "
                     + options.exits({ExitStatus.SUCCESS: "all hold",
                                      ExitStatus.FAILED: "one does not"}))
    options.replicas(p, [2, 4], "replica counts for the data-parallel facts "
                                           "(default: 2 4)", "R", nargs="+")
    options.seed(p)
    options.json_out(p)
    p.add_argument("--plot", metavar="FILE.png", help="also draw every check's error over its "
                   "bound, and the controls' (docs/tie.md#the-picture)")


def run(args, parser) -> int:
    # lazy, the CLI's reason: they import JAX, which 'twinstep certify --help' need not load
    from twinstep import api
    from twinstep.checking import certification
    from twinstep.processes import settings

    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot}: a .png file name")
        disk.check_writable_file(args.plot, "--plot")
    api.devices(max(args.replicas))
    t0 = time.perf_counter()
    with settings.jax_settings(jax_enable_x64=True), status("certifying the op library"):
        result = certification.run(args.replicas, seed=args.seed)
    show(result, time.perf_counter() - t0)
    options.write_json(args.json, result.to_json())
    if args.plot is not None:
        print(f"picture: {picture.draw_certification(result.to_json(), args.plot)}")
    return ExitStatus.SUCCESS if result.ok else ExitStatus.FAILED


def show(report, seconds: float, console: Console | None = None) -> None:
    """The checks grouped by op, the controls, and the verdict last."""
    console = console or report_console()
    table = Table(title="op library certification (float64)")
    for col in ("op", "check", "R", "worst err", "bound", ""):
        table.add_column(col, justify="right" if col in ("R", "worst err", "bound") else "left")
    groups: dict = {}
    for c in report.checks:
        groups.setdefault((c.op, c.check), []).append(c)
    for (op, check), cs in groups.items():
        table.add_row(op, check, ",".join(str(c.replicas) for c in cs),
                      f"{max(c.err for c in cs):.1e}", f"{cs[0].tol:.0e}",
                      mark(all(c.ok for c in cs)))
    console.print(table)

    ctl = Table(title="negative controls (each must be caught: its check must fail)")
    for col in ("control", "breaks", "R", "smallest err", ""):
        ctl.add_column(col, justify="right" if col in ("R", "smallest err") else "left")
    caught: dict = {}
    for name, breaks, c in report.controls:
        caught.setdefault((name, breaks), []).append(c)
    for (name, breaks), cs in caught.items():
        ctl.add_row(name, breaks, ",".join(str(c.replicas) for c in cs),
                    f"{min(c.err for c in cs):.1e}",
                    "[green]caught[/]" if not any(c.ok for c in cs) else "[red]MISSED[/]")
    if report.variance:
        naive = min(nv for _, _, nv, _ in report.variance)
        chan = max(ch for _, ch, _, _ in report.variance)
        held = all(ch <= bd for _, ch, _, bd in report.variance)
        ctl.add_row(escape("E[x^2]-E[x]^2"), "f32 variance at offset 1e4",
                    ",".join(str(r) for r, *_ in report.variance),
                    f"{naive:.1e} (Chan {chan:.1e})",
                    "[red]Chan over its bound[/]" if not held else
                    "[green]caught[/]" if naive > 100 * chan else "[red]MISSED[/]")
    console.print(ctl)
    n_ok = sum(c.ok for c in report.checks)
    n_caught = sum(not c.ok for _, _, c in report.controls)
    verdict = "[green]certified[/]" if report.ok else "[red]NOT certified[/]"
    worst_vjp = max(c.err for c in report.checks if c.check == "vjp vs jax.vjp")
    console.print(f"{verdict}: {n_ok}/{len(report.checks)} checks hold, "
                  f"{n_caught}/{len(report.controls)} controls caught, "
                  f"worst VJP err {worst_vjp:.1e} ({seconds:.0f} s)", soft_wrap=True)
