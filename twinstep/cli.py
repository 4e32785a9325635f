"""The ``twinstep`` command line.

Each command is a pair side by side: ``add_<command>`` builds its parser, ``run_<command>`` does
it through the Python API (`twinstep.api`); `COMMANDS` is the dispatch table, and the options
several commands share are defined once (`_count`, `_json_out`, `_json_print`, `_seed`).
Configurations check themselves (`twinstep.ties.TieConfig`, `twinstep.renders.RenderConfig`), so
the CLI and the API refuse the same things with the same one-line messages.

Exit status: 0 success, 1 a check failed, 2 bad usage or input, 3 an internal or environment
error (one line; TWINSTEP_DEBUG=1 shows the traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from twinstep import __version__
from twinstep.errors import BackendError, ClusterError, UsageError

# ----------------------------------------------------------------------------- shared options


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line ("twinstep tie: --res: not an integer: 'x'"), exit 2:
    the usage is one --help away."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


SEEDS = 2**31  # seeds are 0 <= seed < 2^31 (NumPy's and JAX's generators take them alike)


def _int_in(low: int, high: int | None = None):
    """An argparse type: an ASCII integer in [low, high)."""
    def parse(text: str) -> int:
        if not (text.isascii() and text.lstrip("-").isdigit() and len(text) <= 18):
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        value = int(text)
        if value < low or (high is not None and value >= high):
            raise argparse.ArgumentTypeError(
                f"must be >= {low}" + (f" and < {high}" if high is not None else "")
                + f", got {value}")
        return value

    return parse


def _count(p, flag: str, default, help: str, metavar: str | None = None, least: int = 1,
           **kw) -> None:
    """An integer option that must be >= ``least`` (--replicas, --batch, --res, --steps: 1;
    --classes: 2)."""
    p.add_argument(flag, type=_int_in(least), default=default, metavar=metavar, help=help, **kw)


def _json_out(p, help: str = "also write the report as JSON") -> None:
    p.add_argument("--json", metavar="PATH", help=help)


def _json_print(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _seed(p) -> None:
    p.add_argument("--seed", type=_int_in(0, SEEDS), default=0,
                   help="random seed, 0 <= seed < 2^31 (default 0)")


def _cluster(p) -> None:
    """The flags that join JAX's multi-controller runtime (`twinstep.hosts`)."""
    g = p.add_argument_group(
        "many processes", "one process per host (or 'twinstep launch --local P'), every process "
        "given the same command with its own --process-id; without these flags a SLURM step or "
        "JAX_COORDINATOR_ADDRESS is detected, else the run is one process. --replicas counts "
        "the replicas of all processes together (a multiple of P).")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="where process 0 serves the runtime's coordination (a free port on its "
                        "host, reachable from every other host)")
    _count(g, "--num-processes", None, "how many processes take part, P", "P")
    g.add_argument("--process-id", type=_int_in(0), metavar="I",
                   help="this process's number, 0 .. P-1 (0 writes the logs and reports)")


def _join(args, replicas: int) -> None:
    """Join the runtime the flags (or the environment) name, before JAX's first operation;
    ``replicas``: the run's R, all processes together (each asks for its share of devices)."""
    from twinstep import api

    api.join(args.coordinator, args.num_processes, args.process_id, replicas)


def _defaults(config_class) -> dict:
    """A config dataclass's field defaults: the CLI's defaults are the library's."""
    return {f.name: f.default for f in dataclasses.fields(config_class)}


def _write_json(path: str | None, data: dict) -> None:
    """The report at ``path``, whole or not at all."""
    if path:
        from twinstep import files

        files.publish({path: json.dumps(data, indent=1).encode()})


HELP = {  # each command's line in 'twinstep --help'
    "certify": "certify the op library's hand-written VJPs (float64)",
    "info": "tensor, scalar and BN counts and forward GMACs of a net",
    "recipe": "decode a recipe name (or a preset) and print every field",
    "parity": "the net against timm + torch autograd, same random weights",
    "tie": "the R-replica sync-BN step against the single-device step at R*N",
    "render": "export a recipe's whole train step to StableHLO (jax.export)",
    "train": "train a recipe with its tied step: data, checkpoints, evaluation, logs",
    "export": "a training run's weights as a timm state dict (.safetensors or .pth)",
    "plot": "a training run's curves as a PNG (loss, lr, val top-1)",
    "launch": "run train or tie as P processes on this host, joined into one runtime",
}


