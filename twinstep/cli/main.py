"""The ``twinstep`` command line: the command table, the parser, and the exit status contract.

Each command is a module of this package (``twinstep.cli.<command>``) with ``add(parser)``,
which fills the command's parser, and ``run(args, parser) -> int``, which does the command
through the Python API (`twinstep.api`) and reports usage errors through its parser. Only the
command asked for is imported, so that ``--help`` and ``--version`` answer at once.

Exit status: `twinstep.errors.ExitStatus`, the one table (docs/cli.md#exit-status). An error is
one line on stderr; TWINSTEP_DEBUG=1 shows an internal error's traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import textwrap

from twinstep.cli.console import ascii_fallback
from twinstep.cli.options import Parser
from twinstep.errors import EXIT_STATUSES, BackendError, ClusterError, ExitStatus, UsageError
from twinstep.processes import disk
from twinstep.version import __version__

COMMANDS = {  # each command's line in 'twinstep --help'; its module is twinstep.cli.<command>
    "certify": "certify the op library's hand-written VJPs (float64)",
    "info": "tensor, scalar and BN counts and forward GMACs of a net",
    "recipe": "decode a recipe name (or a preset) and print every field",
    "parity": "the net against timm + torch autograd, same random weights",
    "tie": "the R-replica sync-BN step against the single-device step at R*N",
    "render": "export a recipe's whole train step to StableHLO (jax.export)",
    "train": "train a recipe with its tied step: data, checkpoints, evaluation, logs",
    "pack": "pack an image folder for training: re-encoded images in ArrayRecord shards",
    "weights": "a training run's weights as a timm state dict (.safetensors or .pth)",
    "plot": "a training run's curves as a PNG (loss, lr, val top-1)",
    "compare": "training runs paired image by image: top-1 intervals, McNemar's test",
    "launch": "run train or tie as P processes on this host, joined into one runtime",
}
EXAMPLES = {  # each command's example, the last line of its --help
    "certify": "twinstep certify --replicas 2",
    "info": "twinstep info efficientnet --res 224",
    "recipe": "twinstep recipe efficientnetin_emarmsdp64dropdo",
    "parity": "twinstep parity mobilenetv2 --res 32 --batch 4",
    "tie": "twinstep tie resnet18 --replicas 2 --control unsynced   # must say NOT tied, exit 1",
    "render": "twinstep render resnet18in_momdp8 --replicas 2 --out renders",
    "train": "twinstep train mnv4_adamdp16 --data ./images --replicas 2 --res 64 --steps 300 "
             "--out run",
    "pack": "twinstep pack ./images --out ./images-packed",
    "weights": "twinstep weights run   # then timm.create_model('local-dir:run/timm', "
               "pretrained=True)",
    "plot": "twinstep plot run --out curves.png",
    "compare": "twinstep compare run-a run-b",
    "launch": "twinstep launch --local 2 -- train mnv4in_adamdp --data digits --replicas 4 "
              "--out run",
}
FIRST = (  # what to run first: `twinstep --help`'s last lines (README: "Train on your own images")
    ("twinstep tie resnet18 --replicas 2", "the tie, in a minute on a CPU"),
    ("twinstep train mnv4_adamdp16 --data digits --replicas 2 --steps 100 --out run",
     "a run on the embedded digits"),
    ("twinstep train mnv4_adamdp16 --data DIR --replicas 2 --res 64 --out run",
     "your own images: DIR/train/<class>/*, DIR/val/<class>/*"),
)
# the commands that never start JAX: no XLA_FLAGS check, no compilation cache
NO_JAX = ("recipe", "plot", "compare", "pack", "launch")
NO_CACHE_HELP = ("compile every program afresh: neither load nor keep compiled programs (also "
                 "TWINSTEP_NO_COMPILE_CACHE=1; kept in ~/.cache/twinstep/jax by default, "
                 "docs/speed.md#compilation-cache)")


def command_of(argv: list[str]) -> str | None:
    """The command an argument list names, if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The parser. Only the command in ``argv`` gets its options (listing them imports what they
    name: nets, controls, JAX); the others are a name and a line."""
    chosen = command_of(sys.argv[1:] if argv is None else argv)
    p = Parser(
        prog="twinstep",
        description="Data-parallel BatchNorm nets (ResNets, MobileNetV2, EfficientNet-B0, "
                    "MobileNetV4) with synchronised BatchNorm, checked parameter by parameter "
                    "against the single-device step at R*N.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'twinstep COMMAND --help' for a command's options and an example.\n\n"
               + textwrap.fill("Exit status: " + "; ".join(
                   f"{s} {meaning}" for s, meaning in EXIT_STATUSES.items()) + ".", 99)
               + "\nErrors are one line on stderr; --debug shows the traceback.\n\n"
               + "First:\n" + "\n".join(f"  {cmd}\n      {what}" for cmd, what in FIRST))
    p.add_argument("--version", action="version", version=f"twinstep {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an internal error (also TWINSTEP_DEBUG=1)")
    p.add_argument("--no-compile-cache", action="store_true", help=NO_CACHE_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    p.commands = {}  # each command's own parser
    for name, line in COMMANDS.items():
        p.commands[name] = sub.add_parser(name, help=line)
        if name == chosen:
            _module(name).add(p.commands[name])
            example = f"example: {EXAMPLES[name]}"
            own = p.commands[name].epilog
            p.commands[name].epilog = example if not own else f"{own}\n\n{example}"
            if name not in NO_JAX:  # after the command too; SUPPRESS keeps the one before it
                p.commands[name].add_argument("--no-compile-cache", action="store_true",
                                              default=argparse.SUPPRESS, help=NO_CACHE_HELP)
    return p


def _module(name: str):
    return importlib.import_module(f"twinstep.cli.{name}")




def main(argv=None) -> int:
    ascii_fallback()
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return ExitStatus.USAGE
    name = args.command
    try:
        if isinstance(getattr(args, "json", None), str):
            disk.check_writable_file(args.json, "--json")
        if args.no_compile_cache:  # the processes a launch starts inherit it
            os.environ["TWINSTEP_NO_COMPILE_CACHE"] = "1"
        if name not in NO_JAX:
            from twinstep.processes import settings  # lazy, the CLI's reason: it imports JAX

            settings.check_xla_flags()
            settings.set_own_xla_flags()
            settings.use_compile_cache()
        return _module(name).run(args, parser.commands[name])
    except UsageError as e:
        print(f"twinstep {args.command}: {e}", file=sys.stderr)
        return settled(ExitStatus.USAGE)
    except (ClusterError, BackendError) as e:
        print(f"twinstep {args.command}: {e}", file=sys.stderr)
        return settled(ExitStatus.INTERNAL)
    except KeyboardInterrupt:
        print(f"twinstep {args.command}: interrupted", file=sys.stderr)
        return ExitStatus.INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the verdict is the exit status, the cause one line
        if args.debug or os.environ.get("TWINSTEP_DEBUG"):
            settled(ExitStatus.INTERNAL)
            raise
        print(f"twinstep {args.command}: internal error: {type(e).__name__}: {e} "
              f"(TWINSTEP_DEBUG=1 shows the traceback)", file=sys.stderr)
        return settled(ExitStatus.INTERNAL)


def settled(status: int) -> int:
    """``status``, once every computation JAX has dispatched has finished. An error raised
    while a step still runs (JAX dispatches asynchronously) would otherwise end the process
    under XLA's threads: exit()'s C++ destructors free what they use, a segfault after the one
    line (docs/platform.md#exit). Called while the error is handled, so its traceback still
    holds the step's outputs. Starts no backend; waits for nothing with several processes,
    where a peer may be gone (`entry` os._exits those)."""
    if "jax" not in sys.modules or _in_a_runtime():
        return status
    # lazy, the CLI's reason: main imports no JAX; here it is loaded already (the test above)
    import jax

    try:  # JAX's own test; it has no public one
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:
        return status
    if not backends_are_initialized():
        return status
    for array in jax.live_arrays():
        try:
            array.block_until_ready()
        except Exception:  # noqa: BLE001 - a failed computation has finished too
            pass
    return status


def _on_interrupt(signum, frame) -> None:
    """Ctrl-C in the executable: one line and `ExitStatus.INTERRUPTED` at once (os._exit: no
    teardown, which can crash while XLA's threads run, and no KeyboardInterrupt for a callback
    to swallow) — unless files are being published, which then finish first
    (`twinstep.processes.disk.publish`)."""
    if disk.publishing:
        disk.interrupted = True
        return
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    sys.stdout.flush()
    known = command in COMMANDS
    print(f"twinstep{' ' + command if known else ''}: interrupted", file=sys.stderr, flush=True)
    os._exit(ExitStatus.INTERRUPTED)


def entry() -> None:
    """The ``twinstep`` executable: main's status as the process's, Ctrl-C as `_on_interrupt`."""
    signal.signal(signal.SIGINT, _on_interrupt)
    status = main()
    if status == ExitStatus.INTERRUPTED or (status != ExitStatus.SUCCESS and _in_a_runtime()):
        # an interrupt: no teardown while XLA's threads run. A failure with several processes:
        # the runtime's shutdown would wait for peers that may be gone (a supervisor waited
        # its 10 s grace for it, then killed the process)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def _in_a_runtime() -> bool:
    """Whether this process joined a multi-process runtime (`twinstep.processes.cluster`)."""
    cluster = sys.modules.get("twinstep.processes.cluster")
    return cluster is not None and cluster.count() > 1
