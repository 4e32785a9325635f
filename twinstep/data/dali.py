"""The DALI data path (``twinstep train --loader dali``; docs/training.md#dali): the images of
a folder or a packed folder decoded and augmented by NVIDIA DALI — on a GPU when one is present
(its JPEG decoder, "mixed"), on DALI's CPU operators otherwise — with the same sampler, the same
labels and the same batch format (`twinstep.data.loader.Batch`: uint8 crops, normalised and
mixed on the devices) as the Pillow path.

Every random draw is made on the host, from the row's own generator seeded by (seed, step,
row) as the Pillow path's: the random-resized-crop box (from the image's header size, before
decoding, so only the box is decoded), the resize filter, the flip, and RandAugment's ops, signs
and magnitudes. DALI receives them as per-sample inputs and draws nothing itself, so a batch is
a pure function of (seed, step) whatever DALI's thread count or the shard layout, and resuming
needs no state from DALI's pipeline.

RandAugment is DALI's implementation of timm's "increasing" set (`SUITE`, the same 15 ops,
magnitude ranges and random negation), applied as timm's ``rand-mM-mstd0.5-inc1`` policy
applies it (2 ops chosen with replacement, each with probability 1/2, magnitude ~ N(M, 0.5)
clipped to [0, 10]). Its pixels are DALI's, not Pillow's: the geometric ops fill with grey 128
and resample bilinearly (timm: the ImageNet mean, a filter drawn per op), and equalize follows
OpenCV. The crops, filters and flips equal the Pillow path's draws.
"""

from __future__ import annotations

import io
import math
import warnings

import numpy as np
from PIL import Image

from twinstep.data import folder, sources, transforms
from twinstep.errors import UsageError

RA_LAYERS = 2  # timm's rand-m*-n2: ops per image
RA_PROB = 0.5  # each op applied with this probability (timm's RandAugment default)
RA_MSTD = 0.5
IDENTITY = 15  # `suite`'s index of the identity: what a skipped op draws
BINS = 101  # magnitude bins: a magnitude m in [0, 10] is bin round(10 m)
# transforms.TRAIN_INTERPOLATIONS as DALIInterpType values: INTERP_TRIANGULAR (Pillow's
# bilinear: antialiased when it shrinks), INTERP_CUBIC (tests/test_dali.py checks the values)
INTERP = (4, 2)


