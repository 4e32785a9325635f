"""`--loader device`: an image dataset's splits decoded by nvImageCodec, resized and augmented
on the devices (docs/training.md#device-loader).

The host reads a JPEG's bytes and its header, draws every random choice as the Pillow path
does, from the row's own generator (the crop box, the filter, the flip, RandAugment's ops,
signs, magnitudes and filters: `twinstep.data.transforms.train_transform`'s order), and
decodes only the crop boxes, a batch's in one call (`twinstep.data.nvdecode`: nvImageCodec's
region decode, libjpeg-turbo on the CPU or nvJPEG on the GPU). It hands the devices the crop
on a fixed canvas and a plan (`Layout`): Pillow's resize coefficients for that crop, and each
RandAugment layer's op as numbers. The devices resize and augment
(`twinstep.data.device_ops`, in the step's prepare program) before normalising and mixing.
A crop larger than the canvas is resized on the host by Pillow (the same pixels).

The val split is decoded by nvImageCodec and resized and cropped by Pillow on the host, as
the Pillow path's (`twinstep.data.transforms.eval_transform`).

Holds the plan (`Layout`, `resize_table`, `layer_plan`), a row's draws and its placing on
the canvas, and the loader (`Device`, `make`; `unavailable` is `twinstep.data.nvdecode`'s);
the decoding, its header read and the replacement of an image that does not decode are
`twinstep.data.nvdecode`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np
from PIL import Image

from twinstep.data import augment as ra_ops
from twinstep.data import device_ops, folder, nvdecode, transforms, workers

LAYER_WORDS = 787  # kind, lut (3 x 256), coeffs (6 float64), bicubic, fill (3), degenerate,
# factor


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one row's plan [P] int32 holds: the resize tables of an S x S crop from a canvas
    of ``canvas`` x ``canvas`` (``taps`` coefficients per output pixel), then ``layers``
    RandAugment layers (`LAYER_WORDS` each: `twinstep.data.device_ops.rand_augment_layer`'s
    arguments; floats as their bits)."""

    res: int
    canvas: int
    layers: int

    @property
    def taps(self) -> int:
        # Pillow's kernel size at the largest downscale: bicubic's support 2 times the scale
        return 2 * math.ceil(2 * self.canvas / self.res) + 1

    @property
    def words(self) -> int:
        return 2 * self.res * (self.taps + 1) + self.layers * LAYER_WORDS

    def unpack(self, plan):
        """plan [n, P] (a JAX array) -> {"resize": (xstart, xcoef, ystart, ycoef), "layers":
        [kwargs of `twinstep.data.device_ops.rand_augment_layer`]}."""
        s, k, n = self.res, self.taps, plan.shape[0]
        at = 0

        def take(size, shape=()):
            nonlocal at
            part = plan[:, at:at + size].reshape(n, *shape) if shape else plan[:, at]
            at += size
            return part

        resize = (take(s, (s,)), take(s * k, (s, k)), take(s, (s,)), take(s * k, (s, k)))
        layers = []
        for _ in range(self.layers):
            kind, lut, coeffs = take(1), take(768, (3, 256)), take(12, (6, 2))
            bicubic, fill, degenerate = take(1) == 1, take(3, (3,)), take(1)
            layers.append(dict(kind=kind, lut=lut, coeffs=coeffs, bicubic=bicubic, fill=fill,
                               degenerate=degenerate, factor=device_ops._bits(take(1))))
        return {"resize": resize, "layers": layers}


def _filter(x: np.ndarray, bicubic: bool) -> np.ndarray:
    """Pillow's resample filters (Resample.c) at float64 x."""
    x = np.abs(x)
    if not bicubic:
        return np.where(x < 1.0, 1.0 - x, 0.0)
    a = -0.5
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1,
                    np.where(x < 2.0, (((x - 5) * x + 8) * x - 4) * a, 0.0))


