"""``twinstep weights RUN_DIR``: a training run's latest weights as a timm model folder
(docs/training.md#weights-for-timm)."""

from __future__ import annotations

import argparse

from twinstep.cli import options
from twinstep.errors import ExitStatus
from twinstep.training import export


def add(p) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Write a 'twinstep train' run's latest weights — parameters and BN running statistics, "
        "or their EMA —\nas a timm model folder: a float32 state dict in timm's names and the "
        "config.json timm reads\nbeside it (the architecture, the classes and their names, and "
        "the run's evaluation: input size,\nbilinear resize, centre crop 0.95, mean, std), so "
        "timm's own transforms evaluate it as the run did\n(docs/training.md#weights-for-timm).\n\n"
        + options.exits({ExitStatus.SUCCESS: "written"}))
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder ('twinstep train --out')")
    p.add_argument("--format", choices=export.FILES, default=next(iter(export.FILES)),
                   help="the state dict's format: " + ", ".join(
                       f"'{k}' ({v})" for k, v in export.FILES.items())
                   + f" (default {next(iter(export.FILES))})")
    p.add_argument("--ema", action="store_true", help="the EMA weights (recipes with 'ema')")
    p.add_argument("--out", metavar="FOLDER", help="default RUN_DIR/timm (RUN_DIR/timm_ema)")


def run(args, parser) -> int:
    folder, step = export.write_from_run(args.run_dir, args.format, args.ema, args.out)
    print(f"{folder}: step {step}'s {'EMA' if args.ema else 'raw'} weights "
          f"({export.FILES[args.format]}, {export.CONFIG}); in timm: "
          f"timm.create_model('local-dir:{folder}', pretrained=True)")
    return ExitStatus.SUCCESS
