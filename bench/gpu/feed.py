"""The device loader's feed (`--loader device`) on one device, part by part: images per second
of the host's share and of the devices' share, each alone, beside the Pillow path's host rate.

A folder of generated 500 x 375 JPEGs (bench/loader.py's) and its packed copy, at --res with
RandAugment m9 and mixup / CutMix:

  decode        nvImageCodec alone, whole images: one at a time on one CPU core
                (libjpeg-turbo); in one batch by the device loader's decoder (nvJPEG on the
                GPU when JAX has one, else that CPU decoder), and the batch's |Δ| from the
                first in levels (on the GPU: nvJPEG's difference from libjpeg-turbo)
  host          the device loader's host share (`twinstep.data.loader.train_stream`: header,
                draws, region decode, plans) on --workers processes; "host packed" from the
                copy; "pillow" the Pillow path's whole transform, for scale
  devices       the prepare program with the device loader's plan (resize, RandAugment,
                normalise, mix) on one device, batches of --batch; "devices, crops given" the
                same program fed finished crops (the Pillow path's), so the difference is the
                resize and RandAugment

Writes JSON (--json), again after each part, so a run cut short keeps what it measured. With
--data DIR the JPEGs are DIR's (written there first when it is missing, and DIR-packed beside
it), for another script to reuse (bench/gpu/lease.py passes the same DIR to train.py). On a
machine without a GPU it runs too, as its CPU twin (small --res and --batch): there the devices
are the same cores as the host.

    python bench/gpu/feed.py [--res 224] [--batch 256] [--images 1024] [--workers W]
                             [--data DIR] [--json bench/gpu_feed.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.loader import ensure_folder, ensure_packed

RANDAUGMENT, MIXUP, CUTMIX = 9, 0.2, 1.0


def decode_rates(folder: str, gpu: bool) -> dict:
    """img/s of nvImageCodec decoding whole JPEGs: one at a time on one CPU core
    (libjpeg-turbo); in one batch by the device loader's decoder (`twinstep.data.nvdecode
    .Decoder.batch`: nvJPEG on the GPU, else the same CPU decoder). And how far the
    batch's pixels are from the CPU's one at a time (max and mean |Δ| levels): on a GPU, nvJPEG
    against libjpeg-turbo; on the CPU twin 0, or the batch is wrong."""
    import numpy as np
    from nvidia import nvimgcodec

    from twinstep.data import folder as folders
    from twinstep.data import nvdecode

    split = folders.scan(folder, "train")
    data = [split.encoded(i) for i in range(len(split))]
    cpu = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                             max_num_cpu_threads=1,
                             backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.CPU_ONLY)])
    t0 = time.perf_counter()
    single = [np.asarray(cpu.decode(d).cpu()) for d in data]
    out = {"decode_cpu_core": len(data) / (time.perf_counter() - t0)}
    decoder = nvdecode.Decoder(gpu)
    decoder.batch([nvimgcodec.CodeStream(d) for d in data[:8]], [None] * 8)  # warm
    streams = [nvimgcodec.CodeStream(d) for d in data]
    t0 = time.perf_counter()
    batch = decoder.batch(streams, [None] * len(streams))
    out["decode_gpu" if gpu else "decode_batch_cpu_core"] = len(data) / (time.perf_counter()
                                                                           - t0)
    diff = [np.abs(a.astype(np.int16) - b) for a, b in zip(single, batch, strict=True)]
    out["batch_vs_libjpeg"] = {"max": int(max(d.max() for d in diff)),
                               "mean": float(np.mean([d.mean() for d in diff]))}
    return out


def host_rate(data: str, kind: str, res: int, batch: int, workers: int, steps: int) -> float:
    """img/s of a loader's host share over its last half of batches."""
    from twinstep.data import loader, mix, sources

    src = sources.get_source(data, res, kind)
    augment = sources.Augment(RANDAUGMENT, mix.MixParams(MIXUP, CUTMIX))
    stream = loader.train_stream(src, augment, seed=0, start=0, stop=steps, micro=1, rows=batch,
                                 workers=workers)
    times = [time.perf_counter() for _ in stream]
    stream.close()
    half = steps // 2
    return (steps - 1 - half) * batch / (times[-1] - times[half])


def device_rates(data: str, res: int, batch: int, repeats: int) -> dict:
    """img/s of the prepare program on one device: with the device loader's plan, and fed the
    Pillow path's finished crops. Medians of ``repeats`` interleaved timings."""
    import jax

    from twinstep import program
    from twinstep.data import loader, mix, sources

    augment = sources.Augment(RANDAUGMENT, mix.MixParams(MIXUP, CUTMIX))
    runs = {}
    for name, kind in (("devices", "device"), ("devices, crops given", "pillow")):
        src = sources.get_source(data, res, kind)
        b = loader.train_batch(src, augment, seed=0, step=0, micro=1, rows=batch)
        prepare = program.prepare_program(src.classes, program.Setup(precision="bf16"),
                                          layout=src.layout(augment))
        args = jax.device_put((b.xs, b.labels, b.mix, b.box, b.plan))
        jax.block_until_ready(prepare(*args))  # compiles
        runs[name] = (prepare, args)
    times: dict = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (prepare, args) in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(prepare(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: batch / statistics.median(t) for name, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--images", type=int, default=1024, help="JPEGs per split")
    p.add_argument("--steps", type=int, default=12, help="batches per host measurement")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--workers", type=int, default=os.cpu_count(),
                   help="loader processes (default: every core)")
    p.add_argument("--data", help="the JPEG folder (written there when missing); default: a "
                   "temporary one")
    p.add_argument("--json", default=str(Path(__file__).resolve().parents[1] / "gpu_feed.json"))
    args = p.parse_args()
    import jax

    gpu = jax.default_backend() == "gpu"
    results = {"device": jax.devices()[0].device_kind, "res": args.res, "batch": args.batch,
               "workers": args.workers, "cpus": os.cpu_count()}

    def write():  # after each part: a run cut by its time limit keeps what it measured
        Path(args.json).write_text(json.dumps(results, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.data or os.path.join(tmp, "folder")
        packed = f"{folder}-packed"
        t0 = time.perf_counter()
        ensure_folder(folder, args.images)
        ensure_packed(folder, packed)
        results["jpegs_s"] = time.perf_counter() - t0
        results |= decode_rates(folder, gpu)
        write()
        for name, data, kind in (("host", folder, "device"), ("host packed", packed, "device"),
                                 ("pillow", folder, "pillow")):
            results[name] = host_rate(data, kind, args.res, args.batch, args.workers,
                                      args.steps)
            print(f"gpu_feed: {name:12s} {results[name]:8.0f} img/s on {args.workers} workers",
                  flush=True)
            write()
        results |= device_rates(folder, args.res, args.batch, args.repeats)
    for key, value in results.items():
        if isinstance(value, float) and key != "jpegs_s":
            print(f"gpu_feed: {key:22s} {value:8.0f} img/s", flush=True)
    print(f"gpu_feed: batch decode vs libjpeg-turbo: {results['batch_vs_libjpeg']} |Δ| levels",
          flush=True)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
