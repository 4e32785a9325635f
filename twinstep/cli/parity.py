"""``twinstep parity NET``: the net against timm + torch autograd from the same random weights
(the [oracle] extra): one train step and one eval forward in both (docs/nets.md#parity)."""

from __future__ import annotations

from twinstep.cli import options
from twinstep.cli.console import mark, report_console, status
from twinstep.errors import ExitStatus, UsageError
from twinstep.nets import NETS, get_net
from twinstep.processes import settings


def add(p) -> None:
    p.description = ("Build timm's model with twinstep's random weights (BN statistics "
                     "randomised too), run one train step and one eval forward in both, and "
                     "print the logits' error, the worst parameter gradient's and the running "
                     "buffers', each against its bound (docs/nets.md#parity). "
                     + options.exits({ExitStatus.SUCCESS: "within bounds",
                                      ExitStatus.FAILED: "outside",
                                      ExitStatus.USAGE: "bad usage or input, or no [oracle] "
                                                        "extra"}))
    p.add_argument("net", choices=sorted(NETS))
    options.count(p, "--res", 64, "input resolution (default 64)")
    options.count(p, "--batch", 2, "batch size (default 2)")
    p.add_argument("--precision", choices=["f64", "f32"], default="f64")
    p.add_argument("--loss", choices=["ce", "bce"], default="ce")
    options.count(p, "--classes", 10, "classes K (default 10)", least=2)
    options.seed(p)


def run(args, parser) -> int:
    # lazy, the CLI's reason: the API and the check (the step, optax), which 'parity --help'
    # need not load
    from twinstep import api
    from twinstep.checking import parity

    net = api.get_net(args.net)
    if args.res % net.INPUT_MULTIPLE:
        raise UsageError(f"--res must be a multiple of {net.INPUT_MULTIPLE} for {args.net}")
    try:
        with (settings.jax_settings(jax_enable_x64=args.precision == "f64"),
              status(f"{net.NAME}: one train step and one eval forward in both")):
            r = parity.run_parity(net, res=args.res, batch=args.batch, precision=args.precision,
                                  loss=args.loss, num_classes=args.classes, seed=args.seed)
    except parity.OracleMissing as e:
        raise UsageError(str(e)) from None
    show(r, args.res, args.batch, args.classes)
    return ExitStatus.SUCCESS if r.ok else ExitStatus.FAILED


def show(r, res: int, batch: int, classes: int, console=None) -> None:
    """`twinstep.checking.parity.ParityReport`: each error against its bound, the verdict last."""
    from twinstep.checking import parity  # lazy, the CLI's reason, as in run

    console = console or report_console()
    p = r.precision
    console.print(f"{r.net} vs timm {get_net(r.net).TIMM_NAME}: {res}², batch {batch}, "
                  f"K = {classes}, {p}, loss {r.loss}")

    def line(label, err, bound):
        ok = "" if bound is None else mark(err <= bound)
        lim = "reported only" if bound is None else f"bound {bound:.0e}"
        console.print(f"  {label:<34} {err:.2e}  ({lim}) {ok}")

    line("logits, train mode (rel. max)", r.logits_train_err, r.logits_bounds[0])
    line("logits, eval mode (rel. max)", r.logits_eval_err, r.logits_bounds[1])
    name, worst = r.worst_grad
    line(f"worst of {len(r.grad_errs)} gradients", worst, parity.GRAD_BOUND[p])
    console.print(f"    ({name})")
    line("running buffers after one step", r.buffer_err, parity.BUFFER_BOUND[p])
    console.print("[green]parity holds[/]" if r.ok else "[red]parity FAILS[/]")