# ---------------------------------------------------------------------------------- certify


def add_certify(sub) -> None:
    c = sub.add_parser(
        "certify", help=HELP["certify"],
        description="Check every op's hand-written VJP against jax.vjp (<= 1e-12) and central "
                    "finite differences (<= 1e-6); check the four data-parallel facts "
                    "(sharding, collectives, homogeneity, divisor; docs/tie.md) under "
                    "jax.shard_map on R "
                    "virtual devices with shifted shards; and check that each negative control "
                    "(unsynced BN, shard-statistics gamma, sum for mean, wrong divisor, the "
                    "E[x^2]-E[x]^2 variance exchange) is caught. Exit 0 when all hold.")
    _count(c, "--replicas", [2, 4], "replica counts for the data-parallel facts (default: 2 4)",
           "R", nargs="+")
    _seed(c)
    _json_out(c)


def run_certify(args, parser) -> int:
    """Certify the op library in float64: VJPs, data-parallel facts, negative controls."""
    from twinstep import api, certify, report, runtime

    api.devices(max(args.replicas))
    t0 = time.perf_counter()
    with runtime.jax_settings(jax_enable_x64=True), report.status("certifying the op library"):
        result = certify.run(args.replicas, seed=args.seed)
    report.certify_report(result, time.perf_counter() - t0)
    _write_json(args.json, result.to_json())
    return 0 if result.ok else 1


# ------------------------------------------------------------------------------------- info


def add_info(sub) -> None:
    from twinstep.nets import NETS

    i = sub.add_parser(
        "info", help=HELP["info"],
        description="Counts of a network's parameters (timm's names and shapes), its BatchNorm "
                    "layers and 1-D tensors, and its forward multiply-accumulates at one "
                    "resolution (batch 1).")
    i.add_argument("net", choices=sorted(NETS))
    _count(i, "--res", 224, "input resolution (default 224)")
    _count(i, "--classes", 1000, "classes K (default 1000)", least=2)
    _json_print(i)


def run_info(args, parser) -> int:
    """Counts and forward GMACs of a network."""
    from rich.console import Console
    from rich.table import Table

    from twinstep import api, info

    d = info.describe(api.get_net(args.net), args.res, args.classes)
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


# ----------------------------------------------------------------------------------- recipe


