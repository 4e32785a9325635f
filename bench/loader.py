"""The training data pipeline against timm's loader, in one interleaved run: images per second
delivered as mixed training batches, by worker count, with and without RandAugment.

  twinstep  `twinstep.data.loader.train_stream` over an image folder: timm's train transform
            (random-resized crop, flip, RandAugment rand-m9-mstd0.5-inc1) as uint8 crops with
            their labels and the batch's drawn mixup / CutMix — the normalisation and the mix
            itself run on the devices, beside the step; 0 workers is one background thread
  packed    the same from the folder's packed copy (`twinstep pack`: short side <= 320, q90,
            ArrayRecord shards)
  device    `--loader device`: the same draws; nvImageCodec decodes only the crop, and the
            resize and RandAugment are left to the devices (a plan per row), so this is the
            host's share alone; "device packed" from the copy
  timm      `timm.data.create_loader` (a torch DataLoader, its worker processes) over the same
            folder with the same transform (train interpolation 'random', no colour jitter —
            twinstep has none), normalised float32 batches, then `timm.data.Mixup` on each batch
            as timm's train.py applies it; 0 workers is the calling thread
  timm fast `create_loader` as timm's train.py builds it for a GPU, less the GPU's part: uint8
            batches collated and mixed by `timm.data.FastCollateMixup` in the workers (its
            prefetcher, which normalises them on the GPU, left out), so this is the host's share
            alone, as "device" is

All read the same JPEGs (ImageNet-sized, 500 x 375, q90) at 224². img/s per core divides by
the cores the pipeline keeps busy (its workers, or one); the projection says how many such
cores feed 8,000 img/s (the ResNet-50 goal of one H200). The table rewrites the section "Data
pipeline" of bench/RESULTS.md. Needs the [oracle] extra (torch, timm).

    python bench/loader.py [--workers 0 1 2] [--images 64] [--steps 24] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.common import RESULTS, machine_load, write_results

ROWS = 32  # images per batch
RES = 224
RANDAUGMENT = 9
MIXUP, CUTMIX = 0.2, 1.0
GOAL = 8000  # img/s: the ResNet-50 step's goal on one H200 (bench/RESULTS.md#gpu)


def write_folder(root: str, images: int) -> None:
    """``images`` 500 x 375 RGB JPEGs (q90) per split in 4 classes, from the bundled digits
    upsampled with noise, so a decode costs what an ImageNet photo's does."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits, rng = load_digits(), np.random.default_rng(0)
    for i in range(images):
        a = (digits.images[i] * 16).astype(np.uint8)
        big = np.asarray(Image.fromarray(a).resize((500, 375)), np.float32)
        rgb = np.stack([big, big[::-1, ::-1], 255 - big], -1) + rng.normal(0, 20, (375, 500, 3))
        for split in ("train", "val"):
            folder = os.path.join(root, split, str(i % 4))
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).save(
                os.path.join(folder, f"{i}.jpg"), quality=90)


def ensure_folder(root: str, images: int) -> bool:
    """`write_folder` at ``root`` unless one is there already (then kept as it is, whatever its
    size): written beside it and renamed, so a run cut while writing leaves none half-made.
    Whether it wrote one."""
    if os.path.isdir(root):
        return False
    part = f"{root}.part"
    shutil.rmtree(part, ignore_errors=True)
    write_folder(part, images)
    os.rename(part, root)
    return True


def ensure_packed(folder: str, packed: str) -> None:
    """The packed copy of ``folder`` (`twinstep pack`) at ``packed`` unless there already, made
    whole beside it and renamed, as `ensure_folder`."""
    from twinstep import api

    if not os.path.isdir(packed):
        shutil.rmtree(f"{packed}.part", ignore_errors=True)
        api.pack(folder, f"{packed}.part")
        os.rename(f"{packed}.part", packed)


