"""The ``twinstep`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from twinstep import __version__


def _enable_x64():
    import jax

    jax.config.update("jax_enable_x64", True)


TIE_DEFAULTS: dict = {}  # TieConfig's defaults, read when the parser is built


def cmd_certify(args) -> int:
    """Certify the op library in float64: VJPs, data-parallel facts, negative controls."""
    _enable_x64()
    from twinstep import dp

    dp.ensure_devices(max(args.replicas))
    from twinstep import certify

    t0 = time.perf_counter()
    report = certify.run(args.replicas, seed=args.seed)
    certify.print_report(report, time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def cmd_info(args) -> int:
    """Counts and forward GMACs of a network."""
    from rich.console import Console
    from rich.table import Table

    from twinstep import info
    from twinstep.nets import get_net

    d = info.describe(get_net(args.net), args.res, args.classes)
    if args.json:
        print(json.dumps(d))
        return 0
    table = Table(title=f"{d['net']} (timm {d['timm']}), K = {d['classes']}, {d['res']}²")
    table.add_column("")
    table.add_column("", justify="right")
    for label, key in (("parameter tensors", "tensors"), ("parameter scalars", "scalars"),
                       ("BatchNorm layers", "bn_layers"), ("1-D tensors (no weight decay)",
                                                           "one_d_tensors"),
                       ("running-stat buffers", "buffers")):
        table.add_row(label, f"{d[key]:,}")
    table.add_row("forward GMACs (convs + classifier)", f"{d['gmacs']:.2f}")
    Console().print(table)
    return 0


def cmd_recipe(args) -> int:
    """Decode a recipe name (SPEC §6) and print every field."""

    from rich.console import Console
    from rich.table import Table

    from twinstep import recipe

    try:
        r = recipe.parse(args.name)
    except recipe.RecipeError as e:
        print(f"twinstep: {e}", file=sys.stderr)
        return 2
    if args.json:
        d = {"name": r.name, **dataclasses.asdict(r), "train_res": r.train_res, "loss": r.loss,
             "effective_weight_decay": r.effective_weight_decay,
             "effective_label_smoothing": r.effective_label_smoothing}
        if args.replicas is not None:
            d["replicas"] = args.replicas
            d["effective_batch"] = r.effective_batch(args.replicas)
        print(json.dumps(d))
        return 0
    title = args.name if args.name == r.name else f"{args.name} = {r.name}"
    table = Table(title=title)
    table.add_column("field")
    table.add_column("value")
    for label, value in recipe.describe(r, args.replicas):
        table.add_row(label, value)
    Console().print(table)
    return 0


def cmd_parity(args) -> int:
    """One train step and an eval forward against timm + torch autograd, same weights."""
    if args.precision == "f64":
        _enable_x64()
    from rich.console import Console

    from twinstep import parity
    from twinstep.nets import get_net

    net = get_net(args.net)
    try:
        r = parity.run_parity(net, args.res, args.batch, args.precision, args.loss, args.classes,
                              args.seed)
    except parity.OracleMissing as e:
        print(f"twinstep parity: {e}", file=sys.stderr)
        return 2
    console = Console()
    p = r.precision
    console.print(f"{net.NAME} vs timm {net.TIMM_NAME}: {args.res}², batch {args.batch}, "
                  f"K = {args.classes}, {p}, loss {r.loss}")

    def line(label, err, bound):
        mark = "" if bound is None else ("[green]ok[/]" if err <= bound else "[red]FAIL[/]")
        lim = "reported only" if bound is None else f"bound {bound:.0e}"
        console.print(f"  {label:<34} {err:.2e}  ({lim}) {mark}")

    line("logits, train mode (rel. max)", r.logits_train_err, parity.LOGITS_BOUND[p])
    line("logits, eval mode (rel. max)", r.logits_eval_err, parity.LOGITS_BOUND[p])
    name, worst = r.worst_grad
    line(f"worst of {len(r.grad_errs)} gradients", worst, parity.GRAD_BOUND[p])
    console.print(f"    ({name})")
    line("running buffers after one step", r.buffer_err, parity.BUFFER_BOUND[p])
    console.print("[green]parity holds[/]" if r.ok else "[red]parity FAILS[/]")
    return 0 if r.ok else 1


def cmd_tie(args) -> int:
    """The R-replica step against the single-device step at R*N, parameter by parameter."""
    if args.precision in ("f64", "bf16"):  # bf16 ties run f64 around the bf16 convs
        _enable_x64()
    from twinstep import dp

    dp.ensure_devices(args.replicas)
    from twinstep import tie

    cfg = tie.TieConfig(args.net, args.replicas, args.batch, args.res, args.classes, args.loss,
                        args.precision, args.seed, args.shift, args.control,
                        args.fast_compile, args.recipe and args.recipe.name)
    t0 = time.perf_counter()
    if args.recipe:
        report = tie.run_steps_tie(cfg, args.recipe, args.steps)
        tie.print_steps_report(report, show_all=args.all, seconds=time.perf_counter() - t0)
    else:
        report = tie.run_tie(cfg)
        tie.print_report(report, show_all=args.all, seconds=time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def cmd_render(args) -> int:
    """Export recipes' whole train steps for an R-device mesh: NAME.mlir, .jaxexport, .json."""
    from rich.console import Console
    from rich.table import Table

    from twinstep import render

    names = render.all_names() if args.all else [args.name]
    res = args.res or (render.SMALL_RES if args.all else None)
    table = Table(title=f"renders for R = {args.replicas} in {args.out}",
                  caption="collectives per micro-step (SPEC §3's reference: 3 per BN + 1 per "
                          "parameter tensor; +1 for the loss)")
    for col in ("name", "N x k", "collectives (ref.)", "convs", "MiB", "s"):
        table.add_column(col, justify="left" if col == "name" else "right",
                         overflow="fold")
    console = Console()
    for name in names:
        cfg = render.RenderConfig(name, args.replicas, res, args.classes, args.precision,
                                  args.platform, args.control)
        t0 = time.perf_counter()
        try:
            r = render.render(cfg)
            paths = render.write(r, args.out)
        except (render.RenderError, OSError) as e:
            print(f"twinstep render: {e}", file=sys.stderr)
            return 2
        m = r.manifest
        c = m["collectives"]
        table.add_row(m["name"], f"{m['batch']} x {m['accum']}",
                      f"{c['per_micro_step']} ({c['spec_reference']})",
                      f"{m['convolutions']['count']} {'/'.join(m['convolutions']['dtypes'])}",
                      f"{m['files'][os.path.basename(paths['.jaxexport'])]['bytes'] / 2**20:.1f}",
                      f"{time.perf_counter() - t0:.0f}")
    console.print(table)
    return 0


