"""``twinstep compare RUN_A RUN_B [...]``: runs paired image by image
(docs/training.md#comparing-runs)."""

from __future__ import annotations

from twinstep.cli import options
from twinstep.errors import ExitStatus


def add(p) -> None:
    p.description = (
        "Compare 'twinstep train' runs evaluated on the same val split: for the last evaluation "
        "step they share, each run's top-1 with its 95% interval and, for each other run against "
        "the first, the top-1 difference with McNemar's exact test on the paired images (which "
        "images one got right and the other not). A difference of a point or two is often "
        "noise: the test says whether it is. Also overlays the runs' curves (train loss, val "
        "top-1 with its interval) in a PNG. "
        + options.exits({ExitStatus.SUCCESS: "compared",
                         ExitStatus.USAGE: "bad usage or input (runs evaluated on different "
                                           "val splits, no step in common)"}))
    p.add_argument("runs", metavar="RUN_DIR", nargs="+",
                   help="two or more runs' folders ('twinstep train --out'); the first is the "
                   "baseline")
    p.add_argument("--ema", action="store_true", help="compare the EMA weights' results "
                   "(default: the raw weights')")
    p.add_argument("--step", type=int, metavar="K", help="the evaluation step to pair "
                   "(default: the last every run has)")
    p.add_argument("--out", metavar="FILE", default="compare.png",
                   help="the curves' PNG (default compare.png)")


def run(args, parser) -> int:
    from twinstep.training import compare  # lazy, the CLI's reason: numpy, past --help's needs

    weights = "ema" if args.ema else "raw"
    found = compare.compare(args.runs, weights, args.step)
    print(compare.report(found))
    print(f"curves: {compare.overlay(args.runs, args.out, weights)}")
    return ExitStatus.SUCCESS
