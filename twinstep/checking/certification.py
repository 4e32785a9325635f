"""The op library's certification report (``twinstep certify``, ``make demo``): every oracle
of `twinstep.checking.oracle` at fixed small shapes, and every negative control, in one table."""

from __future__ import annotations

import dataclasses

import numpy as np

from twinstep.checking import cases, oracle
from twinstep.errors import UsageError

N = 2  # examples per replica in the data-parallel facts


@dataclasses.dataclass
class Report:
    checks: list  # oracle.Check that must pass
    controls: list  # (control, what it breaks, oracle.Check that must FAIL)
    variance: list  # (R, chan_err, naive_err, chan_bound)

    @property
    def ok(self) -> bool:
        return (all(c.ok for c in self.checks) and not any(c.ok for _, _, c in self.controls)
                and all(ch <= bd and nv > 100 * ch for _, ch, nv, bd in self.variance))

    def to_json(self):
        row = dataclasses.asdict
        return {"ok": self.ok, "checks": [row(c) | {"ok": c.ok} for c in self.checks],
                "controls": [row(c) | {"caught": not c.ok, "breaks": b}
                             for _, b, c in self.controls],
                "variance_exchange": [{"replicas": r, "chan_rel_err": ch, "chan_bound": bd,
                                       "naive_rel_err": nv}
                                      for r, ch, nv, bd in self.variance]}


def run(replica_counts=(2, 4), seed: int = 0) -> Report:
    if not any(count >= 2 for count in replica_counts):
        raise UsageError("certification runs its negative controls at R >= 2, and a control that "
                         "cannot fire is not a pass: give a replica count >= 2 (e.g. "
                         "--replicas 1 2)")
    rng = np.random.default_rng(seed)
    checks = []
    for case in cases.all_cases(rng):
        checks += [oracle.check_vjp(case, rng), oracle.check_fd(case, rng)]
    controls, variance = [], []
    for count in replica_counts:
        n = count * N
        dp_cases = [case for case in cases.all_cases(rng, n=n) if case.per_example]
        for case in dp_cases:
            checks += oracle.check_dp_facts(case, count, rng, shift=1.0)
        for kind in ("ce", "bce"):
            checks.append(oracle.check_divisor(kind, count, rng))
        if count == 1:
            continue
        bn = cases.bn_train_case(rng, n, 3, 4)
        conv = cases.conv_case(rng, n, 5, c_in=3, c_out=4, k=3, stride=2)
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
