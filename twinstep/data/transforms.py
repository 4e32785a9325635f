"""Image transforms of timm's ImageNet pipeline, in Pillow + NumPy: the eval resize + centre crop,
the training random-resized crop + horizontal flip (+ optional RandAugment), and the float32
normalisation — each reproducing timm 1.0 / torchvision's arithmetic so its output matches theirs
pixel for pixel (tests/test_transforms.py compares them).

Left out: the ColorJitter(0.4, 0.4, 0.4) that timm's `create_transform(is_training=True)` adds
when RandAugment is off (with RandAugment on, timm drops it too). twinstep's recipes that train
from data use RandAugment; a run without it gets no colour jitter, unlike timm's default.

Randomness comes only from the `np.random.Generator` passed in, so an image's augmentation is a
pure function of that generator's seed. Images are PIL images until the end; the transforms
return uint8 [S, S, 3] arrays and `normalize` turns those into the network's float32 input.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from twinstep.data.augment import rand_augment

MEAN = np.array([0.485, 0.456, 0.406], np.float32)  # timm's IMAGENET_DEFAULT_MEAN
STD = np.array([0.229, 0.224, 0.225], np.float32)  # timm's IMAGENET_DEFAULT_STD

SCALE = (0.08, 1.0)  # the RRC's range of crop area / image area
RATIO = (3 / 4, 4 / 3)  # the RRC's range of crop width / height
HFLIP = 0.5
CROP_PCT = 0.95  # the eval crop's share of the resized short side: timm's, for both nets
# the eval resize: timm's eval default (create_transform's 'bilinear')
INTERPOLATION = Image.Resampling.BILINEAR
# the training crop: timm's train.py default --train-interpolation 'random', one of these per
# image (RandAugment's geometric ops draw theirs too: twinstep.data.augment)
TRAIN_INTERPOLATIONS = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC)


def to_rgb(img: Image.Image) -> Image.Image:
    """Any mode (L, P, RGBA, CMYK, I;16, ...) -> RGB, as torchvision's default loader does
    (an RGB image is returned as is: convert() would copy it)."""
    return img if img.mode == "RGB" else img.convert("RGB")


def short_side_size(w: int, h: int, short: int) -> tuple[int, int]:
    """torchvision's Resize(int) of a w x h image: (w, h) with the short side at `short`, the
    long side int(short * long / short_in) (truncated)."""
    return (short, int(short * h / w)) if w <= h else (int(short * w / h), short)


def center_offsets(w: int, h: int, size: int) -> tuple[int, int]:
    """torchvision's CenterCrop(size) of a w x h image at least size x size: (top, left),
    rounded by Python's round() — (h - size) / 2 = k + 0.5 goes to the even neighbour."""
    return int(round((h - size) / 2.0)), int(round((w - size) / 2.0))


def _resize_short(img: Image.Image, short: int) -> Image.Image:
    """`short_side_size` of a PIL image; an image already that size is returned as is."""
    new = short_side_size(*img.size, short)
    return img if new == img.size else img.resize(new, INTERPOLATION)


def _center_crop(img: Image.Image, size: int) -> Image.Image:
    """torchvision's CenterCrop(size) of a PIL image: zero-pad an edge shorter than the crop
    (the odd pixel on the right / bottom), then crop at offsets rounded half to even."""
    w, h = img.size
    if size > w or size > h:
        pad_w, pad_h = max(size - w, 0), max(size - h, 0)
        left, top = pad_w // 2, pad_h // 2
        padded = Image.new(img.mode, (w + pad_w, h + pad_h), 0)
        padded.paste(img, (left, top))
        img, (w, h) = padded, padded.size
        if (w, h) == (size, size):
            return img
    top, left = center_offsets(w, h, size)
    return img.crop((left, top, left + size, top + size))


def eval_transform(img: Image.Image, size: int, crop_pct: float = CROP_PCT) -> np.ndarray:
    """timm's eval transform before ToTensor: RGB, resize the short side to
    floor(size / crop_pct) (bilinear, Pillow's antialiasing), centre crop size x size.
    Returns uint8 [size, size, 3]."""
    out = _center_crop(_resize_short(to_rgb(img), math.floor(size / crop_pct)), size)
    return np.asarray(out, dtype=np.uint8)


def rrc_box(rng: np.random.Generator, width: int, height: int, scale=SCALE,
            ratio=RATIO) -> tuple[int, int, int, int]:
    """A random-resized-crop box (top, left, h, w) of a width x height image, by timm's
    RandomResizedCropAndInterpolation.get_params: up to 10 tries of an area fraction uniform in
    `scale` and an aspect log-uniform in `ratio`, sides rounded half to even, kept if they fit;
    else the centre crop of the image clamped to the ratio range."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = float(rng.uniform(*scale)) * area
        aspect = math.exp(float(rng.uniform(*log_ratio)))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if w <= width and h <= height:
            top = int(rng.integers(0, height - h + 1))  # inclusive bounds, as random.randint
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop(img: Image.Image, box: tuple[int, int, int, int], size: int,
                 interpolation: Image.Resampling = INTERPOLATION) -> Image.Image:
    """Crop box = (top, left, h, w) and resize it to size x size — torchvision's F.resized_crop
    on a PIL image (crop first, so the filter never reads outside the box)."""
    top, left, h, w = box
    crop = img.crop((left, top, left + w, top + h))
    return crop if crop.size == (size, size) else crop.resize((size, size), interpolation)


def train_transform(img: Image.Image, size: int, rng: np.random.Generator,
                    randaugment: int | None = None) -> np.ndarray:
    """timm's training transform (train.py's defaults) before ToTensor: RGB, random-resized
    crop (scale (0.08, 1), ratio (3/4, 4/3), bilinear or bicubic at random), horizontal flip
    with p 0.5, then RandAugment of magnitude `randaugment` when given. The draws, in timm's
    order: the box, the filter, the flip, RandAugment's. Returns uint8 [size, size, 3]."""
    img = to_rgb(img)
    box = rrc_box(rng, img.width, img.height)
    img = resized_crop(img, box, size, TRAIN_INTERPOLATIONS[int(rng.integers(2))])
    if rng.random() < HFLIP:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if randaugment is not None:
        img = rand_augment(img, rng, randaugment, size)
    return np.asarray(img, dtype=np.uint8)


def normalize(x: np.ndarray) -> np.ndarray:
    """uint8 [..., 3] -> float32 [..., 3]: (x / 255 - MEAN) / STD, each op rounded to float32 in
    torchvision's order (ToTensor's true division by 255, then Normalize's sub and div) — a
    multiply by 1/255 instead would differ by up to ~7e-7."""
    return (x.astype(np.float32) / np.float32(255) - MEAN) / STD


# [256, 3]: `normalize` of every byte in every channel — what the devices look pixels up in
# (twinstep.program.network_input)
NORMALIZED = normalize(np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, axis=1))
