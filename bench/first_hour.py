"""A new user's first hour, as a script: README's "Train on your own images" on a generated folder
with bad files, killed with SIGKILL after a checkpoint and run again, then run once more when
finished, plotted, exported to timm and scored by timm's own transforms.

The folder: the bundled digits at 128 x 128 (PNG and JPEG alternately; every sixth image is val,
1,497 train and 300 val, 10 classes), plus five train files that do not read: an empty file,
three text files named .jpg (left out before the first step, by their headers) and one JPEG cut
to a third of its bytes (its header reads, its data does not: replaced when first met).

Checks (exit 1 when one fails): `skipped` never exceeds the 5 distinct bad files and ends at 5;
the resumed run starts from the killed run's last count; run/skipped.txt names each of the five
once; a finished run says so; timm's top-1 over val equals twinstep's eval and its mean loss is
within 1e-5 (f32 vs f64 forward). The control: timm's default interpolation for the net
(bicubic) must move the loss past that bound. Without torch and timm ([oracle]) the timm rows
are left out and the verdict says so (exit 4).

    python bench/first_hour.py [--steps 300] [--kill-after 100] [--res 64] [--replicas 2]
                               [--dir DIR] [--no-results]

The table rewrites the section "A first hour" of bench/RESULTS.md (not with --no-results).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, write_results

RECIPE = "mnv4_adamdp16"
BAD = {"class0/broken0.jpg": b"", "class1/broken1.jpg": b"not an image",
       "class2/broken2.jpg": b"not an image" * 2, "class3/broken3.jpg": b"not an image" * 3}
TRUNCATED = "class5/truncated5.jpg"
LOSS_BOUND = 1e-5  # timm's f32 forward against twinstep's eval (f32 too, summed in f64)
TWINSTEP = str(Path(sys.executable).with_name("twinstep"))


def _error(line: str) -> None:
    """Exit 3 (an internal or environment error) with one line."""
    print(f"first_hour: {line}", file=sys.stderr)
    sys.exit(3)


def write_folder(root: Path) -> None:
    """The digits as ROOT/{train,val}/class<d>/<i>.{png,jpg}, 128 x 128 RGB with noise, and the
    five bad train files (BAD, TRUNCATED)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from twinstep.data import digits

    d, rng = load_digits(), np.random.default_rng(0)
    for i, (image, label) in enumerate(zip(d.images, d.target, strict=True)):
        split = "val" if i % digits.VAL_EVERY == 0 else "train"
        big = np.asarray(Image.fromarray((image * 16).astype(np.uint8)).resize((128, 128)),
                         np.float32)
        rgb = np.stack([big, big[::-1], 255 - big], -1) + rng.normal(0, 10, (128, 128, 3))
        folder = root / split / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(
            folder / f"{i}.{'png' if i % 2 else 'jpg'}")
    for name, data in BAD.items():
        (root / "train" / name).write_bytes(data)
    whole = sorted((root / "train" / "class5").glob("*.jpg"))[0].read_bytes()
    (root / "train" / TRUNCATED).write_bytes(whole[: len(whole) // 3])


def metrics(run: Path) -> list[dict]:
    """The rows of run/metrics.jsonl whole (a SIGKILL may cut the last one)."""
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def skipped_series(run: Path) -> list[tuple[int, int]]:
    """(step, skipped) of each training row of run/metrics.jsonl."""
    return [(r["step"], r["skipped"]) for r in metrics(run) if "skipped" in r]


def timm_scores(export: Path, val: str | Path, **change) -> tuple[float, float, list]:
    """(top-1, mean loss, the model's label_names) of the exported model folder over the image
    folder ``val`` with timm's resolve_data_config and create_transform: the export's own config,
    or it with ``change`` (``interpolation="bicubic"``). Also tests/test_train.py's."""
    import timm
    import torch
    from timm.data import create_transform, resolve_data_config
    from torchvision.datasets import ImageFolder

    model = timm.create_model(f"local-dir:{export}", pretrained=True).eval()
    cfg = {**resolve_data_config({}, model=model), **change}
    loader = torch.utils.data.DataLoader(ImageFolder(str(val), create_transform(**cfg)),
                                         batch_size=100)
    n = correct = 0
    loss = 0.0
    with torch.no_grad():
        for x, y in loader:
            out = model(x).double()
            loss += torch.nn.functional.cross_entropy(out, y, reduction="sum").item()
            correct, n = correct + (out.argmax(1) == y).sum().item(), n + len(y)
    return correct / n, loss / n, model.pretrained_cfg.get("label_names")


def walk(work: Path, args) -> dict:
    """Runs the walk in ``work`` (cwd, as a user would); what each step printed and measured."""
    train = [TWINSTEP, "train", RECIPE, "--data", "data", "--replicas", str(args.replicas),
             "--res", str(args.res), "--steps", str(args.steps), "--ckpt-every",
             str(args.kill_after // 2), "--out", "run"]
    out: dict = {}
    t0 = time.monotonic()
    with open(work / "log1", "w") as log:
        proc = subprocess.Popen(train, cwd=work, stdout=log, stderr=subprocess.STDOUT)
        while not (work / "run" / "checkpoints" / str(args.kill_after)).is_dir():
            if proc.poll() is not None:
                _error(f"the run ended ({proc.returncode}) before its step-{args.kill_after} "
                       f"checkpoint; see {work / 'log1'}")
            time.sleep(1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    out["killed_s"] = time.monotonic() - t0
    out["killed"] = skipped_series(work / "run")
    out["log1"] = (work / "log1").read_text().splitlines()
    for name in ("log2", "log3"):  # the same command again: resumed, then finished
        t0 = time.monotonic()
        run = subprocess.run(train, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        out[f"{name}_s"], out[name] = time.monotonic() - t0, run.stdout.splitlines()
        (work / name).write_text(run.stdout)
        if run.returncode:
            _error(f"the run again ended {run.returncode}; see {work / name}")
    out["skipped_txt"] = [line for line in (work / "run" / "skipped.txt").read_text()
                          .splitlines() if not line.startswith("#")]
    for command in (["plot", "run", "--out", "curves.png"], ["weights", "run"]):
        done = subprocess.run([TWINSTEP, *command], cwd=work, capture_output=True, text=True)
        if done.returncode:
            _error(f"twinstep {' '.join(command)} ended {done.returncode}: {done.stderr.strip()}")
    out["weights"] = done.stdout.strip()
    out["eval"] = [r for r in metrics(work / "run") if "eval" in r][-1]["eval"]["raw"]
    return out


def checks(out: dict, timm_rows: dict | None, kill_after: int) -> list[str]:
    """The failed checks, one line each (empty: all hold)."""
    bad = len(BAD) + 1
    failed = []
    before = [s for step, s in out["killed"] if step <= kill_after]
    after = [s for step, s in out["final"] if step > kill_after]
    # a run shorter than an epoch may never meet the truncated file: then it ends at 4
    least = bad if out.get("epochs", 1) >= 1 else len(BAD)
    if max(before + after) > bad or not least <= (after or [0])[-1] == len(out["skipped_txt"]):
        failed.append(f"skipped should end at {bad} (at {least} within an epoch), the lines of "
                      f"run/skipped.txt, and never pass it: {before} then {after}")
    if after and before and after[0] < before[-1]:
        failed.append(f"the resumed run's skipped ({after[0]}) fell below the killed run's "
                      f"({before[-1]})")
    named = {line.split("\t")[-1] for line in out["skipped_txt"]}
    bad_files = {f"data/train/{n}" for n in [*BAD, TRUNCATED]}
    if len(named) != len(out["skipped_txt"]) or not named <= bad_files \
            or len(named) < least:
        failed.append(f"run/skipped.txt names {named}")
    if not any("already finished" in line for line in out["log3"]):
        failed.append("a finished run run again did not say it was finished")
    if timm_rows:
        ours, (top1, loss), (_, control) = out["eval"], timm_rows["exported"], timm_rows["bicubic"]
        if top1 != ours["top1"] or abs(loss - ours["loss"]) > LOSS_BOUND:
            failed.append(f"timm scores the export {top1:.4f} / {loss:.6f}, twinstep "
                          f"{ours['top1']:.4f} / {ours['loss']:.6f}")
        if abs(control - ours["loss"]) <= LOSS_BOUND:
            failed.append("control: bicubic scores within the bound, so it cannot tell")
    return failed


def table(out: dict, timm_rows: dict | None, args) -> str:
    series = lambda rows: ", ".join(str(s) for _, s in rows)  # noqa: E731
    ours = out["eval"]
    rows = [("first line", out["log1"][0]),
            ("bad files named", f"{sum('does not read' in line for line in out['log1'])} "
                                f"warnings; run/skipped.txt {len(out['skipped_txt'])} lines"),
            ("skipped, killed run", series(out["killed"])),
            ("skipped, after the resume",
             series([r for r in out["final"] if r[0] > args.kill_after])),
            ("the resume's first lines", " / ".join(out["log2"][1:3])),
            ("a finished run again",
             next((line for line in out["log3"] if "finished" in line), "(nothing said)")),
            ("weights", out["weights"]),
            ("twinstep eval, val", f"top-1 {100 * ours['top1']:.1f} %, loss {ours['loss']:.6f}")]
    if timm_rows:
        for name, (top1, loss) in timm_rows.items():
            rows.append((f"timm, {name}", f"top-1 {100 * top1:.1f} %, loss {loss:.6f}"))
    rows += [("wall: to the kill, the resume, finished again", f"{out['killed_s']:.0f} s, "
              f"{out['log2_s']:.0f} s, {out['log3_s']:.0f} s"),
             ("img/s, the last logged", f"{out['img_per_s']:.0f} img/s")]
    cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    return "| | |\n|---|---|\n" + "".join(f"| {a} | {cell(b)} |\n" for a, b in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-after", type=int, default=100, help="the checkpoint to kill after")
    p.add_argument("--res", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--dir", help="work here (kept); default: a temporary folder, removed")
    p.add_argument("--no-results", action="store_true", help="leave bench/RESULTS.md as it is")
    args = p.parse_args(argv)
    if args.kill_after % 2 or not 0 < args.kill_after < args.steps:
        p.error("--kill-after: an even step before --steps (checkpoints every kill-after/2)")
    work = Path(args.dir or tempfile.mkdtemp(prefix="first-hour-"))
    try:
        if (work / "run").exists():
            p.error(f"--dir {work} holds a run already")
        write_folder(work / "data")
        out = walk(work, args)
        out["final"] = skipped_series(work / "run")
        last = [r for r in metrics(work / "run") if "epoch" in r][-1]
        out["epochs"], out["img_per_s"] = last["epoch"], last["img_per_s"]
        try:
            timm_rows = {name: timm_scores(work / "run" / "timm", work / "data" / "val",
                                           **change)[:2]
                         for name, change in (("exported", {}),
                                              ("bicubic", {"interpolation": "bicubic"}))}
        except ImportError:
            timm_rows = None
        failed = checks(out, timm_rows, args.kill_after)
        md = table(out, timm_rows, args)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    what = (f"README's `twinstep train {RECIPE} --data DIR --replicas {args.replicas} --res "
            f"{args.res} --steps {args.steps}` on the digits as a folder of 128² PNG/JPEG "
            f"(1,497 train, 300 val) with {len(BAD) + 1} bad train files, killed with SIGKILL "
            f"after its step-{args.kill_after} checkpoint, run again, run once more finished; "
            "then plot, weights and timm's own eval of the export.")
    command = "python bench/first_hour.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.no_results:
        print(md)
    else:
        write_results(RESULTS, "A first hour", what, command, md,
                      "timm, exported: the export's config (bilinear, crop 0.95); timm, bicubic: "
                      "timm's default for the net, the control that must differ.")
    for line in failed:
        print(f"first_hour: FAILED: {line}", file=sys.stderr)
    if failed:
        return 1
    if timm_rows is None:
        print("first_hour: inconclusive: torch and timm ([oracle]) are not installed",
              file=sys.stderr)
        return 4
    print("first_hour: every check holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
