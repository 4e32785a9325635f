"""`twinstep launch --local P -- COMMAND ...`: P processes of one twinstep command on this host,
joined into one runtime (`twinstep.processes.cluster`), as ``torchrun --standalone`` starts them.

Process i runs ``twinstep COMMAND ... --coordinator localhost:PORT --num-processes P
--process-id i``; its output lines come back prefixed ``[i]``. The first process to fail —
a non-zero exit, or a signal such as kill -9 — stops the others at once (SIGTERM, then SIGKILL),
each stop named on stderr: no process is left waiting on a collective that can never complete.

With ``max_restarts`` N the launcher is a supervisor (docs/hosts.md#restarts): after a failure
it starts all P again, up to N times — a train run resumes from its latest checkpoint, bit for
bit — and each restart is one line and a line of RUN_DIR/restarts.jsonl. Bad usage
(`ExitStatus.USAGE`) and an interrupt (`ExitStatus.INTERRUPTED`) are never restarted. The
launcher's status is `ExitStatus.SUCCESS`, or the last failure's (`KNOWN_STATUS`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from twinstep.errors import ExitStatus, UsageError

GRACE_S = 10  # after SIGTERM, how long a process has before SIGKILL
POLL_S = 0.1
SETTLE_S = 0.5  # after a failure, how long until the cause is chosen among the failed
# a failed process's status passed on as is; a signal or any other status is INTERNAL
KNOWN_STATUS = tuple(s for s in ExitStatus if s != ExitStatus.SUCCESS)
# bad usage fails again the same way; an interrupt is the user's
NO_RESTART = (ExitStatus.USAGE, ExitStatus.INTERRUPTED)
COMMANDS = ("train", "tie")  # the commands that run over several processes


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def commands(processes: int, argv: list[str], port: int,
             gpus_per_process: int | None = None) -> list[tuple[list[str], dict]]:
    """(argv, environment) of each process."""
    if not argv or argv[0] not in COMMANDS:
        raise UsageError(f"launch runs one of {', '.join(COMMANDS)}: 'twinstep launch --local P "
                         f"-- train RECIPE ...'")
    own = [a for a in argv if a.split("=")[0] in ("--coordinator", "--num-processes",
                                                  "--process-id")]
    if own:
        raise UsageError(f"launch sets {own[0].split('=')[0]} itself: drop it")
    out = []
    for i in range(processes):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if gpus_per_process:
            env["JAX_LOCAL_DEVICE_IDS"] = ",".join(
                str(d) for d in range(i * gpus_per_process, (i + 1) * gpus_per_process))
        out.append(([sys.executable, "-m", "twinstep.cli", *argv, "--coordinator",
                     f"localhost:{port}", "--num-processes", str(processes), "--process-id",
                     str(i)], env))
    return out


def _forward(i: int, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.buffer.write(f"[{i}] ".encode() + line)
            sys.stdout.buffer.flush()


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"was killed by signal {-status}"
    return f"exited with status {status}"


def run(processes: int, argv: list[str], *, port: int | None = None,
        gpus_per_process: int | None = None, max_restarts: int = 0,
        restart_delay: float = 0.0) -> int:
    """Start the processes and wait: `ExitStatus.SUCCESS` when all end with it, else the
    failure's status — after up to ``max_restarts`` restarts of all of them, ``restart_delay``
    s after each failure."""
    if processes < 1:
        raise UsageError(f"--local must be >= 1, got {processes}")
    commands(processes, argv, 1, gpus_per_process)  # refuse bad usage before starting any
    for attempt in range(max_restarts + 1):
        status, failed = _attempt(processes, argv, port, gpus_per_process)
        if status in (ExitStatus.SUCCESS, *NO_RESTART) or attempt == max_restarts:
            return status
        step = resume_step(argv)
        print(f"twinstep launch: restart {attempt + 1} of {max_restarts}: process {failed[0]} "
              f"{_describe(failed[1])}" + (f"; resuming from step {step}" if step is not None
                                          else ""), file=sys.stderr, flush=True)
        _record_restart(argv, attempt + 1, failed, step)
        time.sleep(restart_delay)
    return status


def _attempt(processes: int, argv: list[str], port: int | None,
             gpus_per_process: int | None) -> tuple[int, tuple[int, int] | None]:
    """One start of all the processes: (the status, the first failure: (process, status))."""
    port = port or free_port()
    lock = threading.Lock()
    procs, threads = [], []
    for i, (args, env) in enumerate(commands(processes, argv, port, gpus_per_process)):
        p = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        t = threading.Thread(target=_forward, args=(i, p.stdout, lock), daemon=True)
        t.start()
        procs.append(p)
        threads.append(t)
    try:
        failed = _wait(procs)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        _stop(procs, None)
        failed, status = None, ExitStatus.INTERRUPTED
    else:
        status = ExitStatus.SUCCESS
        if failed is not None:
            i, code = failed
            print(f"twinstep launch: process {i} {_describe(code)}; stopping the others",
                  file=sys.stderr, flush=True)
            _stop(procs, i)
            status = ExitStatus(code) if code in KNOWN_STATUS else ExitStatus.INTERNAL
    for t in threads:
        t.join(timeout=5)
    return status, failed


def run_dir(argv: list[str]) -> str | None:
    """A train command's RUN_DIR (its --out), None for another command."""
    if argv[:1] != ["train"]:
        return None
    for i, a in enumerate(argv):
        if a == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--out="):
            return a.split("=", 1)[1]
    return None


