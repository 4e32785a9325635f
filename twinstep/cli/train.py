"""``twinstep train RECIPE --out RUN_DIR``: the recipe's tied step looped over real data, with
checkpoints, evaluation and logs (docs/training.md)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import textwrap
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from twinstep.cli import options
from twinstep.collectives import CONTROLS
from twinstep.data.screen import CHECKS
from twinstep.data.sources import LOADERS
from twinstep.errors import ExitStatus
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.processes import cluster
from twinstep.training.config import DIGITS_RES, MAX_WORKERS, SMOKE_STEPS, TrainConfig

PROGRESS_EVERY_S = 30.0  # a plain progress line this often when stderr is not a terminal


def add(p) -> None:
    default = options.defaults(TrainConfig)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = textwrap.fill(
        "Train RECIPE's net with the recipe's whole train step — the program 'twinstep tie "
        "--recipe' ties to the single device — on R replicas, every BatchNorm synchronised. "
        "RUN_DIR gets config.json, skipped.txt (the images that do not read), metrics.jsonl, "
        "tb/ (TensorBoard), correct/ (each evaluation's per-image hits) and checkpoints/; "
        "running again with the same --out continues the run from its latest checkpoint, bit "
        "for bit. --data is 'digits' (bundled, no download) or an image folder "
        "DIR/train/<class>/..., DIR/val/<class>/... read through timm's transforms "
        "(docs/training.md).", 99) + "\n\n" + options.exits(
            {ExitStatus.SUCCESS: "trained",
             ExitStatus.INTERNAL: "a non-finite loss (the last checkpoint stays), or an internal "
                                  "or environment error"})
    p.add_argument("recipe", help="a recipe name or preset ('twinstep recipe'); a dp recipe for "
                                  "--replicas > 1")
    _data_options(p, default)
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="the run's folder (created)")
    options.replicas(p, default["replicas"],
                  f"replicas R (default {default['replicas']})", "R")
    options.count(p, "--batch", None, "examples per replica (default: the recipe's N)", metavar="N")
    options.count(p, "--res", None, f"training resolution (default: {DIGITS_RES} on the "
                                    f"digits; the recipe's on an image folder)")
    options.count(p, "--eval-res", None, "evaluation resolution, a centre crop of 0.95 "
                                         "(default: the recipe's on an image folder at the "
                                         "recipe's --res, e.g. rsb-a3 trains at 160 and "
                                         "evaluates at 224; else --res)", metavar="RES")
    length = p.add_mutually_exclusive_group()
    options.count(length, "--steps", None,
                  f"optimizer steps (default: a preset's epochs on an image folder, else "
                  f"{SMOKE_STEPS}); the warmup takes the recipe's share (a tenth for a "
                  f"grammar name), from timm's warmup lr", metavar="S")
    options.count(length, "--epochs", None, "passes over the training images instead of "
                                            "--steps (steps = ceil(E x images / (R N k)))",
                  metavar="E")
    for flag, what in (("eval_every", "evaluate on the val split every K steps and at the end"),
                       ("ckpt_every", "checkpoint every K steps and at the end"),
                       ("keep", "keep the last K checkpoints"),
                       ("keep_every", "also keep every K-th step's checkpoint for good, a "
                                      "multiple of --ckpt-every"),
                       ("log_every", "a metrics line every K steps")):
        options.count(p, "--" + flag.replace("_", "-"), default[flag],
                      f"{what} (default {default[flag] or 'none'})", metavar="K")
    p.add_argument("--precision", choices=PRECISIONS, default=default["precision"],
                   help="default: bf16 with the recipe's bf16 token, else f32")
    options.seed(p)
    _loader_options(p, default)
    p.add_argument("--resume", action="store_true",
                   help="continue the run in RUN_DIR and refuse to start a new one (without it, "
                        "a RUN_DIR holding a run is continued too)")
    p.add_argument("--render", metavar="NAME.jaxexport",
                   help="run a render's step instead of the Python one (its recipe, R, N, S, "
                        "precision and schedule)")
    p.add_argument("--init-from", metavar="FILE", help="start from a timm state dict (.pth, "
                   ".safetensors), e.g. to fine-tune; a classifier of another width is "
                   "initialised afresh")
    p.add_argument("--stall-timeout", type=float, metavar="S",
                   help=f"end the run (exit {ExitStatus.INTERNAL:d}, one line) when it makes "
                        "no progress for S seconds — a hung collective, a stuck loader —, so "
                        "that 'launch --max-restarts' restarts it (default: max(10 x the median "
                        "time between metrics read-backs, 300); docs/training.md#stalls)")
    p.add_argument("--control", choices=sorted(CONTROLS), default=default["control"],
                   help="train a deliberately broken step: a negative control, which a "
                        "comparison with a correct run must catch (not 'unsynced', whose "
                        "replicas keep their own statistics; docs/training.md#negative-controls)")
    p.add_argument("--fast-compile", action="store_true",
                   help="compile at XLA -O0: the same numerics, half the compile, a slower "
                        "step (for short runs)")
    p.add_argument("--progress-every", type=float, default=PROGRESS_EVERY_S, metavar="S",
                   help="where stderr is not a terminal (a log, nohup, SLURM), print a plain "
                        "progress line — step, loss, lr, img/s, ETA — on stdout every S "
                        f"seconds instead of the bar (default {PROGRESS_EVERY_S:g}; 0: none)")
    options.cluster(p)



def _data_options(p, default: dict) -> None:
    """What the run reads: --data, --val-split, --check-images."""
    p.add_argument("--data", default=default["data"], metavar="DIR|digits",
                   help=f"an image folder, or the embedded digits: 'digits', or 'builtin:digits' "
                        f"where a ./digits exists too (default {default['data']})")
    p.add_argument("--val-split", type=float, metavar="F",
                   help="a folder with train/ only: hold out the share F of its images (by a "
                        "hash of each path: the same images everywhere) as the val split")
    p.add_argument("--check-images", choices=CHECKS, default=default["check_images"],
                   help="what is read of every image before the first step, to leave out "
                        "those that do not read (named in RUN_DIR/skipped.txt): "
                        + "; ".join(f"'{k}', {v}" for k, v in CHECKS.items())
                        + f" (default {default['check_images']})")


def _loader_options(p, default: dict) -> None:
    """How an image folder is read and augmented: --workers, --loader, the augmentations."""
    p.add_argument("--workers", type=options.int_in(0, MAX_WORKERS + 1),
                   default=default["workers"], metavar="W",
                   help=f"loader processes decoding and augmenting images (default "
                        f"{default['workers']}: one background thread); never changes the "
                        f"result")
    p.add_argument("--loader", choices=LOADERS, default=default["loader"],
                   help="who decodes and augments an image folder: 'pillow' (timm's transforms, "
                        "pixel for pixel, on the host) or 'device' (nvImageCodec decodes the "
                        "crops, on the GPU when JAX has one, else on the host; the resize and "
                        "RandAugment run on the devices, in "
                        "the step's prepare program; the [nvimgcodec] extra; "
                        "docs/training.md#device-loader). Default "
                        f"{default['loader']}")
    p.add_argument("--randaugment", type=options.int_in(0, 31), metavar="M",
                   help="RandAugment rand-mM-mstd0.5-inc1 on an image folder (default: the "
                        "recipe's; none for a grammar name)")
    for kind in ("mixup", "cutmix"):
        p.add_argument(f"--{kind}", type=float, metavar="ALPHA",
                       help=f"{kind}'s Beta alpha on an image folder, 0 off (default: the "
                            "recipe's); with both on, one of the two per batch")


def run(args, parser) -> int:
    # lazy, the CLI's reason: the API and the loop (orbax, the step), past 'train --help's needs
    from twinstep import api
    from twinstep.training.loop import NonFinite

    config = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
              if f.name not in ("recipe", "out")}
    cfg = TrainConfig(args.recipe, args.out, **config)  # refuse before JAX starts
    options.join(args, cfg.replicas)
    primary = cluster.is_primary()  # process 0 shows the progress and the result
    if primary:
        print(cfg.summary(), flush=True)
    with progress(cfg.steps, quiet=not primary, every_s=args.progress_every) as update:
        try:
            result = api.train(cfg, progress=update,
                               warn=lambda text: print(f"warning: {text}", file=sys.stderr))
        except NonFinite as e:
            print(f"twinstep train: {e}", file=sys.stderr)
            return ExitStatus.INTERNAL
    if not primary:
        return ExitStatus.SUCCESS
    for weights, m in result.items():
        print(f"val ({weights}): top-1 {m['top1']:.2%} (95% interval {m['top1_low']:.1%}–"
              f"{m['top1_high']:.1%}), top-5 {m['top5']:.2%}, loss {m['loss']:.4f}")
    print(f"run: {args.out} (metrics.jsonl, skipped.txt, tb/, correct/, checkpoints/)")
    return ExitStatus.SUCCESS


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}"


def plain_progress(total: int, every_s: float, out=None, clock=time.monotonic):
    """``update(step, metrics)`` that prints a plain line — step, epoch, loss, lr, img/s, ETA
    — to ``out`` (stdout) at the first step, then at most every ``every_s`` seconds, and at the
    last step: progress in a log, where no bar can draw. ``every_s`` 0: never."""
    seen = {"t0": None, "step0": None, "last": -math.inf}

    def update(step: int, m: dict) -> None:
        now = clock()
        if every_s <= 0 or "phase" in m:
            return
        if seen["t0"] is None:
            seen.update(t0=now, step0=step)
        if now - seen["last"] < every_s and step != total:
            return
        seen["last"] = now
        rate = (step - seen["step0"]) / max(now - seen["t0"], 1e-9)
        eta = (total - step) / rate if rate > 0 else math.inf
        # img/s counts from the first step's end: none yet at that step ("-")
        speed = f"{m['img_per_s']:.0f}" if m["img_per_s"] > 0 else "-"
        print(f"step {step}/{total}  epoch {m['epoch']:.2f}  loss {m['loss']:.4g}  "
              f"lr {m['lr']:.3g}  {speed} img/s  ETA {_eta(eta)}",
              file=out or sys.stdout, flush=True)

    return update


@contextlib.contextmanager
def progress(total: int, quiet: bool = False, every_s: float = PROGRESS_EVERY_S):
    """A progress bar on stderr — step, epoch, loss, lr, img/s, ETA, the last top-1 and what
    runs between steps (an evaluation) — yielding ``update(step, metrics)``; where stderr is not
    a terminal, a plain line on stdout every ``every_s`` seconds instead (`plain_progress`);
    nothing when ``quiet``."""
    console = Console(stderr=True)
    if quiet:
        yield lambda step, metrics: None
        return
    if not console.is_terminal:
        yield plain_progress(total, every_s)
        return
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[text]}"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=total, text="compiling")

        def update(step, m):
            raw = m.get("eval", {}).get("raw")
            text = (f"epoch {m['epoch']:.2f}  loss {m['loss']:.3f}  lr {m['lr']:.2e}  "
                    f"{m['img_per_s']:.0f} img/s" + (
                        f"  val top-1 {raw['top1']:.1%} ({raw['top1_low']:.1%}–"
                        f"{raw['top1_high']:.1%})" if raw else "") + (
                    f"  {m['phase']}..." if "phase" in m else ""))
            bar.update(task, completed=step, text=text)

        yield update
