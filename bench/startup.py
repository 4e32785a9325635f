"""Start-up with and without the compilation cache: wall time of whole commands, each run cold
(an empty cache: every program compiled and kept), warm (the same command again: every program
loaded) and with --no-compile-cache. The table rewrites the section "Start-up" of
bench/RESULTS.md.

  tie mnv4 / tie resnet50   `twinstep tie NET` (f64, R = 2, the defaults)
  train, resumed            `twinstep train mnv4in_adamdp4 --replicas 2 --steps 6` on the digits,
                            resumed from its step-4 checkpoint (its step-6 one removed): a copy
                            of one run for each of off, cold and warm, so all resume the same
                            state

  restart                   `twinstep launch --local 2 --max-restarts 1 -- train mnv4in_momdp2
                            --replicas 4 ...`, process 1 killed with SIGKILL after the step-2
                            checkpoint: seconds from the kill to the first metrics line of the
                            resumed run (the supervisor's stop, the new processes' start, joining,
                            restoring, the first step). "warm": the programs the first attempt
                            compiled are in the cache; "off": --no-compile-cache

Each repeat uses a fresh cache folder (TWINSTEP_COMPILE_CACHE); the commands run as a user runs
them, in their own process.

    python bench/startup.py [--repeats 2] [--nets mnv4 resnet50]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import RESULTS, machine_load, write_results

TRAIN = ["train", "mnv4in_adamdp4", "--replicas", "2", "--res", "32", "--steps", "6",
         "--ckpt-every", "4", "--eval-every", "100", "--log-every", "2"]


def timed(argv: list[str], cache: str, off: bool = False) -> float:
    """Seconds of ``twinstep ARGV`` in its own process, with the cache at ``cache``."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["TWINSTEP_COMPILE_CACHE"] = cache
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "twinstep.cli", *(["--no-compile-cache"] if off
                                                              else []), *argv],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


RESTARTED = ["train", "mnv4in_momdp2", "--data", "digits", "--replicas", "4", "--res", "32",
             "--steps", "8", "--ckpt-every", "1", "--log-every", "1", "--eval-every", "100"]


def restart_seconds(run: str, cache: str, off: bool) -> float:
    """Seconds from killing process 1 of a supervised 2-process run (after its step-2
    checkpoint) to the resumed run's first metrics line."""
    import json
    import signal

    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["TWINSTEP_COMPILE_CACHE"] = cache
    proc = subprocess.Popen([sys.executable, "-m", "twinstep.cli",
                             *(["--no-compile-cache"] if off else []), "launch", "--local", "2",
                             "--max-restarts", "1", "--", *RESTARTED, "--out", run], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt, log, record = (os.path.join(run, n) for n in ("checkpoints/2", "metrics.jsonl",
                                                        "restarts.jsonl"))
    while not os.path.isdir(ckpt):
        assert proc.poll() is None, "the run ended before its step-2 checkpoint"
        time.sleep(0.02)
    child = next(int(p) for p in os.listdir("/proc") if p.isdigit() and _is_process_1(p, proc.pid))
    os.kill(child, signal.SIGKILL)
    fault = time.time()
    while True:
        if os.path.exists(record) and os.path.getmtime(log) > os.path.getmtime(record):
            with open(record) as f:
                resumed = json.loads(f.readline())["resumed_step"]
            with open(log) as f:
                steps = [json.loads(line).get("step", 0) for line in f]
            if max(steps) > resumed:
                took = os.path.getmtime(log) - fault
                break
        assert proc.poll() is None, "the run ended before resuming"
        time.sleep(0.02)
    proc.wait()
    return took


def _is_process_1(pid: str, launcher: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False
    return parent == launcher and b"--process-id" in args and args[
        args.index(b"--process-id") + 1] == b"1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nets", nargs="+", default=["mnv4", "resnet50"])
    args = p.parse_args()
    cases = [f"tie {net}" for net in args.nets] + ["train, resumed", "restart"]
    times: dict = {(c, k): [] for c in cases for k in ("cold", "warm", "off")}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for case in cases if i % 2 == 0 else cases[::-1]:
                cache = os.path.join(tmp, f"cache-{i}-{case.replace(' ', '')}")
                if case.startswith("tie"):
                    argv = case.split()
                    times[case, "off"].append(timed(argv, cache, off=True))
                    times[case, "cold"].append(timed(argv, cache))
                    times[case, "warm"].append(timed(argv, cache))
                    continue
                if case == "restart":
                    for kind in ("off", "warm"):
                        times[case, kind].append(restart_seconds(
                            os.path.join(tmp, f"restart-{i}-{kind}"), cache, kind == "off"))
                    continue
                run = os.path.join(tmp, f"run-{i}")
                timed([*TRAIN, "--out", run], cache, off=True)
                shutil.rmtree(os.path.join(run, "checkpoints", "6"))  # resume from step 4
                for kind in ("off", "cold", "warm"):
                    copy = f"{run}-{kind}"
                    shutil.copytree(run, copy)
                    times[case, kind].append(timed([*TRAIN, "--out", copy], cache,
                                                   off=kind == "off"))
            load.append(machine_load())
    med = {key: statistics.median(v) for key, v in times.items() if v}
    lines = ["| command | --no-compile-cache s | cold s | warm s | warm / cold |",
             "|---|---|---|---|---|"]
    for case in cases[:-1]:
        off, cold, warm = (med[case, k] for k in ("off", "cold", "warm"))
        lines.append(f"| {case} | {off:.1f} | {cold:.1f} | {warm:.1f} | **{warm / cold:.2f}** |")
    lines += ["", "| supervised restart, from the kill to the first resumed step | "
              "--no-compile-cache s | warm s |", "|---|---|---|",
              f"| 2 processes x 2 replicas, mnv4in_momdp2, 32² | {med['restart', 'off']:.1f} | "
              f"{med['restart', 'warm']:.1f} |"]
    write_results(RESULTS, "Start-up",
                  "Whole commands in their own process, with the compilation cache cold (empty), "
                  "warm (the same command again) and off.", "python bench/startup.py "
                  + " ".join(sys.argv[1:]), "\n".join(lines),
                  f"Medians of {args.repeats} repeats, each with a fresh cache folder. The "
                  f"machine's 1-minute load average over the repeats: {min(load):.1f}-"
                  f"{max(load):.1f}.")


if __name__ == "__main__":
    main()