def resume_step(argv: list[str]) -> int | None:
    """The step a restarted train run resumes from: its latest whole checkpoint (orbax names
    a finished one by its step alone), 0 with none; None for another command."""
    out = run_dir(argv)
    if out is None:
        return None
    where = os.path.join(out, "checkpoints")
    steps = [int(n) for n in os.listdir(where) if n.isdigit()] if os.path.isdir(where) else []
    return max(steps, default=0)


def _record_restart(argv: list[str], restart: int, failed: tuple[int, int],
                    step: int | None) -> None:
    """A line of RUN_DIR/restarts.jsonl (a train run's), appended."""
    out = run_dir(argv)
    if out is None or not os.path.isdir(out):
        return
    process, code = failed
    entry = {"time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
             "restart": restart, "process": process,
             "status": code if code >= 0 else None,
             "signal": signal.Signals(-code).name if code < 0 and -code in
             signal.valid_signals() else None, "resumed_step": step}
    with open(os.path.join(out, "restarts.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def _wait(procs) -> tuple[int, int] | None:
    """Wait until every process ends (None) or one fails: (its number, its status). A process
    killed by a signal is the cause before one that exited with an error: its peers fail
    within moments of it (their collectives break), so all are looked at again after
    SETTLE_S."""
    while True:
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(SETTLE_S)
            failed = [(i, p.poll()) for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            return min(failed, key=lambda f: (f[1] >= 0, f[0]))
        if all(p.poll() == 0 for p in procs):
            return None
        time.sleep(POLL_S)


def _frozen(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a suspended job); False where /proc is not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _stop(procs, dead: int | None) -> None:
    """SIGTERM every process still running, SIGKILL after GRACE_S; each stop named."""
    if dead is not None:  # the others that failed with it, on their own
        for i, p in enumerate(procs):
            if i != dead and p.poll() not in (None, 0):
                print(f"twinstep launch: process {i} {_describe(p.poll())} too (process {dead} "
                      f"had failed)", file=sys.stderr, flush=True)
    running = [(i, p) for i, p in enumerate(procs) if p.poll() is None]
    for _, p in running:
        # a frozen process (SIGSTOP) would act on SIGTERM only once continued — and then first
        # report its own stall: it goes at once
        p.kill() if _frozen(p.pid) else p.terminate()
    deadline = time.monotonic() + GRACE_S
    for i, p in running:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if dead is not None:
            print(f"twinstep launch: stopped process {i} (process {dead} had failed)",
                  file=sys.stderr, flush=True)
