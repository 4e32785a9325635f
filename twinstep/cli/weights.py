"""``twinstep weights RUN_DIR``: a training run's latest weights as a timm state dict
(docs/training.md#weights-for-timm)."""

from __future__ import annotations

from twinstep.cli import options
from twinstep.errors import ExitStatus
from twinstep.training import state_dict


def add(p) -> None:
    p.description = ("Write a 'twinstep train' run's latest weights — parameters and BN running "
                     "statistics, or their EMA — as a float32 state dict in timm's names, which "
                     "timm.create_model loads (docs/training.md#weights-for-timm). "
                     + options.exits({ExitStatus.SUCCESS: "written"}))
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder ('twinstep train --out')")
    p.add_argument("--format", choices=state_dict.FORMATS, default=state_dict.FORMATS[0],
                   help=f"default {state_dict.FORMATS[0]}")
    p.add_argument("--ema", action="store_true", help="the EMA weights (recipes with 'ema')")
    p.add_argument("--out", metavar="FILE", help="default RUN_DIR/model[_ema].FORMAT")


def run(args, parser) -> int:
    print(state_dict.write_from_run(args.run_dir, args.format, args.ema, args.out))
    return ExitStatus.SUCCESS
