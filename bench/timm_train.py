"""twinstep's training against timm's, one recipe on one image folder: `twinstep train` (the
CLI, cold, then warm from its compilation cache) beside a torch loop written as timm's train.py
writes it — timm's dataset, loader and transforms (the same as twinstep's: random-resized crop,
flip, the recipe's RandAugment and mix, no colour jitter; eval resize bilinear, crop 0.95), and the
recipe's optimizer, per-update schedule, loss, clip, accumulation and EMA from timm's own
components (tests/timm_recipe.py, the loop oracle's) — from the same initial weights, at the same
global batch, steps, workers and seed. Each side runs as its own process tree; the table rewrites
the section "Against timm's training" of bench/RESULTS.md.

Reported per side: the final top-1 and top-5 over the whole val split, top-1 with its 95 %
Wilson interval (`twinstep.training.stats.interval`); the steady img/s (images over the
second half of the steps, from the logged times); the wall time from the command's start to
its exit (start-up, compilation, the final evaluation); the peak memory of the whole process
tree (the sum of its processes' PSS, sampled every 0.2 s), and of its largest process.

    python bench/timm_train.py [--folder DIR] [--recipe mnv4in_adamdp16] [--batch 64]
                               [--replicas 1 4] [--res 32 64] [--steps 100] [--workers 2]

Without --folder the digits are written as a 10-class folder of 64 x 64 PNGs (1,497 train,
300 val, the digits' own split).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import RESULTS, write_results

LOG_EVERY = 10
# tests/, where the timm side imports timm_recipe from (with its neighbours, by their bare
# names, as pytest imports them): on that process's PYTHONPATH
TESTS = Path(__file__).resolve().parents[1] / "tests"


def write_digits(root: str) -> None:
    """The embedded digits as ROOT/{train,val}/<digit>/<i>.png, 64 x 64 grey RGB."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    from twinstep.data import digits

    d = load_digits()
    for i, (image, label) in enumerate(zip(d.images, d.target, strict=True)):
        split = "val" if i % digits.VAL_EVERY == 0 else "train"
        folder = os.path.join(root, split, str(label))
        os.makedirs(folder, exist_ok=True)
        grey = Image.fromarray((image * 255 / 16).astype(np.uint8)).resize(
            (64, 64), Image.Resampling.BILINEAR)
        grey.convert("RGB").save(os.path.join(folder, f"{i}.png"))


