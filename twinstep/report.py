"""What the ties and the certification print: rich tables on stdout, the verdict last, and
what a long command is doing now on stderr. The reports themselves (data, verdicts, JSON) live
with the checks that make them (`twinstep.ties`, `twinstep.certify`)."""

from __future__ import annotations

import contextlib
import os

from rich.console import Console
from rich.markup import escape
from rich.table import Table

COLOURS = {"tied": "green", "NOT tied": "red", "inconclusive": "yellow"}  # a tie's status


def mark(ok: bool) -> str:
    return "[green]ok[/]" if ok else "[red]FAIL[/]"


@contextlib.contextmanager
def status(first: str, quiet: bool = False):
    """A spinner on stderr saying what runs now; yields ``say(text)`` to change it (a no-op
    when ``quiet`` or stderr is not a terminal, so logs and pipes stay clean)."""
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield lambda text: None
        return
    with console.status(first) as spinner:
        yield lambda text: spinner.update(text)


@contextlib.contextmanager
def train_progress(total: int, quiet: bool = False):
    """A progress bar on stderr for a training run — step, epoch, loss, lr, img/s, ETA —
    yielding ``update(step, metrics)`` (a no-op when ``quiet`` or stderr is not a terminal)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield lambda step, metrics: None
        return
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[text]}"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=total, text="compiling")

        def update(step, m):
            top1 = m.get("eval", {}).get("raw", {}).get("top1")
            text = (f"epoch {m['epoch']:.2f}  loss {m['loss']:.3f}  lr {m['lr']:.2e}  "
                    f"{m['img_per_s']:.0f} img/s" + (f"  val top-1 {top1:.1%}" if top1 else ""))
            bar.update(task, completed=step, text=text)

        yield update


def tie_report(report, show_all: bool = False, seconds: float | None = None,
                 console=None) -> None:
    console = console or Console()
    c = report.config
    console.print(f"[bold]{c.net}[/]: R = {c.replicas} replicas x N = {c.batch} vs one device at "
                  f"{c.replicas * c.batch}; {c.res}², K = {c.classes}, loss {c.loss}, "
                  f"{c.precision}, shift {'on' if c.shift else 'off'}, control {c.control}")
    rows = sorted(report.parameters, key=lambda p: -p["rel_err"] / max(p["bound"], 1e-300))
    shown = report.parameters if show_all else rows[:10]
    table = Table(title="parameter gradients: mean over replicas vs single device" +
                  ("" if show_all else f" (worst 10 of {len(rows)}; --all for every row)"))
    has_sens = any("sensitivity" in p for p in shown)
    table.add_column("parameter", no_wrap=True)
    table.add_column("shape")
    for col in ("rel err", "max abs", "bound") + (("sensitivity",) if has_sens else ()) + ("",):
        table.add_column(col, justify="right")
    for p in shown:
        sens = (f"{p['sensitivity']:.1e}" if "sensitivity" in p else "-",) if has_sens else ()
        table.add_row(p["name"], "x".join(map(str, p["shape"])), f"{p['rel_err']:.1e}",
                      f"{p['abs_err']:.1e}", f"{p['bound']:.1e}", *sens,
                      mark(p["ok"]))
    console.print(table)

    sites = sorted(report.bn_sites, key=lambda b: -max(b["mean_rel_err"], b["var_rel_err"]))
    bn = Table(title="forward half: BN sites' global statistics" +
               ("" if show_all else f" (worst 5 of {len(sites)})"))
    bn.add_column("BN site", no_wrap=True)
    for col in ("mean rel err", "var rel err", "bound", ""):
        bn.add_column(col, justify="right")
    for b in sites if show_all else sites[:5]:
        bn.add_row(b["name"], f"{b['mean_rel_err']:.1e}", f"{b['var_rel_err']:.1e}",
                   f"{b['bound']:.1e}", mark(b["ok"]))
    console.print(bn)
    lo = report.loss
    console.print(f"loss: replicas {lo['replica']:.12g}, single {lo['single']:.12g} "
                  f"(rel err {lo['rel_err']:.1e}); logits rel err {report.logits_rel_err:.1e}; "
                  f"running statistics rel err {report.buffers_rel_err:.1e}; replicas "
                  f"{'agree' if report.replicas_agree else '[red]DISAGREE[/]'} on statistics "
                  f"and buffers")
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    # one line, unwrapped: scripts (and `make demo`) read the last line
    console.print(f"[{COLOURS[report.status]}]{report.verdict()}[/]{took}", soft_wrap=True)


def steps_report(report, show_all: bool = False, seconds=None, console=None):
    console = console or Console()
    c = report.config
    console.print(f"[bold]{c.net}[/] recipe {c.recipe}: R = {c.replicas} x N = {c.batch} vs one "
                  f"device at {c.replicas * c.batch}; {c.res}², K = {c.classes}, {c.precision}, "
                  f"control {c.control}")
    for s in report.steps:
        rows = sorted(s["rows"], key=lambda r: -r["rel_err"])
        table = Table(title=f"after step {s['step']}: state tensors" +
                      ("" if show_all else f" (worst 5 of {len(rows)})"))
        for col, j in (("tensor", "left"), ("shape", "left"), ("rel err", "right"),
                       ("bound", "right"), ("sensitivity", "right"), ("", "right")):
            table.add_column(col, justify=j, no_wrap=col == "tensor")
        for r in rows if show_all else rows[:5]:
            table.add_row(r["name"], "x".join(map(str, r["shape"])), f"{r['rel_err']:.1e}",
                          f"{r['bound']:.1e}", f"{r['sensitivity']:.1e}",
                          mark(r["ok"]))
        console.print(table)
        lo = s["loss"]
        console.print(f"loss: replicas {lo['replica']:.12g}, single {lo['single']:.12g} "
                      f"(rel err {lo['rel_err']:.1e})")
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    # one line, unwrapped: scripts (and `make demo`) read the last line
    console.print(f"[{COLOURS[report.status]}]{report.verdict()}[/]{took}", soft_wrap=True)


def parity_report(r, res: int, batch: int, classes: int, console=None) -> None:
    """`twinstep.parity.ParityReport`: each error against its bound, the verdict last."""
    from twinstep import parity
    from twinstep.nets import get_net

    console = console or Console()
    p = r.precision
    console.print(f"{r.net} vs timm {get_net(r.net).TIMM_NAME}: {res}², batch {batch}, "
                  f"K = {classes}, {p}, loss {r.loss}")

    def line(label, err, bound):
        ok = "" if bound is None else mark(err <= bound)
        lim = "reported only" if bound is None else f"bound {bound:.0e}"
        console.print(f"  {label:<34} {err:.2e}  ({lim}) {ok}")

    line("logits, train mode (rel. max)", r.logits_train_err, parity.LOGITS_BOUND[p])
    line("logits, eval mode (rel. max)", r.logits_eval_err, parity.LOGITS_BOUND[p])
    name, worst = r.worst_grad
    line(f"worst of {len(r.grad_errs)} gradients", worst, parity.GRAD_BOUND[p])
    console.print(f"    ({name})")
    line("running buffers after one step", r.buffer_err, parity.BUFFER_BOUND[p])
    console.print("[green]parity holds[/]" if r.ok else "[red]parity FAILS[/]")


def render_table(rows: list, replicas: int, out: str, console=None) -> None:
    """One row per render written: rows of (manifest, seconds)."""
    console = console or Console()
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
                          f"'twinstep tie --artifact {os.path.join(out, vmfb)}'",
                          highlight=False, soft_wrap=True)


def certify_report(report, seconds: float, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="op library certification (float64)")
    for col in ("op", "check", "R", "worst err", "bound", ""):
        table.add_column(col, justify="right" if col in ("R", "worst err", "bound") else "left")
    groups: dict = {}
    for c in report.checks:
        key = (c.op, c.check)
        groups.setdefault(key, []).append(c)
    for (op, check), cs in groups.items():
        ok = all(c.ok for c in cs)
        rs = ",".join(str(c.replicas) for c in cs)
        table.add_row(op, check, rs, f"{max(c.err for c in cs):.1e}", f"{cs[0].tol:.0e}",
                      mark(ok))
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
        naive = min(nv for _, _, nv in report.variance)
        chan = max(ch for _, ch, _ in report.variance)
        ctl.add_row(escape("E[x^2]-E[x]^2"), "f32 variance at offset 1e4",
                    ",".join(str(r) for r, _, _ in report.variance),
                    f"{naive:.1e} (Chan {chan:.1e})",
                    "[green]caught[/]" if naive > 100 * chan else "[red]MISSED[/]")
    console.print(ctl)
    n_ok = sum(c.ok for c in report.checks)
    n_caught = sum(not c.ok for _, _, c in report.controls)
    verdict = "[green]certified[/]" if report.ok else "[red]NOT certified[/]"
    worst_vjp = max(c.err for c in report.checks if c.check == "vjp vs jax.vjp")
    console.print(f"{verdict}: {n_ok}/{len(report.checks)} checks hold, "
                  f"{n_caught}/{len(report.controls)} controls caught, "
                  f"worst VJP err {worst_vjp:.1e} ({seconds:.0f} s)", soft_wrap=True)
