"""The op library's certification report (``twinstep certify``, ``make demo``): every oracle
of `twinstep.oracle` at fixed small shapes, and every negative control, in one table."""

from __future__ import annotations

import dataclasses

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from twinstep import oracle

N = 2  # examples per replica in the data-parallel facts


@dataclasses.dataclass
class Report:
    checks: list  # oracle.Check that must pass
    controls: list  # (control, what it breaks, oracle.Check that must FAIL)
    variance: list  # (R, chan_err, naive_err)

    @property
    def ok(self) -> bool:
        return (all(c.ok for c in self.checks) and not any(c.ok for _, _, c in self.controls)
                and all(ch < 1e-3 and nv > 100 * ch for _, ch, nv in self.variance))

    def to_json(self):
        row = dataclasses.asdict
        return {"ok": self.ok, "checks": [row(c) | {"ok": c.ok} for c in self.checks],
                "controls": [row(c) | {"caught": not c.ok, "breaks": b}
                             for _, b, c in self.controls],
                "variance_exchange": [{"replicas": r, "chan_rel_err": ch, "naive_rel_err": nv}
                                      for r, ch, nv in self.variance]}


def run(replica_counts=(2, 4), seed: int = 0) -> Report:
    rng = np.random.default_rng(seed)
    checks = []
    for case in oracle.all_cases(rng):
        checks += [oracle.check_vjp(case, rng), oracle.check_fd(case, rng)]
    controls, variance = [], []
    for count in replica_counts:
        n = count * N
        dp_cases = [case for case in oracle.all_cases(rng, n=n) if case.per_example]
        for case in dp_cases:
            checks += oracle.check_dp_facts(case, count, rng, shift=1.0)
        for kind in ("ce", "bce"):
            checks.append(oracle.check_divisor(kind, count, rng))
        if count == 1:
            continue
        bn = oracle.bn_train_case(rng, n, 3, 4)
        conv = oracle.conv_case(rng, n, 5, 3, 4, 3, 2)
        facts = {c: {f.check: f for f in oracle.check_dp_facts(case, count, rng, control=c)}
                 for c, case in (("unsynced", bn), ("shard-gamma", bn), ("sum", conv))}
        controls += [("unsynced", "BN sharding", facts["unsynced"]["sharding"]),
                     ("shard-gamma", "gamma collective", facts["shard-gamma"]["collectives"]),
                     ("sum", "weight collective", facts["sum"]["collectives"])]
        controls += [("wrong-divisor", f"{kind} divisor",
                      oracle.check_divisor(kind, count, rng, control="wrong-divisor"))
                     for kind in ("ce", "bce")]
        variance.append((count, *oracle.variance_exchange_errors(count, rng)))
    return Report(checks, controls, variance)


def print_report(report: Report, seconds: float, console: Console | None = None) -> None:
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
                      "[green]ok[/]" if ok else "[red]FAIL[/]")
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
                  f"worst VJP err {worst_vjp:.1e} ({seconds:.0f} s)")
