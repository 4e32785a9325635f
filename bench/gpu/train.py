"""`twinstep train` end to end on real JPEGs, on one device: images per second for each net and
data path, and where the time goes.

A folder of generated 500 x 375 JPEGs (bench/loader.py's, ImageNet-sized) and its packed copy
(`twinstep pack`) are trained on at --res with the recipe ``<net>in_adamdp<N>bf16`` (bf16
convolutions, as bench/gpu/step.py), with --randaugment M when given, through four data paths:
Pillow from the folder and from the packed copy, the device loader from each (`--loader
device`: the resize and RandAugment on the GPU).
For each, three rates:

  data    the loader alone (`twinstep.data.loader.train_stream`, no device): what it delivers
          over its last quarter of batches
  train   `twinstep train` over its last quarter of steps, from its metrics lines: the batches
          the loader built ahead while the first step compiled are drained by then
  bound   "data" when train is within 10 % of it (the loader feeds the step no faster), else
          "step"

With --bare, first the bare step of each net at the same batch and --res (bench/gpu/step.py's:
synthetic inputs already on the device), and per path its ratios: ``train_vs_bare`` (train over
the bare step's img/s; the goal is 0.95) and ``data_vs_bare`` (the loader alone over it: the
device loader's feed has the goal 1.3).
Compiles are shared through a JAX compilation cache in the temporary folder. Prints one line
per (net, path) and writes JSON (--json) after each, so a run cut short keeps what it measured;
a path that fails prints its error and the others still run (exit 3). With --data DIR the JPEGs
are DIR's (written there when missing; the packed copy DIR-packed, made when a path needs it).
On a machine without a GPU it runs too (its CPU twin, at a small --res): `make test` does not run
it, tests/test_device.py holds the device loader on CPU.

    python bench/gpu/train.py [--nets resnet50 mnv4] [--res 224] [--batch 256] [--steps 160]
                              [--images 1024] [--workers W] [--bare] [--data DIR]
                              [--json bench/gpu_train.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.loader import ensure_folder, ensure_packed

PATHS = {"pillow": ("pillow", False), "pillow-packed": ("pillow", True),
         "device": ("device", False), "device-packed": ("device", True)}  # name: (loader, packed)


def data_rate(data: str, kind: str, recipe: str, res: int, workers: int, steps: int,
              randaugment: int | None = None) -> float:
    """img/s of the loader alone over its last quarter of batches, with the recipe's
    augmentation: by then its workers have started and drained what they built ahead. The
    device loader's is its host share (its devices' share: bench/gpu/feed.py)."""
    from twinstep import recipes
    from twinstep.data import loader, mix, sources

    r = recipes.parse(recipe)
    augment = sources.Augment(randaugment, mix.MixParams(r.mixup, r.cutmix)
                             if r.mixup or r.cutmix else None)
    src = sources.get_source(data, res, kind)
    stream = loader.train_stream(src, augment, seed=0, start=0, stop=steps, micro=r.accum,
                                 rows=r.batch, workers=workers)
    times = [time.perf_counter() for _ in stream]
    stream.close()
    last = steps - steps // 4 - 1
    return (steps - 1 - last) * r.batch * r.accum / (times[-1] - times[last])


def train_rate(data: str, kind: str, recipe: str, res: int, workers: int, steps: int,
               out: str, randaugment: int | None = None) -> float:
    """img/s of `twinstep train` over its last quarter of steps. Its loader builds
    ``workers`` x PREFETCH batches ahead while the first step compiles, so a rate from the first
    step (the metrics' img/s) counts those as free; the last quarter's does not (``steps`` is
    4 x that buffer or more by default)."""
    import twinstep
    from twinstep import recipes

    twinstep.train(recipe, out, data=data, loader=kind, res=res, steps=steps, workers=workers,
                   randaugment=randaugment, precision="bf16", eval_every=steps, ckpt_every=steps,
                   log_every=max(steps // 4, 1))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if '"eval"' not in line]
    # img_per_s is cumulative from the end of the first step: recover each line's clock
    r = recipes.parse(recipe)
    per_step = r.batch * r.accum
    clock = [(line["step"] - 1) * per_step / line["img_per_s"] for line in lines[-2:]]
    return (lines[-1]["step"] - lines[-2]["step"]) * per_step / (clock[1] - clock[0])


def bare_rate(net: str, batch: int, res: int, classes: int, steps: int = 30) -> dict:
    """The bare bf16 step of ``net`` at ``batch`` x ``res``² (bench/gpu/step.py's: the recipe's
    program, its inputs on the device, the state donated): the median of 3 windows."""
    import statistics

    from bench.gpu.step import build, time_steps

    compiled, call_args, _ = build(net, batch, res, classes)
    step_s = statistics.median(time_steps(compiled, call_args, steps)[0])
    return {"step_ms": step_s * 1e3, "img_per_s": batch / step_s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--images", type=int, default=1024, help="JPEGs per split")
    p.add_argument("--randaugment", type=int, metavar="M",
                   help="RandAugment rand-mM-mstd0.5-inc1 (default: none, as the recipe)")
    p.add_argument("--workers", type=int, default=os.cpu_count(),
                   help="loader processes (default: every core)")
    p.add_argument("--bare", action="store_true",
                   help="also each net's bare step, and each path's ratios to it")
    p.add_argument("--data", help="the JPEG folder (written there when missing); default: a "
                   "temporary one")
    p.add_argument("--json", default=str(Path(__file__).resolve().parents[1] / "gpu_train.json"))
    args = p.parse_args()
    import jax

    from twinstep import recipes

    results = {"device": jax.devices()[0].device_kind, "res": args.res, "batch": args.batch,
               "steps": args.steps, "workers": args.workers, "runs": []}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        jax.config.update("jax_compilation_cache_dir", os.path.join(tmp, "jax-cache"))
        folder = args.data or os.path.join(tmp, "folder")
        packed = f"{folder}-packed"
        t0 = time.perf_counter()
        wrote = ensure_folder(folder, args.images)
        if any(PATHS[name][1] for name in args.paths):
            ensure_packed(folder, packed)
        print(f"gpu_train: the JPEGs {'written' if wrote else 'found'} in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        classes = len(os.listdir(os.path.join(folder, "train")))
        for net in args.nets:
            recipe = dataclasses.replace(recipes.parse(f"{net}in_adamdpbf16"),
                                         batch=args.batch).name
            bare = None
            if args.bare:
                try:
                    bare = results.setdefault("bare", {})[net] = bare_rate(
                        net, args.batch, args.res, classes)
                except Exception as e:  # the paths still run, without their ratios
                    print(f"{net:9s} bare step    FAILED: {type(e).__name__}: {str(e)[:2000]}",
                          flush=True)
                    failed += 1
                else:
                    print(f"{net:9s} bare step     {bare['img_per_s']:8.0f} img/s", flush=True)
                    Path(args.json).write_text(json.dumps(results, indent=1))
            for name in args.paths:
                kind, from_packed = PATHS[name]
                data = packed if from_packed else folder
                try:
                    fed = data_rate(data, kind, recipe, args.res, args.workers, args.steps,
                                    args.randaugment)
                    trained = train_rate(data, kind, recipe, args.res, args.workers,
                                         args.steps, os.path.join(tmp, f"{net}-{name}"),
                                         args.randaugment)
                except Exception as e:  # one path's failure leaves the others' rows
                    print(f"{net:9s} {name:13s} FAILED: {type(e).__name__}: {str(e)[:2000]}",
                          flush=True)
                    failed += 1
                    continue
                bound = "data" if trained >= 0.9 * fed else "step"
                run = {"net": net, "path": name, "data_img_per_s": fed,
                       "train_img_per_s": trained, "bound": bound}
                if bare:
                    run |= {"train_vs_bare": trained / bare["img_per_s"],
                            "data_vs_bare": fed / bare["img_per_s"]}
                results["runs"].append(run)
                print(f"{net:9s} {name:13s} data {fed:8.0f} img/s   train {trained:8.0f} "
                      f"img/s   bound by the {bound}", flush=True)
                Path(args.json).write_text(json.dumps(results, indent=1))
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