def unavailable() -> str | None:
    """None when DALI imports, else why not (one line)."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as e:
        return (f"--loader dali needs NVIDIA DALI: pip install 'twinstep[dali]' ({e})")
    return None


def prepare_xla() -> None:
    """Turn XLA:GPU's command buffers off, as DALI's documentation asks: DALI's own thread
    breaks them. Takes effect only before JAX's backend starts (`twinstep.api.train` calls it
    first); a no-op on CPU."""
    import os

    flag = "--xla_gpu_enable_command_buffer="
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def device_id() -> int | None:
    """The GPU this process decodes on (its first JAX device's), None without one."""
    import jax

    device = jax.local_devices()[0]
    return device.local_hardware_id if device.platform == "gpu" else None


def suite(res: int) -> list:
    """timm's 15 "increasing" RandAugment ops as DALI augmentations (timm's ranges; a translate
    moves up to 0.45 of the S x S crop), then the identity (`IDENTITY`)."""
    from nvidia.dali.auto_aug import augmentations as a

    translate = 0.45 * res
    return [
        a.auto_contrast, a.equalize, a.invert,
        a.rotate.augmentation((0, 30), True),
        a.posterize.augmentation((4, 0), False, a.poster_mask_uint8),
        a.solarize.augmentation((256, 0)),
        a.solarize_add.augmentation((0, 110)),
        a.color.augmentation((0, 0.9), True, a.shift_enhance_range),
        a.contrast.augmentation((0, 0.9), True, a.shift_enhance_range),
        a.brightness.augmentation((0, 0.9), True, a.shift_enhance_range),
        a.sharpness.augmentation((0, 0.9), True, a.sharpness_kernel),
        a.shear_x.augmentation((0, 0.3), True),
        a.shear_y.augmentation((0, 0.3), True),
        a.translate_x_no_shape.augmentation((0, translate), True),
        a.translate_y_no_shape.augmentation((0, translate), True),
        a.identity,
    ]


def draws(rng: np.random.Generator, width: int, height: int,
          randaugment: int | None) -> dict[str, np.ndarray]:
    """One row's draws, in the Pillow path's order (`transforms.train_transform`): the box
    (as DALI's anchor (x, y) and shape (w, h)), the filter, the flip, then per RandAugment layer
    the op, whether it applies, its magnitude and sign."""
    top, left, h, w = transforms.rrc_box(rng, width, height)
    out = {"anchor": np.array([left, top], np.float32), "shape": np.array([w, h], np.float32),
           "interp": np.array(INTERP[int(rng.integers(2))], np.int32),
           "flip": np.array(int(rng.random() < transforms.HFLIP), np.int32)}
    for k in range(RA_LAYERS if randaugment is not None else 0):
        op = int(rng.integers(IDENTITY))
        applied = rng.random() < RA_PROB
        magnitude = min(10.0, max(0.0, float(rng.normal(randaugment, RA_MSTD))))
        out[f"op{k}"] = np.array(op if applied else IDENTITY, np.int32)
        out[f"bin{k}"] = np.array(round(magnitude * 10), np.int32)
        out[f"sign{k}"] = np.array(int(rng.random() < 0.5), np.int32)
    return out


def _train_pipeline(res: int, randaugment: bool, rows: int, threads: int, device_id):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug.core import select, signed_bin

    @pipeline_def(batch_size=rows, num_threads=threads, device_id=device_id, seed=0,
                  enable_conditionals=randaugment, prefetch_queue_depth=1, exec_dynamic=True)
    def train():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        arg = {n: fn.external_source(name=n, dtype=t, ndim=d) for n, t, d in (
            ("anchor", types.FLOAT, 1), ("shape", types.FLOAT, 1),
            ("interp", types.INT32, 0), ("flip", types.INT32, 0))}
        images = fn.decoders.image_slice(
            jpegs, arg["anchor"], arg["shape"], normalized_anchor=False, normalized_shape=False,
            device="mixed" if device_id is not None else "cpu", output_type=types.RGB,
            adjust_orientation=False, jpeg_fancy_upsampling=True)
        images = fn.resize(images, size=[res, res], antialias=True,
                           interp_type=fn.cast(arg["interp"], dtype=types.INTERP_TYPE))
        images = fn.flip(images, horizontal=arg["flip"])
        ops = suite(res)
        for k in range(RA_LAYERS if randaugment else 0):
            op, mag, sign = (fn.external_source(name=f"{n}{k}", dtype=types.INT32, ndim=0)
                             for n in ("op", "bin", "sign"))
            images = select(ops, op, data=images, magnitude_bin=signed_bin(mag, sign),
                            num_magnitude_bins=BINS)
        return images

    pipe = train()
    pipe.build()
    return pipe


def _eval_pipeline(res: int, rows: int, threads: int, device_id):
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=rows, num_threads=threads, device_id=device_id, seed=0,
                  prefetch_queue_depth=1, exec_dynamic=True)
    def evaluate():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        width, height, anchor = (fn.external_source(name=n, dtype=types.FLOAT, ndim=d)
                                 for n, d in (("width", 0), ("height", 0), ("anchor", 1)))
        images = fn.decoders.image(jpegs, device="mixed" if device_id is not None else "cpu",
                                   output_type=types.RGB, adjust_orientation=False,
                                   jpeg_fancy_upsampling=True)
        images = fn.resize(images, resize_x=width, resize_y=height, antialias=True,
                           interp_type=types.INTERP_LINEAR)
        return fn.slice(images, anchor, types.Constant(np.array([res, res], np.float32)),
                        axis_names="WH", normalized_anchor=False, normalized_shape=False)

    pipe = evaluate()
    pipe.build()
    return pipe


def make(splits, res: int, threads: int, eval_res: int | None = None) -> Dali:
    """The `twinstep.data.sources.Source` of ``splits`` on ``threads`` DALI threads, on this
    process's GPU when JAX has one."""
    return Dali(splits, res, threads, device_id(), eval_res)


