"""twinstep.data.augment against timm's RandAugment (timm/data/auto_augment.py): every op
pixel-identical at fixed magnitudes and signs, and the whole policy identical when timm's
random calls are fed from the same Generator stream."""

import functools
import importlib
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from twinstep.data import augment

BILINEAR, BICUBIC = Image.Resampling.BILINEAR, Image.Resampling.BICUBIC
LEVELS = (3.0, 5.5, 10.0)
S = 40  # the crop size the hparams are derived from


@functools.cache
def images() -> tuple[Image.Image, ...]:
    """Three RGB uint8 images: two coloured digits (square, non-square) and a structured pattern.
    No channel spans 0..255, so AutoContrast and Equalize have work to do."""
    from sklearn.datasets import load_digits

    digits = load_digits().images / 16.0

    def colour(grey: np.ndarray) -> Image.Image:
        h, w = grey.shape
        ramp = np.broadcast_to(np.linspace(0, 1, w), (h, w))
        rgb = np.stack([30 + 170 * grey, 190 - 120 * grey + 40 * ramp, 60 + 80 * ramp],
                       axis=-1)
        return Image.fromarray(np.round(rgb).astype(np.uint8))

    def up(i: int, w: int, h: int) -> np.ndarray:
        im = Image.fromarray(digits[i].astype(np.float32), mode="F")
        return np.asarray(im.resize((w, h), BILINEAR))

    y, x = np.mgrid[0:29, 0:37]
    pattern = 0.5 + 0.4 * np.sin(x / 3.0) * np.cos(y / 5.0)
    return colour(up(0, 40, 40)), colour(up(3, 48, 32)), colour(pattern)


@pytest.fixture(scope="module")
def aa():
    return importlib.import_module("timm.data.auto_augment")


def timm_op(aa, monkeypatch, name, img, level, sign, interp):
    """timm's AugmentOp at a fixed magnitude and sign. prob=1.0 and no magnitude_std skip the
    apply-or-not and noise draws, a fixed 'interpolation' hparam skips the filter draw, so the only
    random call left is _randomly_negate's random.random() (> 0.5 negates). We replace the module's
    `random` by a namespace holding just that, so any other draw would fail loudly."""
    monkeypatch.setattr(aa, "random", SimpleNamespace(random=lambda: 1.0 if sign < 0 else 0.0))
    hp = augment.AugmentParams.from_size(S)
    op = aa.AugmentOp(name, prob=1.0, magnitude=level, hparams=dict(
        translate_const=hp.translate_const, img_mean=hp.img_mean, interpolation=interp))
    return np.asarray(op(img.copy()))


@pytest.mark.oracle
def test_ops_match_timm(aa, monkeypatch):
    # one test, not one per op: conftest's per-test teardown (~0.3 s with torch loaded) dominates
    assert list(augment.OPS) == aa._RAND_INCREASING_TRANSFORMS
    for name in augment.OPS:
        interps = (BILINEAR, BICUBIC) if name in augment.GEOMETRIC else (BICUBIC,)
        for img in images():
            for level in LEVELS:
                for sign in (1, -1):
                    for interp in interps:
                        hp = augment.AugmentParams.from_size(S, interp)
                        ours = np.asarray(augment.OPS[name](img, level, sign, hp))
                        theirs = timm_op(aa, monkeypatch, name, img, level, sign, interp)
                        assert ours.shape == theirs.shape == np.asarray(img).shape
                        assert np.array_equal(ours, theirs), (name, img.size, level, sign, interp)

            # negative controls: the comparison above would see a wrong level, sign or no-op
            hp = augment.AugmentParams.from_size(S, BICUBIC)
            out = {(lv, sg): np.asarray(augment.OPS[name](img, lv, sg, hp))
                   for lv in (3.0, 7.0) for sg in (1, -1)}
            if name in ("AutoContrast", "Equalize", "Invert"):
                assert not np.array_equal(out[3.0, 1], np.asarray(img)), name
            else:
                assert not np.array_equal(out[3.0, 1], out[7.0, 1]), (name, img.size)
            if name in augment.SIGNED:
                assert not np.array_equal(out[7.0, 1], out[7.0, -1]), (name, img.size)


