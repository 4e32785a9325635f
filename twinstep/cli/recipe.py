"""``twinstep recipe NAME``: decode a recipe name or preset and print every field
(docs/recipes.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from rich.table import Table

from twinstep import recipes
from twinstep.cli import options
from twinstep.cli.console import report_console
from twinstep.data.transforms import CROP_PCT
from twinstep.errors import ExitStatus
from twinstep.optimizers import OPTIMIZERS


def add(p) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Decode a recipe name into the training configuration it stands for.\n\n"
        f"Grammar: {recipes.GRAMMAR}\n"
        "Tokens go in this order, each at most once; each is described in docs/recipes.md. The "
        "replica count R is\nnot in the name.\n\nPresets (timm's recipes; dp on R = 8):\n"
        + "\n".join(f"  {k:<12} {v.name}" for k, v in recipes.PRESETS.items())
        + "\n\n" + options.exits({ExitStatus.SUCCESS: "a valid name",
                                  ExitStatus.USAGE: "a bad one (the error names the token)"}))
    p.add_argument("name", help="a grammar name, e.g. resnet50in160_lambaccdp4x128wxclipbcebf16, "
                                "or a preset")
    options.replicas(p, None, "also print the effective batch R*N*k", "R")
    options.json_print(p)


def run(args, parser) -> int:
    r = recipes.parse(args.name)
    if args.json:
        d = {"name": r.name, **dataclasses.asdict(r), "train_res": r.train_res,
             "test_res": r.test_res, "loss": r.loss,
             "effective_weight_decay": r.effective_weight_decay,
             "effective_label_smoothing": r.effective_label_smoothing}
        if args.replicas is not None:
            d["replicas"] = args.replicas
            d["effective_batch"] = r.effective_batch(args.replicas)
        print(json.dumps(d))
        return ExitStatus.SUCCESS
    table = Table(title=args.name if args.name == r.name else f"{args.name} = {r.name}")
    table.add_column("field")
    table.add_column("value")
    for label, value in describe(r, args.replicas):
        table.add_row(label, value)
    report_console().print(table)
    return ExitStatus.SUCCESS


def describe(recipe: recipes.Recipe, replicas: int | None = None) -> list[tuple[str, str]]:
    """(field, value) rows for printing: every field, the canonical name, and R·N·k when R is
    given."""
    r = recipe

    def yes(flag: bool, text: str) -> str:
        return text if flag else "no"

    wd = r.effective_weight_decay
    ls = r.effective_label_smoothing
    rows = [
        ("name", r.name),
        ("net", r.net),
        ("dataset", f"{r.dataset or '-'} ({recipes.DATASETS[r.dataset]})"),
        ("res", f"{r.train_res}" + (" (the net's default)" if r.res is None else "")),
        ("eval_res", f"{r.test_res}" + (" (the train res)" if r.eval_res is None else "")
         + f", centre crop {CROP_PCT:g}"),
        ("optimizer", f"{r.optimizer} ({OPTIMIZERS[r.optimizer].text})"),
        ("lr", f"{r.lr:g}" + (" (the optimizer's default)"
                               if r.lr == OPTIMIZERS[r.optimizer].lr else "")),
        ("weight_decay", f"{wd:g}" + (" (the optimizer's default)" if r.weight_decay is None
                                      else "")),
        ("wx", yes(r.wx, "yes: no weight decay on 1-D tensors")),
        ("accum", f"k = {r.accum}" + (" micro-steps per optimizer step" if r.accum > 1 else "")),
        ("dp", yes(r.dp, "yes: data-parallel, synchronised BatchNorm")),
        ("batch", f"N = {r.batch} per replica"),
    ]
    if replicas is not None:
        rows.append(("effective batch", f"R·N·k = {replicas}·{r.batch}·{r.accum} = "
                                        f"{r.effective_batch(replicas)}"))
    rows += [
        ("clip", yes(r.clip, "yes: global norm 1.0 of the averaged gradient")),
        ("drop", yes(r.drop, "yes: stochastic depth")),
        ("drop_path_rate", f"{r.drop_path_rate:g}" + ("" if r.drop else " (unused)")),
        ("dropout", yes(r.dropout, "yes: classifier dropout")),
        ("dropout_rate", f"{r.dropout_rate:g}" + ("" if r.dropout else " (unused)")),
        ("bce", "yes: BCE-with-logits" if r.bce else "no: softmax CE"),
        ("bce_threshold", "none" if r.bce_threshold is None else f"{r.bce_threshold:g}"),
        ("label_smoothing", f"{ls:g}" + (" (the loss's default)" if r.label_smoothing is None
                                         else "")),
        ("bf16", "yes: bf16 conv operands and results" if r.bf16 else "no: f32"),
        ("ema", yes(r.ema, "yes: EMA of weights and running statistics")),
        ("ema_decay", f"{r.ema_decay:g}" + ("" if r.ema else " (unused)")),
        ("ema_warmup", r.ema_warmup + ("" if r.ema else " (unused)")),
        ("warmup_steps", f"{r.warmup_steps:,} (linear)"),
        ("total_steps", f"{r.total_steps:,}"),
        ("schedule", "step: lr x decay_rate every decay_steps steps from step 0"
         if r.schedule == "step" else "cosine: to 0 at total_steps"),
        ("decay_steps", "-" if r.decay_steps is None else f"{r.decay_steps:g}"),
        ("decay_rate", "-" if r.decay_rate is None else f"{r.decay_rate:g}"),
        ("epochs", "-" if r.epochs is None else str(r.epochs)),
        ("warmup_lr", f"{r.warmup_lr:g}"),
        ("randaugment", "-" if r.randaugment is None else f"rand-m{r.randaugment}-mstd0.5-inc1"),
        ("mixup", f"alpha {r.mixup:g}" if r.mixup else "-"),
        ("cutmix", f"alpha {r.cutmix:g}" if r.cutmix else "-"),
        ("repeated_aug", "-" if r.repeated_aug == 1
         else f"{r.repeated_aug} (recorded; twinstep train does not repeat)"),
    ]
    return rows