def twinstep_batches(root: str, workers: int, randaugment: bool, steps: int,
                     kind: str = "pillow"):
    """A generator of twinstep's training batches (and the callable that stops it), from the
    image folder or, given its packed copy, from that; ``kind``: the loader (`--loader`)."""
    from twinstep.data import loader, mix, sources

    src = sources.get_source(root, RES, kind)
    augment = sources.Augment(RANDAUGMENT if randaugment else None, mix.MixParams(MIXUP, CUTMIX))
    stream = loader.train_stream(src, augment, seed=0, start=0, stop=steps, micro=1, rows=ROWS,
                                 workers=workers)
    return stream, stream.close


def device_batches(root: str, workers: int, randaugment: bool, steps: int):
    return twinstep_batches(root, workers, randaugment, steps, "device")


def timm_batches(root: str, workers: int, randaugment: bool, steps: int, fast: bool = False):
    """timm's loader and Mixup, as timm's train.py builds them on a machine with no GPU; ``fast``:
    as it builds them for a GPU, less the GPU's part (uint8 batches collated and mixed by
    FastCollateMixup in the workers, normalised later by its prefetcher on the GPU)."""
    import torch
    from timm.data import FastCollateMixup, ImageDataset, Mixup, create_loader

    dataset = ImageDataset(os.path.join(root, "train"))
    collate = FastCollateMixup(mixup_alpha=MIXUP, cutmix_alpha=CUTMIX, num_classes=4)
    loader = create_loader(dataset, (3, RES, RES), ROWS, is_training=True,
                           auto_augment=f"rand-m{RANDAUGMENT}-mstd0.5-inc1" if randaugment
                           else None, color_jitter=0.0, interpolation="random",
                           num_workers=workers, use_prefetcher=fast, device=torch.device("cpu"),
                           collate_fn=collate if fast else None,
                           persistent_workers=workers > 0)
    if fast:
        loader = loader.loader  # the DataLoader its (GPU) prefetcher wraps
    mixup = (lambda x, y: (x, y)) if fast else Mixup(mixup_alpha=MIXUP, cutmix_alpha=CUTMIX,
                                                      num_classes=4)

    def batches():
        done = 0
        while True:
            for x, y in loader:
                if len(x) < ROWS:  # timm's train loader drops the last partial batch
                    continue
                yield mixup(x, y)
                done += 1
                if done == steps:
                    return

    return batches(), lambda: None


def timm_fast_batches(root: str, workers: int, randaugment: bool, steps: int):
    return timm_batches(root, workers, randaugment, steps, fast=True)


def packed_report(root: str, packed_root: str) -> str:
    """Bytes on disk of the folder and its packed copy, and the re-encode's PSNR on eval crops
    (RES², the val split) against the originals'."""
    from twinstep.data import folder, packed, transforms

    def size(where):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(where)
                   for f in fs)

    original, copy = folder.scan(root, "val"), packed.open_splits(packed_root)[1]
    psnr = []
    for i in range(len(original)):
        a, b = (transforms.eval_transform(s.image(i), RES).astype(np.float64)
                for s in (original, copy))
        psnr.append(10 * np.log10(255.0 ** 2 / np.mean((a - b) ** 2)))
    return (f"Bytes on disk: the folder {size(root) / 2**20:.1f} MiB, packed "
            f"{size(packed_root) / 2**20:.1f} MiB (short side <= {packed.MAX_SIDE}, q"
            f"{packed.QUALITY}). Eval crops at {RES}² of the packed images against the "
            f"originals': PSNR median {statistics.median(psnr):.1f} dB, least {min(psnr):.1f}.")