def replay(aa, monkeypatch, rng: np.random.Generator):
    """Make timm's RandAugment take its draws from `rng`: np.random.choice (the ops, with
    replacement), random.random (apply-or-not, sign), random.gauss (magnitude), random.choice
    (filter), each mapped to the Generator call twinstep makes for the same draw."""
    def choice(ops, n, replace, p):
        assert replace and p is None
        return [ops[i] for i in rng.integers(0, len(ops), size=n)]

    monkeypatch.setattr(aa, "np", SimpleNamespace(random=SimpleNamespace(choice=choice)))
    monkeypatch.setattr(aa, "random", SimpleNamespace(
        random=rng.random, gauss=rng.normal, choice=lambda seq: seq[rng.integers(len(seq))]))


@pytest.mark.oracle
def test_policy_matches_timm(aa, monkeypatch):
    tf = importlib.import_module("timm.data.transforms_factory")
    for magnitude in (6, 7, 15):
        for interpolation in ("random", "bicubic"):
            # the RandAugment exactly as timm's ImageNet train transform builds it, hparams included
            ra = tf.transforms_imagenet_train(
                S, auto_augment=f"rand-m{magnitude}-mstd0.5-inc1", interpolation=interpolation,
                separate=True)[1].transforms[0]
            hp = augment.AugmentParams.from_size(S)
            assert (ra.ops[0].hparams["translate_const"], ra.ops[0].hparams["img_mean"]) == (
                hp.translate_const, hp.img_mean)
            fixed = None if interpolation == "random" else BICUBIC
            changed = 0
            for seed in range(40):
                img = images()[seed % 3]
                ours = np.asarray(augment.rand_augment(img, np.random.default_rng(seed),
                                                       magnitude, S, interpolation=fixed))
                replay(aa, monkeypatch, np.random.default_rng(seed))
                theirs = np.asarray(ra(img.copy()))
                assert np.array_equal(ours, theirs), (magnitude, interpolation, seed)
                changed += not np.array_equal(ours, np.asarray(img))
            assert changed > 20  # most draws apply an op: the comparisons were not of no-ops
            # negative control: another seed's stream is detected as different
            replay(aa, monkeypatch, np.random.default_rng(1))
            ours = augment.rand_augment(images()[0], np.random.default_rng(0), magnitude, S,
                                        interpolation=fixed)
            assert not np.array_equal(np.asarray(ours), np.asarray(ra(images()[0].copy())))


def test_rand_augment_is_a_function_of_the_seed():
    img = images()[1]
    run = [np.asarray(augment.rand_augment(img, np.random.default_rng(s), 9, S))
           for s in range(20)]
    again = [np.asarray(augment.rand_augment(img, np.random.default_rng(s), 9, S))
             for s in range(20)]
    assert all(np.array_equal(a, b) for a, b in zip(run, again, strict=True))
    assert len({a.tobytes() for a in run}) >= 15  # a few seeds may skip both layers
    assert all(a.shape == np.asarray(img).shape and a.dtype == np.uint8 for a in run)


def test_parse():
    assert augment.parse("rand-m7-mstd0.5-inc1") == 7
    assert augment.parse("rand-m15-mstd0.5-inc1") == 15
    for bad in ("rand-m9-mstd0.5", "rand-m9-mstd1-inc1", "rand-m9-mstd0.5-inc0", "augmix-m5",
                "rand-m9-n3-mstd0.5-inc1", "rand-mx-mstd0.5-inc1", "rand-m9-mstd0.5-inc1 ", ""):
        with pytest.raises(ValueError, match="rand-m"):
            augment.parse(bad)