def cmd_tie_artifact(args) -> int:
    """Tie a render's deserialized artifact against the single-device Python step."""
    _enable_x64()

    from twinstep import dp, render

    try:
        with open(args.artifact[:-len(".jaxexport")] + ".json") as f:
            replicas = json.load(f)["replicas"]
    except (OSError, KeyError, ValueError) as e:
        print(f"twinstep tie: cannot read the artifact's manifest: {e}", file=sys.stderr)
        return 2
    dp.ensure_devices(replicas)
    from twinstep import recipe as recipes
    from twinstep import tie

    try:
        exported, m = render.load(args.artifact)
        r = recipes.parse(m["name"])
        if m["precision"] != "f64":
            raise render.RenderError(
                f"{args.artifact} is a {m['precision']} render; the tie is exact in f64: render "
                f"it again with --precision f64 (the same program in f64)")
        if m["platform"] != render.local_platform():
            raise render.RenderError(f"{args.artifact} was rendered for {m['platform']}; this "
                                     f"process runs {render.local_platform()}")
    except (render.RenderError, recipes.RecipeError, OSError) as e:
        print(f"twinstep tie: {e}", file=sys.stderr)
        return 2
    cfg = tie.TieConfig(m["net"], m["replicas"], m["batch"], m["res"], m["classes"], r.loss,
                        "f64", args.seed, args.shift, "none", args.fast_compile, m["name"])
    t0 = time.perf_counter()
    try:
        report = tie.run_steps_tie(cfg, r, args.steps,
                                   replica=render.artifact_step(exported, m, args.fast_compile,
                                                                donate=True))
    except render.RenderError as e:  # its signature is not this step's
        print(f"twinstep tie: {e}", file=sys.stderr)
        return 2
    tie.print_steps_report(report, show_all=args.all, seconds=time.perf_counter() - t0)
    print(f"artifact: {args.artifact} (sha256 "
          f"{m['files'][os.path.basename(args.artifact)]['sha256'][:16]}...)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report.to_json(), "artifact": args.artifact}, f, indent=1)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="twinstep",
        description="Data-parallel ResNet-50 and MobileNetV4-Conv-M with synchronised BatchNorm, "
                    "checked parameter by parameter against the single-device step at R*N.",
        epilog="Run 'twinstep COMMAND --help' for a command's options.")
    p.add_argument("--version", action="version", version=f"twinstep {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    _add_certify(sub)
    _add_info(sub)
    _add_recipe(sub)
    _add_parity(sub)
    _add_tie(sub)
    _add_render(sub)
    return p


def _add_certify(sub) -> None:
    """The certify command: its arguments and handler."""
    c = sub.add_parser(
        "certify", help="certify the op library's hand-written VJPs (float64)",
        description="Check every op's hand-written VJP against jax.vjp (<= 1e-12) and central "
                    "finite differences (<= 1e-6); check SPEC §1's four data-parallel facts "
                    "(sharding, collectives, homogeneity, divisor) under jax.shard_map on R "
                    "virtual devices with shifted shards; and check that each negative control "
                    "(unsynced BN, shard-statistics gamma, sum for mean, wrong divisor, the "
                    "E[x^2]-E[x]^2 variance exchange) is caught. Exit 0 when all hold.")
    c.add_argument("--replicas", type=int, nargs="+", default=[2, 4], metavar="R",
                   help="replica counts for the data-parallel facts (default: 2 4)")
    c.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    c.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    c.set_defaults(func=cmd_certify)


def _add_info(sub) -> None:
    """The info command: its arguments and handler."""
    from twinstep.nets import NETS

    i = sub.add_parser("info", help="tensor, scalar and BN counts and forward GMACs of a net",
                       description="Counts of a network's parameters (timm's names and shapes), "
                                   "its BatchNorm layers and 1-D tensors, and its forward "
                                   "multiply-accumulates at one resolution (batch 1).")
    i.add_argument("net", choices=sorted(NETS))
    i.add_argument("--res", type=int, default=224, help="input resolution (default 224)")
    i.add_argument("--classes", type=int, default=1000, help="classes K (default 1000)")
    i.add_argument("--json", action="store_true", help="print JSON instead of a table")
    i.set_defaults(func=cmd_info)


def _add_recipe(sub) -> None:
    """The recipe command: its arguments and handler."""
    from twinstep import recipe

    r = sub.add_parser(
        "recipe", help="decode a recipe name (or a preset) and print every field",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode a recipe name into the training configuration it stands for.\n\n"
                    f"Grammar: {recipe.GRAMMAR}\n"
                    "  net resnet50 | mnv4; data in (ImageNet-1k); res: the train resolution "
                    "(default: the net's)\n"
                    "  ema: EMA of weights; opt lamb | adam (AdamW) | mom (SGD, momentum) | "
                    "sgd (SGD, Nesterov)\n"
                    "  acc + <k>x: accumulate k >= 2 micro-steps ('acc' alone: AdamW); "
                    "dp: data-parallel, sync-BN\n"
                    "  <N>: batch per replica (default 32); wx: no decay on 1-D tensors; "
                    "clip: global norm 1.0\n"
                    "  drop: stochastic depth; do: classifier dropout; bce: BCE loss; "
                    "ls<a>/wd<d>: label smoothing\n"
                    "  and weight decay, point after the first digit (wd005 = 0.05); "
                    "bf16: bf16 convs\n"
                    "Tokens go in this order, each at most once. The replica count R is not in "
                    "the name.\n\nPresets (SPEC §6, dp on R = 8):\n"
                    + "\n".join(f"  {k:<12} {v.name}" for k, v in recipe.PRESETS.items())
                    + "\n\nExit 0 on a valid name, 2 on a bad one (the error names the token).")
    r.add_argument("name", help="a grammar name, e.g. resnet50in160_lambaccdp4x128wxclipbcebf16, "
                                "or a preset")
    r.add_argument("--replicas", type=int, metavar="R",
                   help="also print the effective batch R*N*k")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.set_defaults(func=cmd_recipe)


def _add_parity(sub) -> None:
    """The parity command: its arguments and handler."""
    from twinstep.nets import NETS

    q = sub.add_parser(
        "parity", help="the net against timm + torch autograd, same random weights",
        description="Build timm's model with twinstep's random weights (BN gamma, beta and "
                    "running statistics randomised too), run one train step and one eval "
                    "forward in both, and print the max error of the logits, the worst "
                    "norm-relative error over every parameter gradient, and the running "
                    "buffers' error. Bounds: logits 1e-9 (f64) / 1e-4 (f32); gradients 1e-8 "
                    "and buffers 1e-9 in f64 (reported only in f32). Exit 0 within bounds, 1 "
                    "outside, 2 on bad usage or without the [oracle] extra (torch, timm).")
    q.add_argument("net", choices=sorted(NETS))
    q.add_argument("--res", type=int, default=64, help="input resolution (default 64)")
    q.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    q.add_argument("--precision", choices=["f64", "f32"], default="f64")
    q.add_argument("--loss", choices=["ce", "bce"], default="ce")
    q.add_argument("--classes", type=int, default=10, help="classes K (default 10)")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=cmd_parity)


