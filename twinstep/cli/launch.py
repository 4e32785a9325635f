"""``twinstep launch --local P -- COMMAND``: P processes of a command on this host, joined into
one JAX runtime, as ``torchrun --standalone`` does (docs/hosts.md#one-host-many-processes)."""

from __future__ import annotations

import argparse

from twinstep.cli import options
from twinstep.errors import ExitStatus
from twinstep.processes import launcher


def add(p) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Start P processes of a twinstep command on this host, joined into one JAX runtime: "
        "process i runs\nthe command with --coordinator localhost:PORT --num-processes P "
        "--process-id i, its output prefixed\n[i]. The first process to fail stops the others "
        f"(SIGTERM, SIGKILL after {launcher.GRACE_S} s); with --max-restarts N\nall start again, "
        "up to "
        "N times, a train run from its latest checkpoint. On several hosts, run\nthe command "
        "on each with those flags, or under srun (docs/hosts.md).\n\n"
        + options.exits({ExitStatus.SUCCESS: f"when every process ends with "
                                             f"{ExitStatus.SUCCESS:d}, else the last failed "
                                             f"process's status ({ExitStatus.INTERNAL:d} for a "
                                             f"signal or a status outside the contract)"}))
    options.count(p, "--local", None, "processes to start on this host", metavar="P", required=True)
    p.add_argument("--port", type=options.int_in(1, 65536), metavar="PORT",
                   help="the coordinator's port (default: a free one)")
    options.count(p, "--gpus-per-process", None, "give process i GPUs i*G .. (i+1)*G-1 "
                                                 "(JAX_LOCAL_DEVICE_IDS); default: JAX's",
                  metavar="G")
    p.add_argument("--max-restarts", type=options.int_in(0, 1001), default=0, metavar="N",
                   help="when a process fails, stop the others and start all again, up to N "
                        "times: a train run resumes from its latest checkpoint; each restart is "
                        "a line here and in RUN_DIR/restarts.jsonl (default 0: stop)")
    p.add_argument("--restart-delay", type=float, default=0.0, metavar="S",
                   help="seconds to wait before a restart (default 0)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the twinstep command each process runs (train or tie)")


def run(args, parser) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not 0 <= args.restart_delay <= 3600:  # also refuses nan
        parser.error(f"--restart-delay must be in [0, 3600] s, got {args.restart_delay}")
    return launcher.run(args.local, cmd, port=args.port, gpus_per_process=args.gpus_per_process,
                        max_restarts=args.max_restarts, restart_delay=args.restart_delay)