def rate(make, root: str, workers: int, randaugment: bool, steps: int) -> tuple[float, float]:
    """(img/s after the first batch, the first batch's wait in s)."""
    batches, close = make(root, workers, randaugment, steps)
    t0 = time.perf_counter()
    next(batches)
    t1 = time.perf_counter()
    n = sum(1 for _ in batches)
    close()
    return n * ROWS / (time.perf_counter() - t1), t1 - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--images", type=int, default=64, help="JPEGs per split (default 64)")
    p.add_argument("--steps", type=int, default=24, help="batches per measurement (a second or "
                   "more: shorter windows measure the workers starting)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.images < ROWS:
        p.error(f"--images must be >= {ROWS}, a batch (timm's training loader drops a partial "
                f"batch)")
    # name: (batches, reads the packed copy)
    peers = {"twinstep": (twinstep_batches, False), "packed": (twinstep_batches, True),
             "device": (device_batches, False), "device packed": (device_batches, True),
             "timm": (timm_batches, False), "timm fast": (timm_fast_batches, False)}
    cases = [(ra, w) for ra in (True, False) for w in args.workers]
    rates: dict = {(peer, ra, w): [] for peer in peers for ra, w in cases}
    starts: dict = {key: [] for key in rates}
    load = []
    with tempfile.TemporaryDirectory() as tmp:
        root, packed_root = os.path.join(tmp, "folder"), os.path.join(tmp, "packed")
        write_folder(root, args.images)
        from twinstep import api

        api.pack(root, packed_root)
        disk = packed_report(root, packed_root)
        for i in range(args.repeats):  # interleaved; every other round in reverse order
            for ra, w in cases if i % 2 == 0 else cases[::-1]:
                for peer in peers if i % 2 == 0 else list(peers)[::-1]:
                    make, from_packed = peers[peer]
                    r, s = rate(make, packed_root if from_packed else root, w, ra, args.steps)
                    rates[peer, ra, w].append(r)
                    starts[peer, ra, w].append(s)
            load.append(machine_load())
    med = {key: statistics.median(v) for key, v in rates.items()}
    lines = ["| RandAugment | workers | " + " | ".join(f"{p} img/s" for p in peers)
             + " | twinstep / timm | packed / twinstep | device / twinstep | device / timm | "
             "device / timm fast | twinstep vs its 1 worker |",
             "|---|---|" + "---|" * (len(peers) + 6)]
    for ra, w in cases:
        got = {p: med[p, ra, w] for p in peers}
        one = med.get(("twinstep", ra, 1))
        scaling = "-" if one is None or w == 0 else f"{got['twinstep'] / one:.2f}x"
        lines.append(f"| {'m9' if ra else 'off'} | {w} | "
                     + " | ".join(f"{got[p]:.0f}" for p in peers)
                     + f" | **{got['twinstep'] / got['timm']:.2f}** | "
                     f"**{got['packed'] / got['twinstep']:.2f}** | "
                     f"**{got['device'] / got['twinstep']:.2f}** | "
                     f"**{got['device'] / got['timm']:.2f}** | "
                     f"**{got['device'] / got['timm fast']:.2f}** | "
                     f"{scaling} |")
    lines += ["", f"Cores to feed {GOAL:,} img/s (the best img/s per core of each path above; "
              "a worker is a core):", "",
              "| path | RandAugment | img/s per core | cores |", "|---|---|---|---|"]
    for peer in peers:
        for ra in (True, False):
            best = max(med[peer, ra, w] / max(w, 1) for w in args.workers)
            lines.append(f"| {peer} | {'m9' if ra else 'off'} | {best:.0f} | "
                         f"{GOAL / best:.0f} |")
    lines += ["", disk]
    command = "python bench/loader.py " + " ".join(sys.argv[1:])
    write_results(RESULTS, "Data pipeline",
                  f"Training batches of {ROWS} at {RES}², mixup {MIXUP} / CutMix {CUTMIX}, from "
                  f"{args.images} JPEGs of 500 x 375: twinstep's loaders against timm's "
                  f"create_loader + Mixup, and against its GPU path's host share "
                  f"(FastCollateMixup).", command, "\n".join(lines),
                  f"Medians of {args.repeats} interleaved repeats of {args.steps} batches, after "
                  "the first (its wait, the workers starting, apart). img/s per core: img/s / "
                  "max(workers, 1). The machine's 1-minute load average over the rounds: "
                  f"{min(load):.1f}-{max(load):.1f}.")


if __name__ == "__main__":
    main()