def _add_tie(sub) -> None:
    """The tie command: its arguments and handler."""
    from twinstep.collectives import CONTROLS
    from twinstep.nets import NETS
    from twinstep.tie import TieConfig

    TIE_DEFAULTS.update({f.name: f.default for f in dataclasses.fields(TieConfig)})
    t = sub.add_parser(
        "tie", help="the R-replica sync-BN step against the single-device step at R*N",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the data-parallel step (R replicas of batch N, every BatchNorm "
                    "synchronised, every gradient all-reduced by its mean) and the "
                    "single-device step on the concatenated batch R*N, from the same "
                    "parameters, and compare every parameter gradient, every BN site's "
                    "global statistics, the logits, the loss and the running statistics.\n\n"
                    "Bounds: f64 — parameters 1e-10, BN statistics 1e-12 (relative). f32 — "
                    "max(1e-4, 10 x SENSITIVITY) per tensor, SENSITIVITY being what f32 "
                    "arithmetic alone moves the single-device value by (a 1e-6 input "
                    "perturbation or a reordered batch). bf16 — the bf16 policy's rounding "
                    "points (every conv operand and result) with f64 around them, so both "
                    "programs feed every conv the same bf16 operands: conv weight gradients "
                    "elementwise against SPEC §5's partial-sum rounding boundary, everything "
                    "else at the f64 bounds; R must be a power of two.\n\n"
                    "Exit 0 when everything ties, 1 when anything fails, 2 on bad "
                    "usage. Controls inject a classic bug; each must make the tie fail:\n"
                    + "\n".join(f"  {k:<14} {v}" for k, v in CONTROLS.items()))
    t.add_argument("net", choices=sorted(NETS), nargs="?",
                   help="the network (omitted with --artifact: the render names it)")
    t.add_argument("--replicas", type=int, default=None, metavar="R",
                   help=f"replicas (default {TIE_DEFAULTS['replicas']})")
    t.add_argument("--batch", type=int, default=None, metavar="N",
                   help="examples per replica (default 2, or the recipe's N)")
    t.add_argument("--res", type=int, default=None,
                   help=f"input resolution (default {TIE_DEFAULTS['res']})")
    t.add_argument("--classes", type=int, default=None,
                   help=f"classes K (default {TIE_DEFAULTS['classes']})")
    t.add_argument("--loss", choices=["ce", "bce"], default=None,
                   help="default ce, or the recipe's loss")
    t.add_argument("--precision", choices=["f64", "f32", "bf16"], default=None,
                   help=f"default {TIE_DEFAULTS['precision']}")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shift", action=argparse.BooleanOptionalAction, default=True,
                   help="offset replica r's inputs by r, so Chan's correction is O(1) "
                        "(default on)")
    t.add_argument("--control", choices=sorted(CONTROLS), default="none")
    t.add_argument("--all", action="store_true", help="one row per parameter (default: the "
                                                      "worst 10 and counts)")
    t.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    t.add_argument("--recipe", metavar="NAME",
                   help="tie whole training steps of this recipe (a SPEC §6 name or a preset, "
                        "see 'twinstep recipe'): k micro-steps, clip, optimizer, EMA, masks; "
                        "every parameter, optimizer-state, EMA and running-statistics tensor "
                        "compared after every step (f64)")
    t.add_argument("--steps", type=int, default=None, metavar="S",
                   help="whole steps to tie, with --recipe or --artifact (default 3)")
    t.add_argument("--fast-compile", action="store_true",
                   help="compile with XLA at -O0: the same numerics, about half the compile "
                        "time, programs that run 14-18x slower; sooner for mnv4's ties (mostly "
                        "compile), later for resnet50's (mostly running)")
    t.add_argument("--artifact", metavar="PATH",
                   help="tie a render instead of the Python step: PATH is NAME.jaxexport from "
                        "'twinstep render --precision f64' (its NAME.json beside it); the "
                        "deserialized program runs on R devices against the single-device "
                        "Python step, over --steps whole steps. Net, R, N, resolution, classes "
                        "and recipe come from the manifest")
    t.set_defaults(func=cmd_tie)