def watched(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` to its end: {"wall_s", "peak_gib" (the tree's summed PSS), "largest_gib"
    (its largest process's peak), "largest" (that process's command, shortened)}."""
    import psutil

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    peak, largest = [0.0], {}
    stop = threading.Event()

    def sample():
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            total = 0.0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    pss = p.memory_full_info().pss / 2**30
                    name = " ".join(p.cmdline()[:3])[-60:]
                except psutil.Error:
                    continue
                total += pss
                largest[name] = max(largest.get(name, 0.0), pss)
            peak[0] = max(peak[0], total)
            stop.wait(0.2)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    if proc.returncode != 0:
        sys.exit(f"timm_train.py: {' '.join(cmd[:3])} exited {proc.returncode}: "
                 f"{err.strip().splitlines()[-1:]}")
    name, most = max(largest.items(), key=lambda kv: kv[1])
    return {"wall_s": wall, "peak_gib": peak[0], "largest_gib": most, "largest": name}


def twinstep_side(args, res: int, replicas: int, weights: str, out: str) -> dict:
    """`twinstep train` at ``replicas`` x (batch / replicas), cold (a compilation cache of its
    own, empty) and again warm (from that cache, into another RUN_DIR): the cold run's img/s,
    top-1 and top-5, both runs' wall time and peak memory."""
    from twinstep import recipes

    env = {**os.environ, "TWINSTEP_COMPILE_CACHE": out + "-cache"}
    cold = _twinstep_run(args, res, replicas, weights, out, env)
    warm = _twinstep_run(args, res, replicas, weights, out + "-warm", env)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # a train record's img/s is over every step after the first: its time since that step's end
    per_step = args.batch * recipes.parse(args.recipe).accum
    ends = {r["step"]: (r["step"] - 1) * per_step / r["img_per_s"] for r in records
            if "img_per_s" in r}
    raw = [r for r in records if "eval" in r][-1]["eval"]["raw"]
    return {**cold, **{k + "_warm": v for k, v in warm.items()},
            "img_s": steady(ends, per_step, args.steps), "top1": raw["top1"],
            "top5": raw["top5"]}


def _twinstep_run(args, res: int, replicas: int, weights: str, out: str, env: dict) -> dict:
    return watched([
        sys.executable, "-m", "twinstep.cli", "train", args.recipe, "--data", args.folder,
        "--out", out, "--replicas", str(replicas), "--batch", str(args.batch // replicas),
        "--res", str(res), "--steps", str(args.steps), "--eval-every", str(args.steps),
        "--ckpt-every", str(args.steps), "--log-every", str(LOG_EVERY), "--workers",
        str(args.workers), "--seed", str(args.seed), "--init-from", weights], env)


def steady(ends: dict, images: int, steps: int) -> float:
    """img/s over the run's second half, from {step: when it ended} at every LOG_EVERY-th step
    (the first steps run slower: the loader's workers start, the caches warm)."""
    half = next(s for s in sorted(ends) if s >= steps // 2)
    return (steps - half) * images / (ends[steps] - ends[half])


def timm_side(args) -> None:
    """The torch loop (run as ``--side timm``): writes {"img_s", "top1", "top5"} to --json."""
    import timm
    import timm.data
    import timm_recipe  # from TESTS, on this process's PYTHONPATH
    import torch

    from twinstep.training import state_dict
    from twinstep.training.config import TrainConfig

    torch.manual_seed(args.seed)  # the loader workers' seeds (crops, flips, RandAugment)
    recipe = TrainConfig(args.recipe, "unused", replicas=1, batch=args.batch, res=args.res[0],
                         steps=args.steps, data=args.folder).parsed_recipe()
    if recipe.drop or recipe.dropout:
        sys.exit("timm_train.py: recipes with drop or dropout are not mapped to timm here")
    res, rows, k = args.res[0], args.batch, recipe.accum
    train = timm.data.create_dataset("", root=args.folder, split="train", is_training=True)
    val = timm.data.create_dataset("", root=args.folder, split="val")
    classes = len(train.reader.class_to_idx)
    model = timm.create_model(args.timm_name, num_classes=classes)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in
                           state_dict.load(args.weights).items()}, strict=False)
    opt = timm_recipe.optimizer(model, recipe)
    sched, per = timm_recipe.scheduler(opt, recipe)
    ema = timm_recipe.ema(model, recipe)
    mixing = recipe.mixup > 0 or recipe.cutmix > 0
    mix = timm.data.Mixup(recipe.mixup, recipe.cutmix, label_smoothing=(
        recipe.effective_label_smoothing), num_classes=classes) if mixing else None
    loss_fn = timm_recipe.loss(recipe, mixing)
    aa = f"rand-m{recipe.randaugment}-mstd0.5-inc1" if recipe.randaugment else None
    loader = timm.data.create_loader(
        train, (3, res, res), rows, is_training=True, use_prefetcher=False, color_jitter=None,
        auto_augment=aa, interpolation="random", num_workers=args.workers, device="cpu")

    def batches():
        while True:
            yield from loader

    stream, updates, ends, t0 = batches(), 0, {}, time.perf_counter()
    model.train()
    while updates < args.steps:
        for _ in range(k):
            x, y = next(stream)
            if mix is not None:
                x, y = mix(x, y)
            (loss_fn(model(x), y) / k).backward()
        updates = timm_recipe.update(model, recipe, opt, sched, per, ema, updates)
        if updates % LOG_EVERY == 0 or updates == args.steps:
            ends[updates] = time.perf_counter() - t0
    img_s = steady(ends, rows * k, args.steps)
    evaluated = timm.data.create_loader(val, (3, res, res), rows, use_prefetcher=False,
                                        interpolation="bilinear", crop_pct=0.95,
                                        num_workers=args.workers, device="cpu")
    model.eval()
    hits = torch.zeros(2)
    with torch.no_grad():
        for x, y in evaluated:
            top = model(x).topk(5, 1).indices
            hits += torch.stack([(top[:, 0] == y).sum(), (top == y[:, None]).any(1).sum()])
    top1, top5 = (hits / len(val)).tolist()
    Path(args.json).write_text(json.dumps({"img_s": img_s, "top1": top1, "top5": top5}))


def table(rows: list[dict], val_images: int) -> str:
    from twinstep.training.stats import interval

    def cells(r, base, key, fmt):  # "value | its ratio to timm's", or two empty cells
        return f"{r[key]:{fmt}} | {r[key] / base[key.removesuffix('_warm')]:.2f}×" \
            if key in r else " | "

    out = ["| res | side | R x N | top-1 % (95 % interval) | top-5 % | img/s | vs timm | "
           "wall s, cold | vs timm | wall s, warm | vs timm | peak GiB, cold | vs timm | "
           "peak GiB, warm | vs timm | largest process, cold GiB |", "|---" * 16 + "|"]
    for r in rows:
        base = next(b for b in rows if b["res"] == r["res"] and b["side"] == "timm")
        lo, hi = interval(round(r["top1"] * val_images), val_images)
        out.append(" | ".join([
            f"| {r['res']}²", r["side"], r["shape"],
            f"{100 * r['top1']:.1f} ({100 * lo:.1f}–{100 * hi:.1f})", f"{100 * r['top5']:.1f}",
            *(cells(r, base, k, f) for k, f in (("img_s", ".0f"), ("wall_s", ".0f"),
                                                ("wall_s_warm", ".0f"), ("peak_gib", ".2f"),
                                                ("peak_gib_warm", ".2f"))),
            f"{r['largest_gib']:.2f} |"]))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folder", help="an image folder DIR/{train,val}/<class>/ (default: the "
                   "digits written as one)")
    p.add_argument("--recipe", default="mnv4in_adamdp16")
    p.add_argument("--batch", type=int, default=64, help="the global batch, R x N")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    p.add_argument("--res", type=int, nargs="+", default=[32, 64])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", choices=["both", "timm"], default="both", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--timm-name", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2 * LOG_EVERY:
        p.error(f"--steps must be at least {2 * LOG_EVERY}")
    if args.side == "timm":
        return timm_side(args)
    import timm
    import torch

    from twinstep import recipes
    from twinstep.nets import get_net
    from twinstep.training import state_dict

    with tempfile.TemporaryDirectory() as tmp:
        if args.folder is None:
            args.folder = os.path.join(tmp, "digits")
            write_digits(args.folder)
        classes = len(os.listdir(os.path.join(args.folder, "train")))
        val_images = sum(len(f) for _, _, f in os.walk(os.path.join(args.folder, "val")))
        timm_name = get_net(recipes.parse(args.recipe).net).TIMM_NAME
        torch.manual_seed(args.seed)
        weights = os.path.join(tmp, "start.safetensors")
        state_dict.save(weights, {k: v.numpy() for k, v in timm.create_model(
            timm_name, num_classes=classes).state_dict().items()
            if not k.endswith("num_batches_tracked")})
        rows = []
        for res in args.res:
            for replicas in args.replicas:
                print(f"twinstep R={replicas} at {res}²", file=sys.stderr)
                out = os.path.join(tmp, f"run{res}_{replicas}")
                rows.append({"res": res, "side": "twinstep", **twinstep_side(
                    args, res, replicas, weights, out),
                    "shape": f"{replicas} x {args.batch // replicas}"})
            print(f"timm at {res}²", file=sys.stderr)
            report = os.path.join(tmp, f"timm{res}.json")
            ran = watched([sys.executable, __file__, "--side", "timm", "--folder", args.folder,
                           "--recipe", args.recipe, "--batch", str(args.batch), "--res",
                           str(res), "--steps", str(args.steps), "--workers",
                           str(args.workers), "--seed", str(args.seed), "--weights", weights,
                           "--timm-name", timm_name,
                           "--json", report],
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])})
            rows.append({"res": res, "side": "timm", "shape": f"1 x {args.batch}", **ran,
                         **json.loads(Path(report).read_text())})
        command = "python bench/timm_train.py " + " ".join(sys.argv[1:])
        write_results(
            RESULTS, "Against timm's training",
            f"`twinstep train {args.recipe}` against timm's components in a torch loop, "
            f"f32, global batch {args.batch}, {args.steps} steps, {args.workers} loader "
            f"workers, the same initial weights; {val_images} val images.", command,
            table(rows, val_images),
            "img/s: images over the second half of the steps. Wall: the command's start to its "
            "exit; twinstep's cold with an empty compilation cache, warm with the programs the "
            "cold run left there (timm compiles nothing: its one run is both). Peak: the "
            "process tree's summed PSS; the largest process: its own peak.")


if __name__ == "__main__":
    main()
