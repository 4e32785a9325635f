"""RandAugment as timm's ImageNet train transform applies it for ``rand-m{M}-mstd0.5-inc1``:
Pillow + NumPy, every random draw taken from an explicit ``np.random.Generator``.

The policy (timm's ``rand_augment_transform`` with the hparams ``transforms_imagenet_train``
builds): pick ``layers`` ops from the 15 "increasing" ops uniformly *with* replacement; each is
applied with probability ``prob``, at a magnitude drawn from N(M, mstd) and clipped to [0, 10].
The ops that timm negates at random (rotate, shear, translate, the four enhancers) flip their
argument's sign with probability 1/2, and each geometric op draws its resampling filter from
{bilinear, bicubic} unless the interpolation is fixed (timm's default train interpolation is
"random"). Geometric ops fill uncovered pixels with the ImageNet mean as 8-bit RGB.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

MAX_LEVEL = 10.0  # magnitudes live on a 0..10 scale; larger M saturates at 10
IMAGENET_MEAN = (0.485, 0.456, 0.406)
RANDOM_INTERPOLATION = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC)


@dataclasses.dataclass(frozen=True)
class AugmentParams:
    """What the ops need beyond the image: ``interpolation`` None means "draw per geometric op"
    (only `rand_augment` resolves that; the ops themselves need a fixed filter)."""

    translate_const: int  # timm passes it; only its absolute translates (not in this set) read it
    img_mean: tuple[int, int, int]
    interpolation: Image.Resampling | None = None

    @classmethod
    def from_size(cls, size: int | tuple[int, int],
                  interpolation: Image.Resampling | None = None) -> AugmentParams:
        """The hparams timm's train transform derives from the crop size S (int or (h, w))."""
        s = min(size) if isinstance(size, tuple) else size
        mean = tuple(min(255, round(255 * m)) for m in IMAGENET_MEAN)
        return cls(int(s * 0.45), mean, interpolation)


def _resample(hp: AugmentParams) -> Image.Resampling:
    if hp.interpolation is None:
        raise ValueError("the op needs a fixed interpolation; rand_augment draws one per op")
    return hp.interpolation


def _affine(img: Image.Image, coeffs: tuple, hp: AugmentParams) -> Image.Image:
    # Pillow's AFFINE samples output pixel (x, y) from input (a x + b y + c, d x + e y + f)
    return img.transform(img.size, Image.Transform.AFFINE, coeffs, resample=_resample(hp),
                         fillcolor=hp.img_mean)


def _enhance_factor(level: float, sign: int) -> float:
    # 1.0 is the identity; the level moves the factor up to 0.9 away from it, floored at 0.1
    return max(0.1, 1.0 + sign * level / MAX_LEVEL * 0.9)


def _solarize_add(img: Image.Image, level: float) -> Image.Image:
    add = min(128, int(level / MAX_LEVEL * 110))
    lut = [min(255, i + add) if i < 128 else i for i in range(256)]
    if img.mode not in ("L", "RGB"):
        return img  # timm leaves other modes untouched
    return img.point(lut * len(img.getbands()))


def _posterize(img: Image.Image, level: float) -> Image.Image:
    bits = 4 - int(level / MAX_LEVEL * 4)  # keeps 4 down to 0 most significant bits
    return img if bits >= 8 else ImageOps.posterize(img, bits)


def _solarize(img: Image.Image, level: float) -> Image.Image:
    # the threshold falls from 256 (identity) to 0 (full inversion) as the level rises
    return ImageOps.solarize(img, 256 - min(256, int(level / MAX_LEVEL * 256)))


def _shear(axis: int) -> Callable:
    def op(img, level, sign, hp):
        f = sign * level / MAX_LEVEL * 0.3
        return _affine(img, (1, f, 0, 0, 1, 0) if axis == 0 else (1, 0, 0, f, 1, 0), hp)
    return op


def _translate_rel(axis: int) -> Callable:
    def op(img, level, sign, hp):
        # a fraction (up to 0.45) of the image's own width / height, not of translate_const
        px = sign * level / MAX_LEVEL * 0.45 * img.size[axis]
        return _affine(img, (1, 0, px, 0, 1, 0) if axis == 0 else (1, 0, 0, 0, 1, px), hp)
    return op


def _enhancer(cls) -> Callable:
    return lambda img, level, sign, hp: cls(img).enhance(_enhance_factor(level, sign))