def _add_render(sub) -> None:
    """The render command: its arguments and handler."""
    from twinstep import render
    from twinstep.collectives import CONTROLS

    d = sub.add_parser(
        "render", help="export a recipe's whole train step to StableHLO (jax.export)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export a recipe's whole train step — forward, loss, backward with its "
                    "sync-BN sites, the gradient collective, k accumulated micro-steps, clip, "
                    "optimizer, EMA — for an R-device mesh with jax.export, lowered from an "
                    "abstract mesh (no R devices needed). Writes into --out:\n"
                    "  NAME.mlir       StableHLO text; every collective's location names its "
                    "sync site\n"
                    "  NAME.jaxexport  the serialized export: runs with no model code "
                    "(twinstep/artifact.py)\n"
                    "  NAME.json       manifest: versions, net, R, N, k, input/output signature,"
                    " parameter\n"
                    "                  counts, collectives by kind and site (count, payload, "
                    "dtypes), convolution\n"
                    "                  dtypes, sha256 of both files\n\n"
                    "Flat signature: inputs = state leaves, xs [k, R*N, S, S, 3], ts [k, R*N, K],"
                    " key uint32[2];\noutputs = state leaves, loss, lr. xs and ts are sharded "
                    "by rows over the mesh.\n\n"
                    "Exit 0 when every render was written, 2 on a bad name or option.")
    d.add_argument("name", nargs="?", help="a recipe name (SPEC §6 grammar) or preset; see "
                                           "'twinstep recipe'")
    d.add_argument("--all", action="store_true",
                   help=f"render SPEC §6's reference names and the presets (at --res "
                        f"{render.SMALL_RES} unless given)")
    d.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="the mesh the step is rendered for (default 1: no collective)")
    d.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    d.add_argument("--res", type=int, default=None,
                   help="input resolution (default: the recipe's train resolution)")
    d.add_argument("--classes", type=int, default=render.DEFAULT_CLASSES,
                   help=f"classes K (default {render.DEFAULT_CLASSES})")
    d.add_argument("--precision", choices=["f64", "f32", "bf16"], default=None,
                   help="default: bf16 with the recipe's bf16 token, else f32; f64 renders are "
                        "the ones 'twinstep tie --artifact' can tie exactly")
    d.add_argument("--platform", choices=["cpu", "cuda", "rocm", "tpu"], default=None,
                   help="the backend to lower for (default: this machine's); depthwise convs "
                        "lower as shifted multiply-adds for cpu, as grouped convolutions "
                        "elsewhere")
    d.add_argument("--control", choices=sorted(CONTROLS), default="none",
                   help="render a deliberately broken step (a negative control that "
                        "'twinstep tie --artifact' must fail; the manifest records it)")
    d.set_defaults(func=cmd_render)


