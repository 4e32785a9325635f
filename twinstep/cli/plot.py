"""``twinstep plot RUN_DIR | REPORT.json``: a training run's curves, or a tie's report, as a PNG
(docs/training.md#logs, docs/tie.md#the-picture)."""

from __future__ import annotations

import json
import os

from twinstep.checking import picture
from twinstep.cli import options
from twinstep.errors import ExitStatus, UsageError
from twinstep.training import run_log


def add(p) -> None:
    p.description = ("Draw a 'twinstep train' run's curves — train loss, learning rate, val "
                     "top-1 of the raw and EMA weights — from RUN_DIR/metrics.jsonl into a PNG; "
                     "or a report saved with 'twinstep tie NET --json REPORT.json' (every "
                     "parameter's error and bound along the net) or 'twinstep certify --json' "
                     "(every check's error over its bound); a whole-step tie's ('tie --recipe' "
                     "or '--render') draws each state tensor's error over its bound at each "
                     "step. " + options.exits({ExitStatus.SUCCESS: "written"}))
    p.add_argument("run_dir", metavar="RUN_DIR|REPORT.json",
                   help="a run's folder ('twinstep train --out'), or a tie's or a "
                   "certification's JSON report")
    p.add_argument("--out", metavar="FILE", help="default RUN_DIR/curves.png, or REPORT.png")


def run(args, parser) -> int:
    if not os.path.isfile(args.run_dir):  # a run's folder, or says what a run's holds
        print(run_log.plot(args.run_dir, args.out))
        return ExitStatus.SUCCESS
    try:
        with open(args.run_dir) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{args.run_dir}: neither a run's folder nor a JSON report ({e})") \
            from None
    out = args.out or os.path.splitext(args.run_dir)[0] + ".png"
    try:
        print(picture.draw(report, out))
    except ValueError:
        raise UsageError(f"{args.run_dir}: neither a tie's report ('twinstep tie --json', one "
                         f"step or whole steps) nor a certification's ('twinstep certify "
                         f"--json')") from None
    return ExitStatus.SUCCESS
