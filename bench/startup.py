"""Start-up with and without the compilation cache: wall time of whole commands, each run cold
(an empty cache: every program compiled and kept), warm (the same command again: every program
loaded) and with --no-compile-cache. The table rewrites the section "Start-up" of
bench/RESULTS.md.

  tie mnv4 / tie resnet50   `twinstep tie NET` (f64, R = 2, the defaults)
  train, resumed            `twinstep train mnv4in_adamdp4 --replicas 2 --steps 6` on the digits,
                            resumed from its step-4 checkpoint (its step-6 one removed): a copy
                            of one run for each of off, cold and warm, so all resume the same
                            state

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine_load, write_results  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--nets", nargs="+", default=["mnv4", "resnet50"])
    args = p.parse_args()
    cases = [f"tie {net}" for net in args.nets] + ["train, resumed"]
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
                run = os.path.join(tmp, f"run-{i}")
                timed([*TRAIN, "--out", run], cache, off=True)
                shutil.rmtree(os.path.join(run, "checkpoints", "6"))  # resume from step 4
                for kind in ("off", "cold", "warm"):
                    copy = f"{run}-{kind}"
                    shutil.copytree(run, copy)
                    times[case, kind].append(timed([*TRAIN, "--out", copy], cache,
                                                   off=kind == "off"))
            load.append(machine_load())
    med = {key: statistics.median(v) for key, v in times.items()}
    lines = ["| command | --no-compile-cache s | cold s | warm s | warm / cold |",
             "|---|---|---|---|---|"]
    for case in cases:
        off, cold, warm = (med[case, k] for k in ("off", "cold", "warm"))
        lines.append(f"| {case} | {off:.1f} | {cold:.1f} | {warm:.1f} | **{warm / cold:.2f}** |")
    write_results(RESULTS, "Start-up",
                  "Whole commands in their own process, with the compilation cache cold (empty), "
                  "warm (the same command again) and off.", "python bench/startup.py "
                  + " ".join(sys.argv[1:]), "\n".join(lines),
                  f"Medians of {args.repeats} repeats, each with a fresh cache folder. The "
                  f"machine's 1-minute load average over the repeats: {min(load):.1f}-"
                  f"{max(load):.1f}.")


if __name__ == "__main__":
    main()
