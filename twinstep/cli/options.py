"""The options several commands share, defined once, and the parser every command uses: its
errors are one line ("twinstep tie: --res: not an integer: 'x'"), `ExitStatus.USAGE`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap

from twinstep.defaults import MAX_REPLICAS
from twinstep.errors import ALWAYS, EXIT_STATUSES, ExitStatus
from twinstep.processes import disk

SEEDS = 2**31  # seeds are 0 <= seed < 2^31 (NumPy's and JAX's generators take them alike)


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line, `ExitStatus.USAGE`: the usage is one --help away."""

    def error(self, message: str):
        self.exit(ExitStatus.USAGE, f"{self.prog}: {message}\n")


def exits(own: dict[int, str]) -> str:
    """A command's exit statuses for its --help, wrapped: ``own`` says what success (and a failed
    check, inconclusive, or one of `ALWAYS` when it says more) means for it; the rest are
    `EXIT_STATUSES`'s words. A status not in that table is refused (ValueError)."""
    words = {int(s): EXIT_STATUSES[s] for s in ALWAYS}
    words.update({int(ExitStatus(s)): meaning for s, meaning in own.items()})
    return textwrap.fill("Exit " + ", ".join(f"{s} {words[s]}" for s in sorted(words)) + ".",
                         99)


def int_in(low: int, high: int | None = None):
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


def count(p, flag: str, default, help: str, *, metavar: str | None = None, least: int = 1,
          **kw) -> None:
    """An integer option that must be >= ``least`` (--replicas, --batch, --res, --steps: 1;
    --classes: 2)."""
    p.add_argument(flag, type=int_in(least), default=default, metavar=metavar, help=help, **kw)


def replicas(p, default, help: str, metavar: str = "R", **kw) -> None:
    """--replicas: an integer in [1, MAX_REPLICAS], refused before JAX creates a device."""
    p.add_argument("--replicas", type=int_in(1, MAX_REPLICAS + 1), default=default,
                   metavar=metavar, help=help, **kw)


def json_out(p, help: str = "also write the report as JSON") -> None:
    p.add_argument("--json", metavar="PATH", help=help)


def json_print(p) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def seed(p) -> None:
    p.add_argument("--seed", type=int_in(0, SEEDS), default=0,
                   help="random seed, 0 <= seed < 2^31 (default 0)")


def cluster(p) -> None:
    """The flags that join JAX's multi-controller runtime (docs/hosts.md)."""
    g = p.add_argument_group(
        "many processes", "one process per host (or 'twinstep launch --local P'), each given "
        "the same command and its own --process-id; without these flags a SLURM step or "
        "JAX_COORDINATOR_ADDRESS is detected, else the run is one process (docs/hosts.md)")
    g.add_argument("--coordinator", metavar="HOST:PORT",
                   help="where process 0 serves the runtime's coordination (a free port on its "
                        "host, reachable from every other host)")
    count(g, "--num-processes", None, "how many processes take part, P", metavar="P")
    g.add_argument("--process-id", type=int_in(0), metavar="I",
                   help="this process's number, 0 .. P-1 (0 writes the logs and reports)")


def join(args, replicas: int) -> None:
    """Join the runtime the flags (or the environment) name, before JAX's first operation;
    ``replicas``: the run's R, all processes together (each asks for its share of devices)."""
    from twinstep import api  # the CLI: every command imports this module, few join a runtime

    api.join(args.coordinator, args.num_processes, args.process_id, replicas)


def levers(p, whom: str) -> None:
    """--gpu-levers and one flag per lever (`twinstep.ops.levers.Levers`' fields: its choices
    and help), each setting ``whom``'s; a lever left unset takes the platform's."""
    from twinstep.ops import levers as lever_table  # the CLI: JAX only for the commands with levers

    p.add_argument("--gpu-levers", action="store_const", const=True,
                   help=f"build {whom} as a GPU's are built (every lever at a GPU's value: "
                        f"cuDNN's conv paths, symmetric padding, one-pass BN moments), to tie "
                        f"them on this machine; the flags below override it "
                        f"(docs/precision.md#gpu-levers)")
    for f in lever_table.fields():
        flag, choices = "--" + f.name.replace("_", "-"), f.metadata["choices"]
        if set(choices) == {True, False}:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f.metadata["help"])
        else:
            p.add_argument(flag, choices=choices, help=f.metadata["help"])


def chosen_levers(given: dict):
    """The `Levers` that `levers`' flags in ``given`` (an argparse namespace's dict)
    choose; they are taken out of ``given``."""
    from twinstep.ops import levers as lever_table  # as in `levers`

    return lever_table.Levers.chosen(
        gpu=bool(given.pop("gpu_levers", None)),
        **{f.name: given.pop(f.name, None) for f in lever_table.fields()})


def defaults(config_class) -> dict:
    """A config dataclass's field defaults: the CLI's defaults are the library's."""
    return {f.name: f.default for f in dataclasses.fields(config_class)}


def write_json(path: str | None, data: dict) -> None:
    """The report at ``path``, whole or not at all."""
    if path:
        disk.publish({path: json.dumps(data, indent=1).encode()})