@functools.lru_cache(maxsize=4096)  # a dataset's crops repeat their sizes
def resize_table(in_size: int, out_size: int, bicubic: bool,
                 taps: int) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's coefficients (Resample.c's precompute_coeffs and normalize_coeffs_8bpc, in the
    same float64 order) for resizing ``in_size`` pixels to ``out_size``: (start [out] int32,
    coef [out, taps] int32 in 22-bit fixed point, zero past each window)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = (2.0 if bicubic else 1.0) * filterscale
    if math.ceil(support) * 2 + 1 > taps:
        raise ValueError(f"a {in_size}-pixel side needs more than {taps} taps")
    center = (np.arange(out_size) + 0.5) * scale
    start = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - start
    x = np.arange(taps)
    w = _filter((x[None, :] + start[:, None] - center[:, None] + 0.5) * (1.0 / filterscale),
                bicubic)
    w = np.where(x[None, :] < count[:, None], w, 0.0)
    ww = np.zeros(out_size)
    for j in range(taps):  # summed in order, as Pillow's loop
        ww = ww + w[:, j]
    w = np.where(ww[:, None] != 0.0, w / np.where(ww == 0.0, 1.0, ww)[:, None], w)
    scaled = w * (1 << device_ops.PRECISION_BITS)
    coef = np.trunc(np.where(w < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    start = start.astype(np.int32)
    start.flags.writeable = coef.flags.writeable = False  # shared by every caller
    return start, coef


def _ramp_lut(name: str, level: float) -> np.ndarray:
    """A pointwise op's table [3, 256]: the op (Pillow's, `twinstep.data.augment.OPS`) applied
    to an image holding every level once per channel."""
    ramp = Image.fromarray(np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 3, axis=2))
    out = ra_ops.OPS[name](ramp, level, 1, None)
    return np.asarray(out, np.int32)[0].T


POINTWISE = frozenset({"Invert", "PosterizeIncreasing", "SolarizeIncreasing", "SolarizeAdd"})
ENHANCERS = {"ColorIncreasing": device_ops.GREY, "ContrastIncreasing": device_ops.MEAN,
             "BrightnessIncreasing": device_ops.BLACK, "SharpnessIncreasing": device_ops.SMOOTH}


def affine_coeffs(op: ra_ops.Drawn, size: int) -> tuple[float, ...]:
    """The affine map (Pillow's 6 coefficients) a geometric op applies to an S x S image."""
    f = op.sign * op.level / ra_ops.MAX_LEVEL
    if op.name == "Rotate":  # Image.rotate's matrix about the centre, as Pillow builds it
        angle = -math.radians((f * 30.0) % 360.0)
        a, b = round(math.cos(angle), 15), round(math.sin(angle), 15)
        d, e = round(-math.sin(angle), 15), round(math.cos(angle), 15)
        c = a * (-size / 2) + b * (-size / 2) + 0.0 + size / 2
        g = d * (-size / 2) + e * (-size / 2) + 0.0 + size / 2
        return a, b, c, d, e, g
    shear, move = f * 0.3, f * 0.45 * size
    return {"ShearX": (1, shear, 0, 0, 1, 0), "ShearY": (1, 0, 0, shear, 1, 0),
            "TranslateXRel": (1, 0, move, 0, 1, 0),
            "TranslateYRel": (1, 0, 0, 0, 1, move)}[op.name]


IDENTITY = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def layer_plan(op: ra_ops.Drawn | None, size: int) -> np.ndarray:
    """One RandAugment layer's words [`LAYER_WORDS`] int32 for an S x S crop: ``op`` None is a
    skipped layer."""
    if op is None:
        return _skipped(size)
    kind, lut = device_ops.NONE, _IDENTITY_LUT
    coeffs, bicubic, degenerate, factor = IDENTITY, 0, 0, 1.0
    if op.name == "AutoContrast":
        kind = device_ops.AUTOCONTRAST
    elif op.name == "Equalize":
        kind = device_ops.EQUALIZE
    elif op.name in POINTWISE:
        kind, lut = device_ops.LUT, _ramp_lut(op.name, op.level)
    elif op.name in ra_ops.GEOMETRIC:
        kind, coeffs = device_ops.AFFINE, affine_coeffs(op, size)
        bicubic = int(op.interpolation == Image.Resampling.BICUBIC)
    else:
        kind, degenerate = device_ops.BLEND, ENHANCERS[op.name]
        factor = ra_ops._enhance_factor(op.level, op.sign)
    return np.concatenate([[kind], lut.ravel(), np.asarray(coeffs, np.float64).view(np.int32),
                           [bicubic], ra_ops.AugmentParams.from_size(size).img_mean,
                           [degenerate], np.asarray([factor], np.float32).view(np.int32)]
                          ).astype(np.int32)


_IDENTITY_LUT = np.tile(np.arange(256, dtype=np.int32), (3, 1))


@functools.lru_cache(maxsize=16)
def _skipped(size: int) -> np.ndarray:
    """A skipped layer's words (the identity; read-only, shared)."""
    words = layer_plan(ra_ops.Drawn("Invert", 0.0, 1, None), size)
    words[0], words[1:769] = device_ops.NONE, _IDENTITY_LUT.ravel()
    words.flags.writeable = False
    return words


class Drawn(NamedTuple):
    """A train row's random choices: crop box (top, left, h, w), filter, flip, RandAugment's
    layers."""

    box: tuple[int, int, int, int]
    bicubic: bool
    flip: bool
    ops: list


def default_canvas(res: int) -> int:
    """The canvas side: 16/7 of S, a multiple of 32 (512 at 224: a 500 x 375 photo's crops)."""
    return 32 * math.ceil(res * 16 / 7 / 32)


class Device:
    """A dataset's (train, val) splits (`twinstep.data.sources.FORMATS`) read as JPEG bytes,
    decoded by nvImageCodec (``decoder``, a `twinstep.data.nvdecode.Decoder`), resized and
    augmented on the devices: train rows are a canvas [n, C, C, 3] uint8 each (the crop at its
    top left) and a plan [n, P] (`Layout`)."""

    augments = True

    def __init__(self, splits, res: int, eval_res: int | None = None,
                 canvas: int | None = None, gpu_decode: bool | None = None):
        self.train, self.val = splits
        # decode where the trainer computes: nvJPEG when its JAX has a GPU (None: ask JAX)
        self.decoder = nvdecode.Decoder(gpu_decode)
        self.res, self.eval_res = res, eval_res or res
        self.canvas = canvas or default_canvas(res)
        self.classes = len(self.train.classes)
        self.train_labels, self.val_labels = self.train.labels, self.val.labels

    def layout(self, augment) -> Layout:
        """The plan of a row under ``augment`` (`twinstep.data.sources.Augment`)."""
        return Layout(self.res, self.canvas, 2 if augment.randaugment is not None else 0)

    def _draw(self, rng: np.random.Generator, size: tuple[int, int],
              randaugment: int | None) -> Drawn:
        """A row's random choices, drawn as `twinstep.data.transforms.train_transform` draws."""
        box = transforms.rrc_box(rng, *size)
        bicubic = transforms.TRAIN_INTERPOLATIONS[int(rng.integers(2))] == \
            Image.Resampling.BICUBIC
        flip = rng.random() < transforms.HFLIP
        ops = ra_ops.draw(rng, randaugment) if randaugment is not None else []
        return Drawn(box, bicubic, flip, ops)

    def _place(self, crop: np.ndarray, drawn: Drawn, *, layout: Layout,
               canvas: np.ndarray) -> np.ndarray:
        """Writes ``crop`` [h, w, 3] uint8 into ``canvas`` [C, C, 3] (zeros) at its top left;
        returns the row's plan [P] int32."""
        s, c = self.res, self.canvas
        h, w = crop.shape[:2]
        if h > c or w > c:  # past the canvas: Pillow resizes it here, the devices copy it
            filt = Image.Resampling.BICUBIC if drawn.bicubic else Image.Resampling.BILINEAR
            crop = np.asarray(Image.fromarray(crop).resize((s, s), filt))
            h = w = s
        canvas[:h, :w] = crop
        xstart, xcoef = resize_table(w, s, drawn.bicubic, layout.taps)
        ystart, ycoef = resize_table(h, s, drawn.bicubic, layout.taps)
        if drawn.flip:
            xstart, xcoef = xstart[::-1], xcoef[::-1]
        ops = drawn.ops
        layers = [layer_plan(ops[k] if k < len(ops) else None, s) for k in range(layout.layers)]
        return np.concatenate([xstart, xcoef.ravel(), ystart, ycoef.ravel(), *layers])

    def train_row(self, data: bytes, size: tuple[int, int], stream, *,
                  rng: np.random.Generator, randaugment: int | None, layout: Layout,
                  canvas: np.ndarray) -> np.ndarray:
        """One row alone: its crop written into ``canvas`` [C, C, 3] uint8 (zeros), its plan
        [P] int32 returned."""
        drawn = self._draw(rng, size, randaugment)
        return self._place(self.decoder.decode(data, stream, drawn.box), drawn, layout=layout,
                           canvas=canvas)

    def train_rows(self, idx, seed, step, row_ids, augment):
        """(canvases [n, C, C, 3] uint8, labels, images skipped per row, plans [n, P]): every
        row drawn, then their crop boxes decoded in one batch (`nvdecode.Decoder.batch`), then
        placed. A row whose image does not decode is drawn again from the next image, as one
        alone."""
        layout = self.layout(augment)
        # in a loader process, in shared memory: 786 KB a row at 224² reach the trainer uncopied
        canvases = workers.shared_zeros((len(idx), self.canvas, self.canvas, 3), np.uint8)
        plans = np.empty((len(idx), layout.words), np.int32)

        def rng(row):
            return np.random.default_rng([seed, step, 0, int(row)])

        rows = []  # (index used, skipped, bytes, code stream or None, Drawn)
        for i, row in zip(idx, row_ids, strict=True):
            j, tried, data, size, stream = nvdecode.first_with_header(self.train, int(i))
            rows.append((j, tried, data, stream, self._draw(rng(row), size,
                                                            augment.randaugment)))
        queued = [r for r, row in enumerate(rows) if row[3] is not None]
        crops = dict(zip(queued, self.decoder.batch([rows[r][3] for r in queued],
                                                    [rows[r][4].box for r in queued]),
                         strict=True))
        labels, skipped = [], []
        for r, (j, tried, data, _, drawn) in enumerate(rows):
            try:
                crop = crops.get(r)
                crop = self.decoder.decode(data, None, drawn.box) if crop is None else crop
                plans[r] = self._place(crop, drawn, layout=layout, canvas=canvases[r])
            except nvdecode.Undecodable:
                def make(data, size, stream, row=row_ids[r], canvas=canvases[r]):
                    return self.train_row(data, size, stream, rng=rng(row),
                                          randaugment=augment.randaugment, layout=layout,
                                          canvas=canvas)

                plans[r], j, more = nvdecode.first_decoded(self.train, j + 1, make)
                tried += 1 + more
            labels.append(self.train.labels[j])
            skipped.append(tried)
        return canvases, np.asarray(labels, np.int32), np.asarray(skipped, np.int64), plans

    def val_rows(self, idx):
        """(uint8 [n, E, E, 3], images skipped per row [n] int64): timm's eval transform by
        Pillow of each image as nvImageCodec decodes it."""
        def make(data, size, stream):
            img = Image.fromarray(self.decoder.decode(data, stream))
            return transforms.eval_transform(img, self.eval_res, transforms.CROP_PCT)

        rows, skipped = [], []
        for i in idx:
            row, _, tried = nvdecode.first_decoded(self.val, int(i), make)
            rows.append(row)
            skipped.append(tried)
        return np.stack(rows), np.asarray(skipped, np.int64)

    def val_kind(self) -> str:
        return folder.kind(self.val)


def make(splits, res: int, eval_res: int | None = None) -> Device:
    """The `twinstep.data.sources.Source` of ``splits``."""
    return Device(splits, res, eval_res)


# the loader's other half (`twinstep.data.sources.LOADERS`): why it cannot run here, None when
# nvImageCodec imports
unavailable = nvdecode.unavailable