def _check_tie_args(parser, args) -> None:
    """Resolve --recipe into a Recipe and the defaults it sets; reject what cannot be tied."""
    from twinstep.collectives import GRADIENT_ONLY_CONTROLS, MASK_CONTROLS

    if args.recipe is None:
        if args.steps is not None:
            parser.error("--steps needs --recipe (whole training steps)")
        if args.control in MASK_CONTROLS:
            parser.error(f"--control {args.control} needs --recipe with drop-path or dropout")
        args.batch, args.loss = args.batch or 2, args.loss or "ce"
        return
    from twinstep import recipe

    try:
        r = recipe.parse(args.recipe)
    except recipe.RecipeError as e:
        parser.error(str(e))
    from twinstep import step
    from twinstep.nets import get_net

    try:
        step.check_recipe(get_net(args.net), r)
    except ValueError as e:
        parser.error(str(e))
    if args.precision != "f64":
        parser.error("whole-step ties (--recipe) run in f64; bf16's boundary is checked by "
                     "'twinstep tie NET --precision bf16'")
    if args.loss is not None and args.loss != r.loss:
        parser.error(f"--loss {args.loss} contradicts the recipe's {r.loss}")
    if args.control in GRADIENT_ONLY_CONTROLS:
        parser.error(f"--control {args.control} leaves each replica its own running statistics, "
                     f"which whole steps cannot carry; tie it without --recipe")
    if args.control in MASK_CONTROLS and not (r.drop or r.dropout):
        parser.error(f"--control {args.control} needs a recipe with drop-path or dropout")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    from twinstep.tie import STEPS

    args.recipe, args.steps = r, args.steps or STEPS
    args.batch, args.loss = args.batch or r.batch, r.loss


