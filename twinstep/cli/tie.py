"""``twinstep tie``: the R-replica step against the single-device step at R·N (docs/tie.md).

One verb, three forms, told apart by what is given: ``tie NET`` ties one gradient step,
``tie NET --recipe NAME`` (or ``tie --recipe NAME``) whole training steps of a recipe, ``tie
--render PATH`` a render read back (its manifest fixes every setting of the step, so the flags of
the "the step" group are refused with it).
"""

from __future__ import annotations

import argparse
import os
import time

from rich.table import Table

from twinstep.checking import picture
from twinstep.checking.bounds import EXIT_CODES
from twinstep.checking.tie import PRECISION_DEFAULTS, STATES, TieConfig
from twinstep.cli import options
from twinstep.cli.console import mark, report_console, status, verdict_line
from twinstep.collectives import CONTROLS
from twinstep.errors import UsageError
from twinstep.nets import NETS
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.processes import cluster, disk
from twinstep.rendering import reader

STEP_GROUP = "the step"  # the settings a render's manifest fixes


def add(p) -> None:
    default = options.defaults(TieConfig)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Run the data-parallel step (R replicas of N, every BatchNorm synchronised, every "
        "gradient all-reduced\nby its mean) and the single-device step at R*N from the same "
        "parameters, and hold every parameter\ngradient, BN statistic, the logits, the loss "
        "and the running statistics to per-tensor bounds\n(docs/tie.md). NET ties one gradient "
        "step; --recipe whole training steps (docs/tie.md#whole-steps);\n--render a render "
        "from 'twinstep render' (docs/renders.md).\n\n"
        + options.exits({EXIT_CODES["tied"]: "tied", EXIT_CODES["NOT tied"]: "not tied",
                         EXIT_CODES["inconclusive"]: "inconclusive (within every bound, but a "
                                                     "bound too loose to see a 1e-3 bug)"})
        + "\n\nEach control injects a classic bug and must make the tie fail (R >= 2):\n"
        + "\n".join(f"  {k:<16} {v}" for k, v in CONTROLS.items()))
    p.add_argument("net", choices=sorted(NETS), nargs="?",
                   help="the network (omitted with --render: the manifest names it)")
    step = p.add_argument_group(STEP_GROUP, "what is tied; a render's manifest fixes all of it")
    options.replicas(step, None, f"replicas R (default {default['replicas']})", "R")
    options.count(step, "--batch", None, "examples per replica (default: "
                  + ", ".join(f"{v['batch']} in {k}" for k, v in PRECISION_DEFAULTS.items())
                  + "; the recipe's N)", metavar="N")
    options.count(step, "--res", None, f"input resolution (default {default['res']})")
    options.count(step, "--classes", None, f"classes K (default {default['classes']})")
    step.add_argument("--loss", choices=["ce", "bce"], help="default ce, or the recipe's loss")
    step.add_argument("--precision", choices=PRECISIONS,
                      help=f"default {default['precision']} (docs/tie.md#f32, #bf16)")
    step.add_argument("--state", choices=STATES,
                      help="the parameters both programs start from: random-bn (every BN far "
                           "from the identity) or near-init (timm's initialisation, nudged); "
                           "default: "
                           + ", ".join(f"{v['state']} in {k}"
                                       for k, v in PRECISION_DEFAULTS.items()))
    step.add_argument("--control", choices=sorted(CONTROLS), help="a negative control")
    options.levers(step, "both programs")
    step.add_argument("--recipe", metavar="NAME",
                      help="tie whole training steps of this recipe (a name or preset, "
                           "'twinstep recipe'), f64")
    p.add_argument("--render", metavar="PATH",
                   help="tie a render instead of the Python step: NAME.jaxexport (XLA) or "
                        "NAME.vmfb (IREE) from 'twinstep render --precision f64'")
    options.count(p, "--steps", None, "whole steps to tie with --recipe or --render (default "
                                      "3)", metavar="S")
    options.seed(p)
    p.add_argument("--shift", action=argparse.BooleanOptionalAction, default=True,
                   help="offset replica r's inputs by r, so Chan's correction is O(1) "
                        "(default on)")
    p.add_argument("--fast-compile", action="store_true",
                   help="compile at XLA -O0: the same numerics, about half the compile time, "
                        "a slower run (docs/tie.md#fast-compile)")
    p.add_argument("--all", action="store_true",
                   help="one row per tensor (default: the worst few, and counts)")
    options.json_out(p, "write the full report as JSON (docs/tie.md#json)")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the report: every "
                   "parameter's error and bound along the net, the BN sites and the loss, the "
                   "verdict in the title; with --recipe or --render every state tensor's error "
                   "over its bound at each step (docs/tie.md#the-picture)")
    options.cluster(p)


