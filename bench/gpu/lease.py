"""One lease, one command: what a lent GPU must measure, in the order of what it decides, each
part under its own time limit and the whole under a deadline, one summary table printed last.

`bash bench/gpu.sh lease` installs what the parts need and runs this. The parts, in this order,
each in a process of its own (stopped with its loader workers when its time is up):

  feed   the device loader's feed (bench/gpu/feed.py): nvJPEG against libjpeg-turbo in levels
         on generated JPEGs, the host's and the GPU's img/s
  train  ResNet-50's `twinstep train` through `--loader device` and `--loader pillow` against
         its bare step (bench/gpu/train.py --bare), over the last quarter of its steps, after
         the prefetch buffer drains: train / bare step (goal 0.95) and the device loader's
         feed / the step (goal 1.3)
  ab     ResNet-50's step against each candidate of `CANDIDATES`, interleaved
         (bench/gpu/kernel_profile.py --candidates): the levers and the XLA options this XLA
         takes, each judged by the adoption rule (bench/gpu/lease_table.py, bench/README.md)
  nets   each catalogue net's step at 224² (bench/gpu/step.py), MobileNetV4 first, as many as
         fit

Time: a part starts only with at least its ``least`` seconds left before the deadline, less
``RESERVE`` (the summary's and gpu.sh's copy of the autotuning results); else "skipped: no
time". It runs under the smaller of its own limit and what is left, and is stopped there
("cut"). Each part writes its JSON as it goes, so a part cut short keeps what it finished.
Writes under --out each part's JSON, lease_log.txt (every part's output) and
lease_summary.json, then prints the table (bench/gpu/lease_table.py), last.

--twin: the CPU twin, on this machine's JAX: every part at tiny shapes (32², batches of 2 to 4,
ResNet-18 for ResNet-50), the same scripts and code up to the device (tests/test_gpu_lease.py
runs it whole). Where nvImageCodec does not import, the feed and the device path are skipped,
and the table says so.

    bash bench/gpu.sh lease                          # LEASE_DEADLINE=540 s from its start
    python bench/gpu/lease.py --out DIR [--deadline 540] [--parts feed train ab nets]
                              [--nets NET ...] [--twin]

Exit: 0 every part ran; 1 a check failed (the twin's batch decode is not the one-at-a-time
decode); 2 bad usage, or no GPU without --twin; 3 a part failed; 4 a part was cut or skipped
(what the lease answers is incomplete).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.gpu import lease_table
from bench.gpu.kernel_profile import XLA_CANDIDATES
from twinstep.nets import NETS

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent
# the A/B's candidates, in the order the issue ranks them: a cut part keeps the first ones
CANDIDATES = ("store=bf16", "relu_mask=bits", "store=bf16, relu_mask=bits", *XLA_CANDIDATES)
# MobileNetV4 first (its goal), then the catalogue; ResNet-50 last: the A/B timed its step
NETS_ORDER = ("mnv4", *(n for n in NETS if n not in ("mnv4", "resnet50")), "resnet50")


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    limit: int  # seconds on a GPU; the twin's next
    twin_limit: int
    least: int  # seconds it needs to finish anything: less than that left, it is skipped
    twin_least: int = 3


# The GPU's limits, from the two leases (bench/RESULTS.md#gpu, #gpu-profile, bench/leases/
# 2026-12-05-h100/log.txt). feed has not run on a GPU: its 1,024 JPEGs a split took 33 s to
# write (H200), the rest about a minute. train: the H200 ran ResNet-50's two Pillow paths of
# 40 steps in about 150 s, JPEGs included; now 160 steps and the bare step (ResNet-50 compiles
# in 26 s at batch 512 on the H100), the JPEGs the feed's. ab: the default's compile, then per
# candidate a compile and 5 rounds of 2 x 11 steps of 104 ms, about 40 s each. nets: the
# rest; MobileNetV4's compile alone took 81 s at batch 256 (H200).
PARTS = (Part("feed", 150, 120, 60), Part("train", 200, 180, 90), Part("ab", 240, 240, 60),
         Part("nets", 400, 120, 90))
RESERVE = {False: 20, True: 2}  # seconds kept after the last part (GPU, twin)
# the parts' sizes on a GPU and in the twin: (GPU's arguments, the twin's)
SIZES = {
    "feed": (["--res", "224", "--batch", "256", "--images", "1024"],
             ["--res", "32", "--batch", "4", "--images", "16", "--workers", "1", "--steps", "4",
              "--repeats", "2"]),
    "train": (["--res", "224", "--batch", "256", "--steps", "160", "--images", "1024"],
              ["--res", "32", "--batch", "4", "--steps", "8", "--images", "16", "--workers",
               "1"]),
    "ab": (["--batch", "512", "--res", "224", "--steps", "8", "--rounds", "5", "--traced", "1"],
           ["--batch", "2", "--res", "32", "--classes", "10", "--steps", "1", "--rounds", "2",
            "--traced", "1", "--cpu-twin"]),
    "nets": (["--batch", "256", "--res", "224", "--steps", "30"],
             ["--batch", "2", "--res", "32", "--classes", "10", "--steps", "3", "--cpu-twin"]),
}


def nets_of(args) -> list[str]:
    """The nets part's nets: --nets, else the twin's one or `NETS_ORDER`."""
    return args.nets or (["resnet18"] if args.twin else list(NETS_ORDER))


def command(part: str, args, data: str, limit: int, device_path: bool) -> list[str]:
    """The part's command line: its script at the GPU's or the twin's sizes, its JSON under
    --out; ``data`` the JPEG folder feed and train share."""
    net = "resnet18" if args.twin else "resnet50"
    out = str(args.out)
    argv = {
        "feed": ["feed.py", "--data", data, "--json", f"{out}/lease_feed.json"],
        "train": ["train.py", "--nets", net, "--bare", "--randaugment", "9", "--data", data,
                  "--paths", *(["device"] if device_path else []), "pillow",
                  "--json", f"{out}/lease_train.json"],
        "ab": ["kernel_profile.py", "--nets", net, "--out", out, "--limit", str(limit),
               "--candidates", *CANDIDATES],
        "nets": ["step.py", "--nets", *nets_of(args), "--json", f"{out}/lease_nets.json"],
    }[part]
    argv += SIZES[part][args.twin] + (["--no-such-option"] if part in args.fail else [])
    return [sys.executable, str(SCRIPTS / argv[0]), *argv[1:]]


class Stopped(Exception):
    """SIGTERM or SIGINT: the running part is stopped, the rest skipped, the summary written."""


def _stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def stop(proc: subprocess.Popen) -> None:
    """Stop a part's process group (its loader workers too): SIGTERM, 5 s, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_part(argv: list[str], env: dict, limit: float, log) -> int | None:
    """Run ``argv`` under ``limit`` seconds, its output copied to stdout and ``log`` (binary);
    its exit status, None when the limit cut it."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)

    def copy():
        for line in proc.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            log.write(line)

    copier = threading.Thread(target=copy, daemon=True)
    copier.start()
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        rc = None
    finally:  # cut, stopped or done: no process of the part outlives it
        stop(proc)
    copier.join(timeout=3)  # its processes are gone: the pipe is closed or soon will be
    log.flush()
    return rc


def has_nvimgcodec() -> bool:
    """Whether nvImageCodec imports here (in a process of its own: its libraries load then)."""
    return subprocess.run([sys.executable, "-c", "import nvidia.nvimgcodec"],
                          capture_output=True).returncode == 0


def schedule(parts, deadline: float, twin: bool, run, clock=time.monotonic,
             skip: dict | None = None) -> list[dict]:
    """Run each part (``run(part, limit) -> exit status or None when cut``) while the deadline
    (seconds from now) leaves it its ``least``: [{"part", "status", "rc", "wall_s",
    "limit_s"}] in order. Statuses: ran, failed: exit N, cut: its limit, cut: the deadline,
    skipped: no time, skipped: <``skip``'s reason>, skipped: stopped."""
    start, done, stopped = clock(), [], False
    for part in parts:
        row = {"part": part.name, "rc": None, "wall_s": 0.0, "limit_s": None}
        own = part.twin_limit if twin else part.limit
        left = deadline - (clock() - start) - RESERVE[twin]
        try:
            if stopped:
                row["status"] = "skipped: stopped"
            elif skip and part.name in skip:
                row["status"] = f"skipped: {skip[part.name]}"
            elif left < (part.twin_least if twin else part.least):
                row["status"] = "skipped: no time"
            else:
                limit = int(min(own, left))
                row["limit_s"], t0 = limit, clock()
                rc = run(part, limit)
                row |= {"rc": rc, "wall_s": round(clock() - t0, 1)}
                row["status"] = ("ran" if rc == 0 else f"failed: exit {rc}" if rc is not None
                                 else f"cut: its limit, {limit} s" if limit >= own
                                 else "cut: the deadline")
        except Stopped:  # the part (if one ran) is stopped already; the rest are skipped
            stopped = True
            row["status"] = "stopped" if row["limit_s"] else "skipped: stopped"
            row["wall_s"] = round(clock() - t0, 1) if row["limit_s"] else 0.0
        done.append(row)
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "lease",
                   help="where the parts' files go (default: bench/lease/)")
    p.add_argument("--deadline", type=int, default=540,
                   help="seconds the whole may take, from now (default: 540)")
    p.add_argument("--parts", nargs="+", choices=[q.name for q in PARTS],
                   default=[q.name for q in PARTS], help="these parts, in the lease's order")
    p.add_argument("--nets", nargs="+", choices=list(NETS), help="the nets part's nets")
    p.add_argument("--twin", action="store_true", help="the CPU twin: tiny shapes, no GPU")
    p.add_argument("--fail", nargs="+", default=[], help=argparse.SUPPRESS)  # a test's control
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    if args.deadline <= 0:
        print("lease.py: --deadline must be a positive number of seconds", file=sys.stderr)
        return 2
    if not args.twin and (shutil.which("nvidia-smi") is None or subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True).returncode):
        print("lease.py: no NVIDIA GPU on this machine (--twin runs its CPU twin)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    net, res = ("resnet18", 32) if args.twin else ("resnet50", 224)
    files = {"feed": args.out / "lease_feed.json", "train": args.out / "lease_train.json",
             "ab": args.out / f"profile_{net}_{res}.json", "nets": args.out / "lease_nets.json"}
    for path in (*files.values(), args.out / "lease_summary.json"):  # an earlier lease's
        path.unlink(missing_ok=True)
    nvimgcodec = has_nvimgcodec()
    skip = {} if nvimgcodec else {"feed": "nvImageCodec does not import"}
    data = tempfile.mkdtemp(prefix="twinstep-lease-")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), PYTHONUNBUFFERED="1")
    if args.twin:  # the twin looks for no GPU
        env.setdefault("JAX_PLATFORMS", "cpu")
    parts = [q for q in PARTS if q.name in args.parts]
    old = {s: signal.signal(s, _stopped) for s in (signal.SIGTERM, signal.SIGINT)}
    with open(args.out / "lease_log.txt", "wb") as log:

        def run(part: Part, limit: int) -> int | None:
            argv = command(part.name, args, os.path.join(data, "folder"), limit, nvimgcodec)
            # the loaders' processes decode on the GPU, each with a CUDA context of its own
            own = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.6"} if part.name in ("feed",
                                                                              "train") else {}
            said = f"lease: {part.name}, at most {limit} s: {' '.join(argv)}\n"
            sys.stdout.write(said)
            sys.stdout.flush()
            log.write(said.encode())
            return run_part(argv, {**env, **own}, limit, log)

        try:
            rows = schedule(parts, args.deadline, args.twin, run, skip=skip)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            shutil.rmtree(data, ignore_errors=True)
    summary = lease_table.summarise(rows, files, twin=args.twin, deadline=args.deadline,
                                    device_path=nvimgcodec, candidates=CANDIDATES,
                                    nets=nets_of(args))
    (args.out / "lease_summary.json").write_text(json.dumps(summary, indent=1))
    print(lease_table.render(summary), flush=True)
    return summary["exit"]


if __name__ == "__main__":
    sys.exit(main())
