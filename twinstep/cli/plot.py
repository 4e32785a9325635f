"""``twinstep plot RUN_DIR``: a training run's curves as a PNG (docs/training.md#logs)."""

from __future__ import annotations


def add(p) -> None:
    p.description = ("Draw a 'twinstep train' run's curves — train loss, learning rate, val "
                     "top-1 of the raw and EMA weights — from RUN_DIR/metrics.jsonl into a PNG. "
                     "Exit 0 when written, 2 on bad usage.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder ('twinstep train --out')")
    p.add_argument("--out", metavar="FILE", help="default RUN_DIR/curves.png")


def run(args, parser) -> int:
    from twinstep.training import run_log

    print(run_log.plot(args.run_dir, args.out))
    return 0