def _check_artifact_args(parser, args) -> None:
    """With --artifact the manifest fixes the configuration: reject flags that would not apply."""
    from twinstep.tie import STEPS

    if not args.artifact.endswith(".jaxexport"):
        parser.error("--artifact takes a NAME.jaxexport file from 'twinstep render'")
    fixed = ("net", "batch", "recipe", "loss", "precision", "replicas", "res", "classes")
    given = [k for k in fixed if getattr(args, k) is not None]
    if args.control != "none":
        given.append("control")
    if given:
        parser.error(f"--artifact takes the configuration from its manifest; drop "
                     f"{', '.join(given)}")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    args.steps = args.steps or STEPS


def _fill_tie_defaults(args) -> None:
    for flag in ("replicas", "res", "classes", "precision"):
        if getattr(args, flag) is None:
            setattr(args, flag, TIE_DEFAULTS[flag])


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    for flag in ("replicas", "batch", "res", "classes"):
        values = getattr(args, flag, None)
        values = values if isinstance(values, list) else [values]
        if any(v is not None and v < 1 for v in values):
            parser.error(f"--{flag} must be >= 1")
    if args.command == "render" and (args.all == (args.name is not None)):
        parser.error("give a recipe NAME or --all (not both)")
    if args.command == "tie" and args.artifact is not None:
        _check_artifact_args(parser, args)
        return cmd_tie_artifact(args)
    if args.command == "tie" and args.net is None:
        parser.error("the net is required (or --artifact PATH)")
    if args.command == "tie":
        _fill_tie_defaults(args)
    if args.command in ("tie", "parity"):
        from twinstep.nets import get_net

        multiple = get_net(args.net).INPUT_MULTIPLE
        if args.res % multiple:
            parser.error(f"--res must be a multiple of {multiple} for {args.net}")
    if args.command == "tie":
        _check_tie_args(parser, args)
    if args.command == "tie" and args.precision == "bf16" and args.replicas & (args.replicas - 1):
        parser.error("a bf16 tie needs --replicas a power of two: a replica's loss cotangent is "
                     "R times the single device's, and bf16 rounding commutes with that scale "
                     "only for R = 2^k")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