def _fixed_by_render(parser) -> list[str]:
    """The dests of the "the step" group: what a render's manifest fixes."""
    group = next(g for g in parser._action_groups if g.title == STEP_GROUP)
    return [a.dest for a in group._group_actions]


def run(args, parser) -> int:
    from twinstep import api  # the CLI: every command's machinery, which --help need not load

    fixed = _fixed_by_render(parser)
    given = {k: getattr(args, k) for k in fixed if getattr(args, k) is not None}
    if args.render is not None:
        if not args.render.endswith(reader.SUFFIXES):
            parser.error("--render takes a NAME.jaxexport or NAME.vmfb file from 'twinstep "
                         "render'")
        if args.net is not None or given:
            drop = (["net"] if args.net is not None else []) + list(given)
            parser.error(f"--render takes the configuration from its manifest; drop "
                         f"{', '.join(drop)}")
    elif args.net is None and args.recipe is None:
        parser.error("the net is required (or --recipe NAME, or --render PATH)")
    elif args.steps is not None and args.recipe is None:
        parser.error("--steps needs --recipe or --render (whole training steps)")
    if args.plot is not None:
        if not args.plot.lower().endswith(".png"):
            raise UsageError(f"--plot {args.plot}: a .png file name")
        disk.check_writable_file(args.plot, "--plot")
    config = {**given, "seed": args.seed, "shift": args.shift, "fast_compile": args.fast_compile}
    config["levers"] = options.chosen_levers(config)
    options.join(args, reader.read_manifest(args.render)["replicas"] if args.render
                 else config.get("replicas", TieConfig.replicas))
    primary = cluster.is_primary()  # only process 0 reports
    t0 = time.perf_counter()
    with status("preparing the tie", quiet=not primary) as say:
        if args.render is not None:
            result = api.tie_render(args.render, args.steps, seed=args.seed, shift=args.shift,
                                    fast_compile=args.fast_compile, progress=say)
        elif args.recipe is not None:
            result = api.tie_steps(config.pop("recipe"), args.steps, progress=say,
                                   net=args.net, **config)
        else:
            result = api.tie(args.net, progress=say, **config)
    seconds = time.perf_counter() - t0
    if primary:
        if args.render is None and args.recipe is None:
            show_step(result, show_all=args.all, seconds=seconds)
        else:
            show_steps(result, show_all=args.all, seconds=seconds)
        if args.render is not None:
            sha = reader.read_manifest(args.render)["files"][os.path.basename(args.render)]
            print(f"render: {args.render} (sha256 {sha['sha256'][:16]}...)")
        options.write_json(args.json, result.to_json())
        if args.plot is not None:
            print(f"picture: {picture.draw(result.to_json(), args.plot)}")
    # every process ends with process 0, once it has reported (the launcher stops the rest of
    # a run at its first non-zero exit)
    cluster.barrier("tie reported")
    return EXIT_CODES[result.status]