# name (timm's) -> op(img, level in [0, 10], sign +1/-1, AugmentParams) -> img
OPS: dict[str, Callable[[Image.Image, float, int, AugmentParams], Image.Image]] = {
    "AutoContrast": lambda img, level, sign, hp: ImageOps.autocontrast(img),
    "Equalize": lambda img, level, sign, hp: ImageOps.equalize(img),
    "Invert": lambda img, level, sign, hp: ImageOps.invert(img),
    "Rotate": lambda img, level, sign, hp: img.rotate(
        sign * level / MAX_LEVEL * 30.0, resample=_resample(hp), fillcolor=hp.img_mean),
    "PosterizeIncreasing": lambda img, level, sign, hp: _posterize(img, level),
    "SolarizeIncreasing": lambda img, level, sign, hp: _solarize(img, level),
    "SolarizeAdd": lambda img, level, sign, hp: _solarize_add(img, level),
    "ColorIncreasing": _enhancer(ImageEnhance.Color),
    "ContrastIncreasing": _enhancer(ImageEnhance.Contrast),
    "BrightnessIncreasing": _enhancer(ImageEnhance.Brightness),
    "SharpnessIncreasing": _enhancer(ImageEnhance.Sharpness),
    "ShearX": _shear(0),
    "ShearY": _shear(1),
    "TranslateXRel": _translate_rel(0),
    "TranslateYRel": _translate_rel(1),
}
SIGNED = frozenset({"Rotate", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
                    "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"})
GEOMETRIC = frozenset({"Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel"})
_NAMES = tuple(OPS)  # timm's list order: the op index drawn below indexes it


class Drawn(NamedTuple):
    """One applied RandAugment op as drawn: the op, its level in [0, 10], its sign, its
    resampling filter (geometric ops; None otherwise)."""

    name: str
    level: float
    sign: int
    interpolation: Image.Resampling | None


def draw(rng: np.random.Generator, magnitude: int, *, layers: int = 2, mstd: float = 0.5,
         prob: float = 0.5, interpolation: Image.Resampling | None = None) -> list[Drawn]:
    """One RandAugment draw: the ops that apply, in order (0 to ``layers`` of them).

    Draws, in timm's order: the ``layers`` op indices; then per op: apply-or-not, the magnitude,
    the sign (signed ops only), the resampling filter (geometric ops, unless ``interpolation``).
    """
    drawn = []
    for i in rng.integers(0, len(_NAMES), size=layers):
        name = _NAMES[i]
        if prob < 1.0 and rng.random() > prob:
            continue
        level = float(magnitude)
        if mstd == float("inf"):
            level = rng.uniform(0.0, level)
        elif mstd > 0:
            level = rng.normal(level, mstd)
        level = max(0.0, min(level, MAX_LEVEL))
        sign = -1 if name in SIGNED and rng.random() > 0.5 else 1
        interp = None
        if name in GEOMETRIC:
            interp = (interpolation if interpolation is not None
                      else RANDOM_INTERPOLATION[rng.integers(2)])
        drawn.append(Drawn(name, level, sign, interp))
    return drawn


def rand_augment(img: Image.Image, rng: np.random.Generator, magnitude: int, size: int, *,
                 layers: int = 2, mstd: float = 0.5, prob: float = 0.5,
                 interpolation: Image.Resampling | None = None) -> Image.Image:
    """One RandAugment draw (`draw`) applied to an RGB uint8 image (any H x W); returns an image
    of the same size."""
    hp = AugmentParams.from_size(size, interpolation)
    for op in draw(rng, magnitude, layers=layers, mstd=mstd, prob=prob,
                   interpolation=interpolation):
        img = OPS[op.name](img, op.level, op.sign,
                           dataclasses.replace(hp, interpolation=op.interpolation))
    return img


_CONFIG = re.compile(r"rand-m(\d+)-mstd0\.5-inc1")


def parse(config: str) -> int:
    """The magnitude M of ``rand-m{M}-mstd0.5-inc1``, the only RandAugment config supported."""
    m = _CONFIG.fullmatch(config)
    if m is None:
        raise ValueError(f"unsupported augment {config!r}: only 'rand-m{{M}}-mstd0.5-inc1' "
                         "(M an integer magnitude) is accepted")
    return int(m.group(1))
