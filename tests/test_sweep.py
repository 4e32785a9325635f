"""The property sweep: random f64 ties — (net, R <= 4, N <= 4, res, K, loss, shift, seed) — each
followed by a random control that must break it (a control at R = 1 cannot fire and is not run).
Each tie must be *tied*: an inconclusive one (within its bounds, but a bound above 1e-3) fails its
group, which still runs its other cases and names every inconclusive one.

A program shape (net, R, N, res, K, loss) compiles four programs (single device, replicas, two
controls), so cases come in groups: each group draws a shape and two controls, then CASES
(seed, shift, control) draws run on it. `make test` runs group 0 at its small budget; test-all
(TWINSTEP_HYPOTHESIS=all) runs GROUPS groups of CASES, and the terminal summary counts them (a
passing group's count of inconclusive ties is 0 by construction).
"""

import dataclasses
import os
import time

import numpy as np
import pytest

from twinstep.checking import tie
from twinstep.collectives import CONTROLS, MASK_CONTROLS

FULL = os.environ.get("TWINSTEP_HYPOTHESIS") == "all"
GROUPS = 16
CASES = 32 if FULL else 1  # per group: 16 x 32 = 512 ties in test-all; make test: one
SWEEP_SEED = 20261201
GRADIENT_CONTROLS = sorted(set(CONTROLS) - {"none", *MASK_CONTROLS})
# make test's group: ResNet-50 at R = 2, N = 2, 32², K = 10, CE — the shape test_tie.py compiles
# (with every control), so the run's compilation cache already holds its programs
FIRST = {"net": "resnet50", "replicas": 2, "batch": 2, "res": 32, "classes": 10, "loss": "ce"}


def draw_shape(rng) -> dict:
    replicas, batch = int(rng.integers(1, 5)), int(rng.integers(1, 5))
    if replicas * batch < 2:  # a BN over one row has no variance
        batch = 2
    return {"net": str(rng.choice(["resnet50", "mnv4"])), "replicas": replicas, "batch": batch,
            "res": int(rng.choice([32, 64])), "classes": int(rng.choice([2, 10, 100, 1000])),
            "loss": str(rng.choice(["ce", "bce"]))}


@pytest.mark.slow
@pytest.mark.parametrize("group", [pytest.param(g, marks=() if g == 0 else pytest.mark.all)
                                   for g in range(GROUPS)])
def test_random_ties_tie_and_their_controls_break_them(group, record_property):
    rng = np.random.default_rng([SWEEP_SEED, group])
    shape = FIRST if group == 0 else draw_shape(rng)
    controls = rng.choice(GRADIENT_CONTROLS, 2, replace=False) if shape["replicas"] > 1 else []
    start, counts = time.perf_counter(), {"ties": 0, "controls": 0, "inconclusive": 0}
    loose = []  # (case, verdict) of every tie that was not tied: the group fails, naming them all
    for _ in range(CASES):
        case = {**shape, "seed": int(rng.integers(0, 2**31)), "shift": bool(rng.integers(2))}
        cfg = tie.TieConfig(**case, fast_compile=True)  # a tie's programs run a few times
        r = tie.run_tie(cfg)
        # a tie is claimed, so only "tied" passes: an inconclusive run (a bound over 1e-3, too
        # loose to see a bug of 1%) is within its bounds but shows nothing (docs/tie.md)
        assert r.within and r.replicas_agree, f"{case}: {r.verdict()}"
        counts["ties"] += 1
        counts["inconclusive"] += r.status == "inconclusive"
        if not r.ok:
            loose.append(f"{case}: {r.verdict()}")
        if len(controls):
            control = str(rng.choice(controls))
            broken = tie.run_tie(dataclasses.replace(cfg, control=control))
            assert broken.status == "NOT tied", f"{case}, {control}: {broken.verdict()}"
            counts["controls"] += 1
    for key, value in counts.items():
        record_property(f"sweep_{key}", value)
    record_property("sweep_seconds", time.perf_counter() - start)
    assert not loose, f"{len(loose)} of {CASES} ties inconclusive, not tied:\n" + "\n".join(loose)