def add_recipe(sub) -> None:
    from twinstep import recipes

    r = sub.add_parser(
        "recipe", help=HELP["recipe"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode a recipe name into the training configuration it stands for.\n\n"
                    f"Grammar: {recipes.GRAMMAR}\n"
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
                    "the name.\n\nPresets (docs/recipes.md; dp on R = 8):\n"
                    + "\n".join(f"  {k:<12} {v.name}" for k, v in recipes.PRESETS.items())
                    + "\n\nExit 0 on a valid name, 2 on a bad one (the error names the token).")
    r.add_argument("name", help="a grammar name, e.g. resnet50in160_lambaccdp4x128wxclipbcebf16, "
                                "or a preset")
    _count(r, "--replicas", None, "also print the effective batch R*N*k", "R")
    _json_print(r)


def run_recipe(args, parser) -> int:
    """Decode a recipe name and print every field."""
    from rich.console import Console
    from rich.table import Table

    from twinstep import recipes

    try:
        r = recipes.parse(args.name)
    except recipes.RecipeError as e:
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
    for label, value in recipes.describe(r, args.replicas):
        table.add_row(label, value)
    Console().print(table)
    return 0


# ----------------------------------------------------------------------------------- parity


def add_parity(sub) -> None:
    from twinstep.nets import NETS

    q = sub.add_parser(
        "parity", help=HELP["parity"],
        description="Build timm's model with twinstep's random weights (BN gamma, beta and "
                    "running statistics randomised too), run one train step and one eval "
                    "forward in both, and print the max error of the logits, the worst "
                    "norm-relative error over every parameter gradient, and the running "
                    "buffers' error. Bounds: logits 1e-9 (f64) / 1e-4 (f32); gradients 1e-8 "
                    "and buffers 1e-9 in f64 (reported only in f32). Exit 0 within bounds, 1 "
                    "outside, 2 on bad usage or without the [oracle] extra (torch, timm).")
    q.add_argument("net", choices=sorted(NETS))
    _count(q, "--res", 64, "input resolution (default 64)")
    _count(q, "--batch", 2, "batch size (default 2)")
    q.add_argument("--precision", choices=["f64", "f32"], default="f64")
    q.add_argument("--loss", choices=["ce", "bce"], default="ce")
    _count(q, "--classes", 10, "classes K (default 10)", least=2)
    _seed(q)


def run_parity(args, parser) -> int:
    """One train step and an eval forward against timm + torch autograd, same weights."""
    from rich.console import Console

    from twinstep import api, parity, report, runtime

    net = api.get_net(args.net)
    if args.res % net.INPUT_MULTIPLE:
        raise UsageError(f"--res must be a multiple of {net.INPUT_MULTIPLE} for {args.net}")
    try:
        with (runtime.jax_settings(jax_enable_x64=args.precision == "f64"),
              report.status(f"{net.NAME}: one train step and one eval forward in both")):
            r = parity.run_parity(net, args.res, args.batch, args.precision, args.loss,
                                  args.classes, args.seed)
    except parity.OracleMissing as e:
        raise UsageError(str(e)) from None
    report.parity_report(r, args.res, args.batch, args.classes, Console())
    return 0 if r.ok else 1


# -------------------------------------------------------------------------------------- tie


def add_tie(sub) -> None:
    from twinstep.collectives import CONTROLS
    from twinstep.nets import NETS
    from twinstep.ties import PRECISIONS, STATES, TieConfig

    default = _defaults(TieConfig)
    t = sub.add_parser(
        "tie", help=HELP["tie"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the data-parallel step (R replicas of batch N, every BatchNorm "
                    "synchronised, every gradient all-reduced by its mean) and the "
                    "single-device step on the concatenated batch R*N, from the same "
                    "parameters, and compare every parameter gradient, every BN site's "
                    "global statistics, the logits, the loss and the running statistics.\n\n"
                    "Bounds, relative, per tensor: max(FLOOR, 10 x SENSITIVITY), SENSITIVITY "
                    "being what arithmetic alone moves the single-device value by (a "
                    "rounding-sized input perturbation or a reordered batch); FLOOR is 1e-10 "
                    "for parameters and 1e-12 for BN statistics in f64, 1e-4 in f32. f32 runs "
                    "both programs on the batch and three rounding-sized nudges of it and "
                    "takes the closest pair (a ReLU at zero may flip either way), from "
                    "--state near-init at N = 4 by default (docs/tie.md#f32). bf16 — "
                    "the bf16 policy's rounding points (every conv operand and result) with "
                    "f64 around them, so both programs feed every conv the same bf16 "
                    "operands: conv weight gradients elementwise against the partial-sum "
                    "rounding boundary (docs/tie.md), everything else at the f64 bounds; R "
                    "must be a power of two.\n\n"
                    "Exit 0 when everything ties, 1 when anything fails, 2 on bad "
                    "usage, 3 on an internal error, 4 when inconclusive (within every bound, "
                    "but a bound above 1e-3: too loose to see a small bug; docs/tie.md). "
                    "Controls inject a classic bug, need R >= 2, and each must make the tie "
                    "fail:\n"
                    + "\n".join(f"  {k:<14} {v}" for k, v in CONTROLS.items()))
    t.add_argument("net", choices=sorted(NETS), nargs="?",
                   help="the network (omitted with --artifact: the render names it)")
    _count(t, "--replicas", None, f"replicas (default {default['replicas']})", "R")
    _count(t, "--batch", None, "examples per replica (default 2, in f32 4, or the recipe's N)",
           "N")
    _count(t, "--res", None, f"input resolution (default {default['res']})")
    _count(t, "--classes", None, f"classes K (default {default['classes']})")
    t.add_argument("--loss", choices=["ce", "bce"], default=None,
                   help="default ce, or the recipe's loss")
    t.add_argument("--precision", choices=PRECISIONS, default=None,
                   help=f"default {default['precision']}")
    _seed(t)
    t.add_argument("--shift", action=argparse.BooleanOptionalAction, default=True,
                   help="offset replica r's inputs by r, so Chan's correction is O(1) "
                        "(default on)")
    t.add_argument("--control", choices=sorted(CONTROLS), default="none")
    t.add_argument("--state", choices=STATES, default=None,
                   help="the parameters both programs start from: random-bn (every BN far "
                        "from the identity; default in f64 and bf16) or near-init (timm's "
                        "initialisation, nudged; default in f32)")
    t.add_argument("--all", action="store_true", help="one row per parameter (default: the "
                                                      "worst 10 and counts)")
    _json_out(t, "write the full report as JSON")
    t.add_argument("--recipe", metavar="NAME",
                   help="tie whole training steps of this recipe (a recipe name or a preset, "
                        "see 'twinstep recipe'): k micro-steps, clip, optimizer, EMA, masks; "
                        "every parameter, optimizer-state, EMA and running-statistics tensor "
                        "compared after every step (f64)")
    _count(t, "--steps", None, "whole steps to tie, with --recipe or --artifact (default 3)",
           "S")
    t.add_argument("--fast-compile", action="store_true",
                   help="compile with XLA at -O0: the same numerics, about half the compile "
                        "time, programs that run 14-18x slower; sooner for mnv4's ties (mostly "
                        "compile), later for resnet50's (mostly running)")
    t.add_argument("--artifact", metavar="PATH",
                   help="tie a render instead of the Python step: PATH is NAME.jaxexport from "
                        "'twinstep render --precision f64' (its NAME.json beside it), the "
                        "deserialized program run by XLA on R devices, or NAME.vmfb from "
                        "'render --target iree --precision f64', IREE's build run by IREE's "
                        "runtime; against the single-device Python step, over --steps whole "
                        "steps. Net, R, N, resolution, classes and recipe come from the "
                        "manifest")
    _cluster(t)


# the configuration an artifact's manifest fixes
_ARTIFACT_FIXED = ("net", "batch", "recipe", "loss", "precision", "replicas", "res", "classes",
                   "state")
_TIE_FIELDS = ("replicas", "batch", "res", "classes", "loss", "precision", "seed", "shift",
               "control", "fast_compile", "recipe", "state")


def run_tie(args, parser) -> int:
    """Tie the R-replica step (one gradient step, whole recipe steps, or a render's artifact)
    against the single-device step at R N."""
    from twinstep import api, hosts, report, ties

    if args.artifact is not None:
        if not args.artifact.endswith(api.ARTIFACT_SUFFIXES):
            parser.error("--artifact takes a NAME.jaxexport or NAME.vmfb file from 'twinstep "
                         "render'")
        given = [k for k in _ARTIFACT_FIXED if getattr(args, k) is not None]
        if given or args.control != "none":
            parser.error(f"--artifact takes the configuration from its manifest; drop "
                         f"{', '.join(given + (['control'] if args.control != 'none' else []))}")
    elif args.net is None:
        parser.error("the net is required (or --artifact PATH)")
    elif args.steps is not None and args.recipe is None:
        parser.error("--steps needs --recipe (whole training steps)")
    config = {k: getattr(args, k) for k in _TIE_FIELDS if getattr(args, k) is not None}
    _join(args, api.read_manifest(args.artifact)["replicas"] if args.artifact is not None
          else config.get("replicas", ties.TieConfig.replicas))
    primary = hosts.is_primary()  # only process 0 reports
    t0 = time.perf_counter()
    with report.status("preparing the tie", quiet=not primary) as say:
        if args.artifact is not None:
            result = api.tie_artifact(args.artifact, args.steps, args.seed, args.shift,
                                      args.fast_compile, progress=say)
        elif args.recipe is not None:
            result = api.tie_steps(config.pop("recipe"), args.steps, progress=say,
                                   net=args.net, **config)
        else:
            result = api.tie(args.net, progress=say, **config)
    seconds = time.perf_counter() - t0
    if not primary:  # ends with process 0, once it has reported (the launcher stops the rest
        hosts.barrier("tie reported")  # of a run at its first non-zero exit)
        return ties.EXIT_CODES[result.status]
    if args.artifact is None and args.recipe is None:
        report.tie_report(result, show_all=args.all, seconds=seconds)
    else:
        report.steps_report(result, show_all=args.all, seconds=seconds)
    if args.artifact is not None:
        sha = api.read_manifest(args.artifact)["files"][os.path.basename(args.artifact)]
        print(f"artifact: {args.artifact} (sha256 {sha['sha256'][:16]}...)")
    _write_json(args.json, result.to_json())
    hosts.barrier("tie reported")
    return ties.EXIT_CODES[result.status]


# ----------------------------------------------------------------------------------- render


def add_render(sub) -> None:
    from twinstep import renders
    from twinstep.collectives import CONTROLS

    d = sub.add_parser(
        "render", help=HELP["render"],
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
                    "With --target iree also NAME.vmfb: IREE's llvm-cpu build of the StableHLO, "
                    "for one device (the manifest records IREE's version and flags).\n\n"
                    "Exit 0 when every render was written, 2 on a bad name or option, 3 when "
                    "IREE is missing or cannot compile the step.")
    d.add_argument("name", nargs="?", help="a recipe name (docs/recipes.md) or preset; see "
                                           "'twinstep recipe'")
    d.add_argument("--all", action="store_true",
                   help=f"render the reference names (docs/recipes.md) and the presets (at --res "
                        f"{renders.SMALL_RES} unless given)")
    _count(d, "--replicas", 1, "the mesh the step is rendered for (default 1: no collective)",
           "R")
    d.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    _count(d, "--res", None, "input resolution (default: the recipe's train resolution)")
    _count(d, "--classes", renders.DEFAULT_CLASSES,
           f"classes K (default {renders.DEFAULT_CLASSES})")
    d.add_argument("--precision", choices=renders.PRECISIONS, default=None,
                   help="default: bf16 with the recipe's bf16 token, else f32; f64 renders are "
                        "the ones 'twinstep tie --artifact' can tie exactly")
    d.add_argument("--platform", choices=renders.PLATFORMS, default=None,
                   help="the backend to lower for (default: this machine's); depthwise convs "
                        "lower as shifted multiply-adds for cpu, as grouped convolutions "
                        "elsewhere")
    d.add_argument("--control", choices=sorted(CONTROLS), default="none",
                   help="render a deliberately broken step (a negative control that "
                        "'twinstep tie --artifact' must fail; the manifest records it)")
    d.add_argument("--target", choices=renders.TARGETS, default="xla",
                   help="xla (default): the three files; iree: also NAME.vmfb, the StableHLO "
                        "compiled by IREE for its llvm-cpu backend (the [iree] extra; R = 1, "
                        "platform cpu; minutes for a whole net), which 'twinstep tie "
                        "--artifact NAME.vmfb' runs with IREE's runtime")


def run_render(args, parser) -> int:
    """Export recipes' whole train steps for an R-device mesh: NAME.mlir, .jaxexport, .json."""
    from rich.console import Console

    from twinstep import api, renders, report

    if args.all == (args.name is not None):
        parser.error("give a recipe NAME or --all (not both)")
    from twinstep import files

    files.check_writable_folder(args.out, "--out")
    names = renders.all_names() if args.all else [args.name]
    res = args.res or (renders.SMALL_RES if args.all else None)
    rows = []
    for name in names:  # every configuration checked before the first export
        renders.RenderConfig(name, args.replicas, res, args.classes, args.precision,
                            args.platform, args.control, args.target)
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        with report.status(f"rendering {name} ({i + 1}/{len(names)})"):
            made = api.render(name, args.replicas, args.out, res=res, classes=args.classes,
                              precision=args.precision, platform=args.platform,
                              control=args.control, target=args.target)
        rows.append((made.manifest, time.perf_counter() - t0))
    report.render_table(rows, args.replicas, args.out, Console())
    return 0


# ---------------------------------------------------------------------------------- train


def add_train(sub) -> None:
    from twinstep.trainer import MAX_WORKERS, PRECISIONS, TrainConfig

    default = _defaults(TrainConfig)
    t = sub.add_parser(
        "train", help=HELP["train"], formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train RECIPE's net with the recipe's whole train step — the program "
                    "'twinstep tie --recipe' ties to the single device — on R replicas, every "
                    "BatchNorm synchronised. Writes into --out (RUN_DIR):\n"
                    "  config.json     the resolved configuration\n"
                    "  metrics.jsonl   a train line every --log-every steps (loss, lr, img/s), "
                    "an eval line\n                  at each evaluation (val loss, top-1, "
                    "top-5; raw and EMA weights)\n"
                    "  tb/             the same as TensorBoard event files "
                    "('twinstep plot RUN_DIR' draws them)\n"
                    "  checkpoints/    orbax: parameters, global BN statistics, optimizer "
                    "state, EMA, step\n\n"
                    "Re-running with the same --out continues the run from its latest "
                    "checkpoint, bit for bit as if never stopped (other settings are refused). "
                    "The data: 'digits', scikit-learn's bundled 1,797 handwritten digits "
                    "(8x8, upsampled to --res; every sixth image is validation; not augmented), "
                    "or an image folder DIR/train/<class>/*.jpg|png, DIR/val/<class>/... "
                    "(classes sorted as torchvision's ImageFolder) read through timm's "
                    "transforms: random-resized crop, flip, the recipe's RandAugment and "
                    "mixup/CutMix for training; resize + centre crop (crop_pct 0.95) for "
                    "evaluation. An image that does not decode is replaced by the next one "
                    "(one warning, counted in metrics.jsonl). Each step's batch is a function of "
                    "(--seed, step): --workers changes the speed, never the result.\n\n"
                    "Exit 0 when trained, 2 on bad usage, 3 on a non-finite loss or an "
                    "internal error (the last checkpoint stays), 130 interrupted.")
    t.add_argument("recipe", help="a recipe name or preset (see 'twinstep recipe'); a dp "
                                  "recipe for --replicas > 1")
    t.add_argument("--data", default=default["data"], metavar="DIR|digits",
                   help=f"an image folder, or the embedded digits (default {default['data']})")
    t.add_argument("--out", required=True, metavar="RUN_DIR", help="the run's folder (created)")
    _count(t, "--replicas", default["replicas"], f"replicas R (default {default['replicas']})",
           "R")
    _count(t, "--batch", None, "examples per replica (default: the recipe's N)", "N")
    _count(t, "--res", default["res"], f"input resolution (default {default['res']})")
    length = t.add_mutually_exclusive_group()
    _count(length, "--steps", default["steps"], f"optimizer steps (default "
                                                f"{default['steps']}); the warmup is the first "
                                                "tenth, from timm's warmup lr 1e-5")
    _count(length, "--epochs", None, "passes over the training images instead of --steps "
                                     "(steps = ceil(E x images / (R N k)))", "E")
    for flag, what in (("eval_every", "evaluate on the val split every K steps and at the end"),
                       ("ckpt_every", "checkpoint every K steps and at the end"),
                       ("keep", "keep the last K checkpoints"),
                       ("log_every", "a metrics line every K steps")):
        _count(t, "--" + flag.replace("_", "-"), default[flag],
               f"{what} (default {default[flag]})", "K")
    t.add_argument("--precision", choices=PRECISIONS, default=default["precision"],
                   help=f"default {default['precision']}")
    _seed(t)
    t.add_argument("--workers", type=_int_in(0, MAX_WORKERS + 1), default=default["workers"],
                   metavar="W", help="loader processes decoding and augmenting images (default "
                                     f"{default['workers']}: one background thread)")
    t.add_argument("--randaugment", type=_int_in(0, 31), metavar="M",
                   help="RandAugment rand-mM-mstd0.5-inc1 on an image folder (default: the "
                        "recipe's, e.g. 7 for rsb-a1; none for a grammar name)")
    for kind in ("mixup", "cutmix"):
        t.add_argument(f"--{kind}", type=float, metavar="ALPHA",
                       help=f"{kind}'s Beta alpha on an image folder, 0 off (default: the "
                            "recipe's); with both on, one of the two per batch")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in RUN_DIR and refuse to start a new one (without it, "
                        "a RUN_DIR holding a run is continued too)")
    t.add_argument("--artifact", metavar="NAME.jaxexport",
                   help="run a render's deserialized step instead of the Python one (its "
                        "recipe, R, N, S and precision; its schedule as rendered)")
    t.add_argument("--init-from", metavar="FILE", help="start from a timm state dict (.pth, "
                   ".safetensors), e.g. to fine-tune; a classifier of another width is "
                   "initialised afresh")
    t.add_argument("--fast-compile", action="store_true",
                   help="compile at XLA -O0: the same numerics, half the compile, a slower "
                        "step (for short runs)")
    _cluster(t)


def run_train(args, parser) -> int:
    """Train a recipe into RUN_DIR; print the last evaluation."""
    from twinstep import api, hosts, report, trainer

    config = {k: getattr(args, k) for k in ("data", "replicas", "batch", "res", "steps", "epochs",
                                            "eval_every", "ckpt_every", "keep", "log_every",
                                            "precision", "seed", "workers", "init_from",
                                            "randaugment", "mixup", "cutmix", "artifact",
                                            "resume", "fast_compile")}
    cfg = trainer.TrainConfig(args.recipe, args.out, **config)  # refuse before JAX starts
    _join(args, cfg.replicas)
    primary = hosts.is_primary()  # process 0 shows the progress and the result
    with report.train_progress(cfg.steps, quiet=not primary) as update:
        try:
            result = api.train(args.recipe, args.out, progress=update,
                               warn=lambda text: print(f"warning: {text}", file=sys.stderr),
                               **config)
        except trainer.NonFinite as e:
            print(f"twinstep train: {e}", file=sys.stderr)
            return 3
    if not primary:
        return 0
    for weights, m in result.items():
        print(f"val ({weights}): top-1 {m['top1']:.2%}, top-5 {m['top5']:.2%}, "
              f"loss {m['loss']:.4f}")
    print(f"run: {args.out} (metrics.jsonl, tb/, checkpoints/)")
    return 0


def add_export(sub) -> None:
    e = sub.add_parser(
        "export", help=HELP["export"],
        description="Write a 'twinstep train' run's latest weights — parameters and BN running "
                    "statistics, or their EMA — as a float32 state dict in timm's names, which "
                    "timm.create_model(TIMM_NAME, num_classes=K, pretrained=True, "
                    "pretrained_cfg_overlay=dict(file=PATH, num_classes=K)) loads (K in the "
                    "overlay too: else timm drops a classifier that is not 1000 wide). Exit 0 "
                    "when written, 2 on bad usage.")
    e.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder ('twinstep train --out')")
    e.add_argument("--format", choices=("safetensors", "pth"), default="safetensors",
                   help="default safetensors")
    e.add_argument("--ema", action="store_true", help="the EMA weights (recipes with 'ema')")
    e.add_argument("--out", metavar="FILE", help="default RUN_DIR/model[_ema].FORMAT")


def run_export(args, parser) -> int:
    """Export a training run's weights for timm."""
    from twinstep import trainer

    print(trainer.export(args.run_dir, args.format, args.ema, args.out))
    return 0


def add_plot(sub) -> None:
    p = sub.add_parser(
        "plot", help=HELP["plot"],
        description="Draw a 'twinstep train' run's curves — train loss, learning rate, val top-1 "
                    "of the raw and EMA weights — from RUN_DIR/metrics.jsonl into a PNG. Exit 0 "
                    "when written, 2 on bad usage.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder ('twinstep train --out')")
    p.add_argument("--out", metavar="FILE", help="default RUN_DIR/curves.png")


def run_plot(args, parser) -> int:
    """Plot a training run's metrics."""
    from twinstep import runlog

    print(runlog.plot(args.run_dir, args.out))
    return 0


def add_launch(sub) -> None:
    from twinstep.launch import GRACE_S

    p = sub.add_parser(
        "launch", help=HELP["launch"], formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start P processes of a twinstep command on this host, joined into one "
                    "JAX runtime (as 'torchrun --standalone' does): process i runs the command "
                    "with --coordinator localhost:PORT --num-processes P --process-id i, and "
                    "its output comes back prefixed [i]. For CPU runs that test a multi-host "
                    "setup, or one process per GPU (--gpus-per-process). On several hosts, run "
                    "the command on each host with the flags yourself, or under srun (README, "
                    "'Many hosts').\n\n"
                    "The first process to fail (non-zero exit, or killed) stops the others at "
                    f"once — SIGTERM, SIGKILL after {GRACE_S} s — each named on stderr. Exit: 0 "
                    "when every process ends with 0, else the failed process's status (a status "
                    "outside the contract, or a signal, is 3); 130 interrupted.\n\n"
                    "example: twinstep launch --local 2 -- train mnv4in_adamdp --data digits "
                    "--replicas 4 --out run")
    _count(p, "--local", None, "processes to start on this host", "P", required=True)
    p.add_argument("--port", type=_int_in(1, 65536), metavar="PORT",
                   help="the coordinator's port (default: a free one)")
    _count(p, "--gpus-per-process", None, "give process i GPUs i*G .. (i+1)*G-1 "
                                          "(JAX_LOCAL_DEVICE_IDS); default: JAX's choice", "G")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the twinstep command each process runs (train or tie)")


def run_launch(args, parser) -> int:
    """P processes of one command; the first failure stops the rest."""
    from twinstep import launch

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch.run(args.local, cmd, args.port, args.gpus_per_process)


# ------------------------------------------------------------------------------- dispatch

COMMANDS = {"certify": (add_certify, run_certify), "info": (add_info, run_info),
            "recipe": (add_recipe, run_recipe), "parity": (add_parity, run_parity),
            "tie": (add_tie, run_tie), "render": (add_render, run_render),
            "train": (add_train, run_train), "export": (add_export, run_export),
            "plot": (add_plot, run_plot), "launch": (add_launch, run_launch)}


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The parser. Only the command in ``argv`` gets its options (listing them imports what they
    name: nets, controls, JAX); the others are a name and a line, so that --help, --version and
    'twinstep recipe' answer without starting JAX."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    p = _Parser(
        prog="twinstep",
        description="Data-parallel ResNet-50 and MobileNetV4-Conv-M with synchronised BatchNorm, "
                    "checked parameter by parameter against the single-device step at R*N.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'twinstep COMMAND --help' for a command's options.\n\n"
               "Exit status: 0 success (tied, certified, written); 1 a check failed (not tied, "
               "not\ncertified); 2 bad usage or input; 3 an internal or environment error; 4 "
               "inconclusive (a\ntie within its bounds, but a bound too loose to see a 1e-3 "
               "bug); 130 interrupted.\nErrors are one line on stderr; --debug shows the "
               "traceback.")
    p.add_argument("--version", action="version", version=f"twinstep {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an internal error (also TWINSTEP_DEBUG=1)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (add, _) in COMMANDS.items():
        if name == chosen:
            add(sub)
        else:
            sub.add_parser(name, help=HELP[name])
    return p


def main(argv=None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if isinstance(getattr(args, "json", None), str):
            from twinstep import files

            files.check_writable_file(args.json, "--json")
        return COMMANDS[args.command][1](args, parser)
    except UsageError as e:
        print(f"twinstep {args.command}: {e}", file=sys.stderr)
        return 2
    except (ClusterError, BackendError) as e:
        print(f"twinstep {args.command}: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"twinstep {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the verdict is the exit status, the cause one line
        if args.debug or os.environ.get("TWINSTEP_DEBUG"):
            raise
        print(f"twinstep {args.command}: internal error: {type(e).__name__}: {e} "
              f"(TWINSTEP_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 3


def _on_interrupt(signum, frame) -> None:
    """Ctrl-C in the executable: one line and exit 130 at once (os._exit: no teardown, which can
    crash while XLA's threads run, and no KeyboardInterrupt for a callback to swallow) — unless
    files are being published, which then finish first (`twinstep.files.publish`)."""
    from twinstep import files

    if files.publishing:
        files.interrupted = True
        return
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    sys.stdout.flush()
    print(f"twinstep{' ' + command if command in COMMANDS else ''}: interrupted", file=sys.stderr,
          flush=True)
    os._exit(130)


def entry() -> None:
    """The ``twinstep`` executable: main's status as the process's, Ctrl-C as `_on_interrupt`."""
    import signal

    signal.signal(signal.SIGINT, _on_interrupt)
    status = main()
    if status == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