class Dali:
    """The splits of a folder or a packed folder (each with ``encoded(i)``: image i's file
    bytes) decoded by DALI at S x S on ``threads`` threads — a GPU's decoder when
    ``device_id`` is set. Pipelines are built on first use, in the thread that uses them."""

    augments = True
    threads_are_workers = True  # --workers W: DALI's threads, in the loader's own thread

    def __init__(self, splits, res: int, threads: int, device_id: int | None = None,
                 eval_res: int | None = None):
        self.train, self.val = splits
        self.res, self.eval_res = res, eval_res or res
        self.threads, self.device_id = max(threads, 1), device_id
        self.classes = len(self.train.classes)
        self.train_labels, self.val_labels = self.train.labels, self.val.labels
        self._pipes: dict = {}

    def __getstate__(self):
        return {**self.__dict__, "_pipes": {}}

    def _pipe(self, kind: str, rows: int, randaugment: bool = False):
        key = (kind, rows, randaugment)
        if key not in self._pipes:
            # DALI's auto_aug calls its own deprecated aliases, and DALI forces such warnings
            # on past any filter: recorded, they are dropped
            with warnings.catch_warnings(record=True):
                self._pipes[key] = (
                    _train_pipeline(self.res, randaugment, rows, self.threads, self.device_id)
                    if kind == "train" else
                    _eval_pipeline(self.eval_res, rows, self.threads, self.device_id))
        return self._pipes[key]

    @staticmethod
    def _readable(split, i: int):
        """(bytes, (width, height), index used, skipped): the first image from i on whose header
        reads (DALI decodes the rest; a corrupt body stops the run — pack the folder first)."""
        for tried in range(len(split)):
            j = (i + tried) % len(split)
            data = split.encoded(j)
            try:
                with Image.open(io.BytesIO(data)) as img:
                    return data, img.size, j, tried
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
                continue
        raise UsageError(f"no image of {len(split)} in this split decodes")

    def _run(self, pipe, feeds: dict) -> np.ndarray:
        for name, values in feeds.items():
            pipe.feed_input(name, values)
        try:
            (images,) = pipe.run()
        except RuntimeError as e:
            raise UsageError(f"DALI could not decode a batch ({str(e).splitlines()[0]}); "
                             f"`twinstep pack` reports every image that does not decode") from None
        if self.device_id is not None:
            images = images.as_cpu()
        return np.stack([np.asarray(images[i]) for i in range(len(images))])

    def train_rows(self, idx, seed, step, row_ids, augment):
        """(uint8 crops [len(idx), S, S, 3], labels, images skipped per row)."""
        feeds: dict[str, list] = {"jpegs": []}
        labels, skipped = [], []
        for i, row in zip(idx, row_ids, strict=True):
            data, (width, height), used, tried = self._readable(self.train, int(i))
            rng = np.random.default_rng([seed, step, 0, int(row)])
            feeds["jpegs"].append(np.frombuffer(data, np.uint8))
            for name, value in draws(rng, width, height, augment.randaugment).items():
                feeds.setdefault(name, []).append(value)
            labels.append(self.train.labels[used])
            skipped.append(tried)
        pipe = self._pipe("train", len(idx), augment.randaugment is not None)
        return (self._run(pipe, feeds), np.asarray(labels, np.int32),
                np.asarray(skipped, np.int64), sources.no_plans(len(idx)))

    def layout(self, augment):
        return None

    def val_kind(self) -> str:
        return folder.kind(self.val)

    def val_rows(self, idx):
        """(uint8 [len(idx), E, E, 3] at E = eval_res, images skipped)."""
        feeds: dict[str, list] = {"jpegs": [], "width": [], "height": [], "anchor": []}
        skipped = 0
        for i in idx:
            data, (width, height), _, tried = self._readable(self.val, int(i))
            # timm's eval geometry (`transforms.eval_transform`), computed here for DALI
            w, h = transforms.short_side_size(width, height,
                                              math.floor(self.eval_res / transforms.CROP_PCT))
            top, left = transforms.center_offsets(w, h, self.eval_res)
            for name, value in (("jpegs", np.frombuffer(data, np.uint8)), ("width", w),
                                ("height", h), ("anchor", [left, top])):
                feeds[name].append(np.asarray(value, np.uint8 if name == "jpegs"
                                              else np.float32))
            skipped += tried
        return self._run(self._pipe("val", len(idx)), feeds), skipped