def show_step(report, show_all: bool = False, seconds: float | None = None,
              console=None) -> None:
    """A one-step tie: the worst parameter gradients and BN sites, the loss, the verdict."""
    console = console or report_console()
    c = report.config
    console.print(f"[bold]{c.net}[/]: R = {c.replicas} replicas x N = {c.batch} vs one device at "
                  f"{c.replicas * c.batch}; {c.res}², K = {c.classes}, loss {c.loss}, "
                  f"{c.precision}, shift {'on' if c.shift else 'off'}, control {c.control}"
                  + "".join(f", {d}" for d in [c.levers.describe()] if d))
    rows = sorted(report.parameters, key=lambda p: -p["rel_err"] / max(p["bound"], 1e-300))
    shown = report.parameters if show_all else rows[:10]
    table = Table(title="parameter gradients: mean over replicas vs single device" +
                  ("" if show_all else f" (worst 10 of {len(rows)}; --all for every row)"))
    table.add_column("parameter", no_wrap=True)
    table.add_column("shape")
    for col in ("rel err", "max abs", "bound", "sensitivity", ""):
        table.add_column(col, justify="right")
    for p in shown:
        table.add_row(p["name"], "x".join(map(str, p["shape"])), f"{p['rel_err']:.1e}",
                      f"{p['abs_err']:.1e}", f"{p['bound']:.1e}", f"{p['sensitivity']:.1e}",
                      mark(p["ok"]))
    console.print(table)

    sites = sorted(report.bn_sites, key=lambda b: -max(b["mean_rel_err"], b["var_rel_err"]))
    bn = Table(title="forward half: BN sites' global statistics" +
               ("" if show_all else f" (worst 5 of {len(sites)})"))
    bn.add_column("BN site", no_wrap=True)
    for col in ("mean rel err", "var rel err", "bound", ""):
        bn.add_column(col, justify="right")
    for b in sites if show_all else sites[:5]:
        bn.add_row(b["name"], f"{b['mean_rel_err']:.1e}", f"{b['var_rel_err']:.1e}",
                   f"{b['bound']:.1e}", mark(b["ok"]))
    console.print(bn)
    lo = report.loss
    console.print(f"loss: replicas {lo['replica']:.12g}, single {lo['single']:.12g} "
                  f"(rel err {lo['rel_err']:.1e}); logits rel err {report.logits_rel_err:.1e}; "
                  f"running statistics rel err {report.buffers_rel_err:.1e}; replicas "
                  f"{'agree' if report.replicas_agree else '[red]DISAGREE[/]'} on statistics "
                  f"and buffers")
    verdict_line(console, report.status, report.verdict(), seconds)


def show_steps(report, show_all: bool = False, seconds=None, console=None) -> None:
    """A tie over whole steps: each step's worst state tensors and loss, the verdict."""
    console = console or report_console()
    c = report.config
    console.print(f"[bold]{c.net}[/] recipe {c.recipe}: R = {c.replicas} x N = {c.batch} vs one "
                  f"device at {c.replicas * c.batch}; {c.res}², K = {c.classes}, {c.precision}, "
                  f"control {c.control}")
    for s in report.steps:
        rows = sorted(s["rows"], key=lambda r: -r["rel_err"])
        table = Table(title=f"after step {s['step']}: state tensors" +
                      ("" if show_all else f" (worst 5 of {len(rows)})"))
        for col, j in (("tensor", "left"), ("shape", "left"), ("rel err", "right"),
                       ("bound", "right"), ("sensitivity", "right"), ("", "right")):
            table.add_column(col, justify=j, no_wrap=col == "tensor")
        for r in rows if show_all else rows[:5]:
            table.add_row(r["name"], "x".join(map(str, r["shape"])), f"{r['rel_err']:.1e}",
                          f"{r['bound']:.1e}", f"{r['sensitivity']:.1e}", mark(r["ok"]))
        console.print(table)
        lo = s["loss"]
        console.print(f"loss: replicas {lo['replica']:.12g}, single {lo['single']:.12g} "
                      f"(rel err {lo['rel_err']:.1e})")
    verdict_line(console, report.status, report.verdict(), seconds)
