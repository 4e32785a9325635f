"""The data transforms against timm / torchvision (the oracles): the eval resize + centre crop and
the RRC pixel for pixel, normalisation bit for bit, the RRC box algorithm by replaying the same
random draws through timm's get_params, and mixup / cutmix against timm's Mixup at a fixed λ and
box. Every comparison has a negative control showing it can fail.

The images are real files (JPEG and PNG, several modes) written from scikit-learn's bundled
digits, upsampled and coloured.
"""

import importlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from twinstep.data import mix, transforms
from twinstep.data.transforms import eval_transform, normalize, resized_crop, rrc_box, to_rgb
from twinstep.ops.loss import smooth_targets

# name -> ((width, height), mode written, format)
FILES = {
    "a.jpg": ((37, 53), "RGB", "JPEG"),
    "b.jpg": ((64, 48), "RGB", "JPEG"),
    "c.jpg": ((300, 200), "RGB", "JPEG"),
    "grey.png": ((45, 70), "L", "PNG"),
    "palette.png": ((80, 60), "P", "PNG"),
    "alpha.png": ((50, 50), "RGBA", "PNG"),
    "cmyk.jpg": ((41, 29), "CMYK", "JPEG"),
    "deep.png": ((33, 35), "I;16", "PNG"),
}


def _picture(seed: int, size: tuple[int, int]) -> np.ndarray:
    """uint8 [h, w, 3]: three digits upsampled (bicubic) into the channels, plus a little noise
    so that a one-pixel shift or another filter shows in every resample."""
    from sklearn.datasets import load_digits

    digits = load_digits().images
    rng = np.random.default_rng(seed)
    chans = [np.asarray(Image.fromarray((digits[i] * 15.9).astype(np.uint8)).resize(
        size, Image.Resampling.BICUBIC), np.float32) for i in rng.choice(len(digits), 3)]
    img = np.stack(chans, -1) + rng.normal(0, 12, (size[1], size[0], 3))
    return np.clip(img, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("images")
    paths = {}
    for k, (name, (size, mode, fmt)) in enumerate(FILES.items()):
        rgb = Image.fromarray(_picture(k, size))
        if mode == "P":
            img = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        elif mode == "RGBA":
            img = rgb.copy()
            img.putalpha(Image.fromarray(_picture(99, size)[..., 0]))
        elif mode == "I;16":
            img = Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 3)
        else:
            img = rgb.convert(mode)
        paths[name] = str(root / name)
        img.save(paths[name], fmt)
        assert Image.open(paths[name]).mode == mode  # the file really holds that mode
    return paths


def _tv():
    """torchvision's transforms.functional and default loader (imported in oracle tests only)."""
    return (importlib.import_module("torchvision.transforms.functional"),
            importlib.import_module("torchvision.datasets.folder").pil_loader)


@pytest.mark.oracle
def test_to_rgb_is_torchvisions_loader(files):
    _, pil_loader = _tv()
    for path in files.values():
        ours = to_rgb(Image.open(path))
        assert ours.mode == "RGB"
        assert np.array_equal(np.asarray(ours), np.asarray(pil_loader(path)))


def _timm_eval_before_tensor(size: int, crop_pct: float):
    """timm's eval transform with its ToTensor + Normalize tail cut off (-> a PIL image)."""
    from oracle_libs import timm
    from torchvision.transforms import Compose

    tf = timm.data.create_transform(size, is_training=False, crop_pct=crop_pct)
    assert [type(t).__name__ for t in tf.transforms] == [
        "Resize", "CenterCrop", "MaybeToTensor", "Normalize"]
    return Compose(tf.transforms[:-2])


@pytest.mark.oracle
def test_eval_transform_is_timms_pixel_for_pixel(files):
    _, pil_loader = _tv()
    # S = 32 puts a centre-crop offset at exactly k + 0.5 (33 - 32 = 1: round-half-even gives 0);
    # crop_pct 1.1 makes the resized image smaller than the crop (torchvision's zero padding)
    for size, crop_pct in [(32, 0.95), (64, 0.95), (224, 0.95), (64, 0.875), (32, 1.1)]:
        timm_tf = _timm_eval_before_tensor(size, crop_pct)
        for path in files.values():
            ours = eval_transform(Image.open(path), size, crop_pct)
            assert ours.dtype == np.uint8 and ours.shape == (size, size, 3)
            expected = np.asarray(timm_tf(pil_loader(path)))
            assert np.array_equal(ours, expected), (path, size, crop_pct)
    # negative control: the other crop_pct is a different image
    timm_tf = _timm_eval_before_tensor(64, 0.95)
    for path in files.values():
        other = eval_transform(Image.open(path), 64, crop_pct=0.875)
        assert not np.array_equal(other, np.asarray(timm_tf(pil_loader(path)))), path


@pytest.mark.oracle
def test_normalize_is_torchvisions_bit_for_bit(files):
    from oracle_libs import timm

    tf = timm.data.create_transform(64, is_training=False, crop_pct=0.95)
    to_tensor_normalize = tf.transforms[-2:]  # timm's MaybeToTensor, Normalize
    assert np.array_equal(transforms.MEAN, np.float32(timm.data.IMAGENET_DEFAULT_MEAN))
    assert np.array_equal(transforms.STD, np.float32(timm.data.IMAGENET_DEFAULT_STD))
    ramp = np.arange(256 * 3, dtype=np.uint8).reshape(16, 16, 3)  # every byte in every channel
    pics = [ramp] + [eval_transform(Image.open(p), 64) for p in list(files.values())[:3]]
    for pic in pics:
        t = Image.fromarray(pic)
        for step in to_tensor_normalize:
            t = step(t)
        expected = t.numpy().transpose(1, 2, 0)
        ours = normalize(pic)
        assert ours.dtype == np.float32
        # measured: max |ours - torchvision| = 0.0 (the same float32 ops in the same order)
        assert np.array_equal(ours, expected)
        # negative control: multiplying by 1/255 instead of dividing is off by up to ~7e-7
        if pic is ramp:
            recip = (pic.astype(np.float32) * np.float32(1 / 255) - transforms.MEAN)
            assert not np.array_equal(recip / transforms.STD, expected)
    # batched [..., 3] input broadcasts the same way
    assert np.array_equal(normalize(np.stack(pics[1:])), np.stack([normalize(p) for p in pics[1:]]))


class _Recorder:
    """A Generator stand-in that logs each draw as timm's `random` call would name it."""

    def __init__(self, seed):
        self.rng, self.log = np.random.default_rng(seed), []

    def uniform(self, lo, hi):
        v = self.rng.uniform(lo, hi)
        self.log.append(("uniform", lo, hi, v))
        return v

    def integers(self, lo, hi):
        v = self.rng.integers(lo, hi)
        self.log.append(("randint", lo, hi - 1, v))  # random.randint's high is inclusive
        return v


def _replay(log):
    """timm's `random` module as a replay of `log`, checking each call asks for the same range."""
    calls = iter(log)

    def call(kind):
        def f(lo, hi):
            k, lo_, hi_, v = next(calls)
            assert (k, lo_, hi_) == (kind, lo, hi)
            return v
        return f

    return SimpleNamespace(uniform=call("uniform"), randint=call("randint")), calls


# (width, height): ordinary, tall, square, one that often needs several tries (300 x 60), and two
# no try can fit (every try fails: the centre crop clamped to the ratio range)
SIZES = [(300, 200), (53, 37), (37, 53), (64, 48), (20, 20), (300, 60), (400, 10), (10, 400)]


@pytest.mark.oracle
def test_rrc_box_is_timms_get_params(monkeypatch):
    from oracle_libs import timm

    tt = importlib.import_module("timm.data.transforms")
    rrc = timm.data.create_transform(32, is_training=True).transforms[0]
    assert type(rrc).__name__ == "RandomResizedCropAndInterpolation"
    assert (rrc.scale, rrc.ratio) == (transforms.SCALE, transforms.RATIO)
    tries, fell_back = set(), set()
    for w, h in SIZES:
        img = Image.new("L", (w, h))
        for seed in range(40):
            rec = _Recorder(seed)
            ours = rrc_box(rec, w, h)
            fake, rest = _replay(rec.log)
            monkeypatch.setattr(tt, "random", fake)
            assert ours == tt.RandomResizedCropAndInterpolation.get_params(img, rrc.scale,
                                                                          rrc.ratio), (w, h, seed)
            assert next(rest, None) is None  # timm consumed every draw we made
            tries.add(sum(k == "uniform" for k, *_ in rec.log) // 2)
            fell_back.add(all(k == "uniform" for k, *_ in rec.log))
    # first tries, retries and the fallback all ran
    assert {1, 2, 10} <= tries and fell_back == {True, False}
    # negative control: one replayed offset moved by a pixel gives another box
    rec = _Recorder(0)
    ours = rrc_box(rec, 300, 200)
    k, lo, hi, v = rec.log[-1]
    rec.log[-1] = (k, lo, hi, v + 1 if v < hi else v - 1)
    monkeypatch.setattr(tt, "random", _replay(rec.log)[0])
    assert ours != tt.RandomResizedCropAndInterpolation.get_params(Image.new("L", (300, 200)),
                                                                   rrc.scale, rrc.ratio)


def _fallback(w: int, h: int) -> tuple[int, int, int, int]:
    """The box when no try fits: the centred crop of aspect clamped to [3/4, 4/3]."""
    bw, bh = (w, round(w / (3 / 4))) if w / h < 3 / 4 else (
        (round(h * 4 / 3), h) if w / h > 4 / 3 else (w, h))
    return (h - bh) // 2, (w - bw) // 2, bh, bw


def test_rrc_box_valid_and_fallbacks():
    for w, h in SIZES:
        fallback = _fallback(w, h)
        for seed in range(200):
            top, left, bh, bw = box = rrc_box(np.random.default_rng(seed), w, h)
            assert 0 <= top and top + bh <= h and 0 <= left and left + bw <= w
            assert bh >= 1 and bw >= 1
            if box == fallback:
                continue
            # a drawn box: its sides are the rounded sqrt(A r), sqrt(A / r) (each within 0.5) of
            # an area A in [0.08, 1] * w h and a ratio r in [3/4, 4/3]
            assert (bw - .5) * (bh - .5) <= w * h and (bw + .5) * (bh + .5) >= 0.08 * w * h
            assert (bw - .5) / (bh + .5) <= 4 / 3 and (bw + .5) / (bh - .5) >= 3 / 4
    # the fallbacks: no try fits 400 x 10 (each h >= round(sqrt(0.08 * 4000 * 3 / 4)) = 15), so
    # the centre crop clamped to 4/3 or 3/4; a stand-in drawing the largest area and widest ratio
    # every time (too wide for a square) gets the whole image
    assert rrc_box(np.random.default_rng(0), 400, 10) == (0, 193, 10, 13) == _fallback(400, 10)
    assert rrc_box(np.random.default_rng(0), 10, 400) == (193, 0, 13, 10) == _fallback(10, 400)
    assert rrc_box(SimpleNamespace(uniform=lambda lo, hi: hi), 20, 20) == (0, 0, 20, 20)


@pytest.mark.oracle
def test_resized_crop_is_timms_rrc(files, monkeypatch):
    F, pil_loader = _tv()
    from oracle_libs import timm

    # timm's train.py pipeline (--train-interpolation random); its ColorJitter(0.4) is left out
    # (transforms.py says why)
    tf = timm.data.create_transform(48, is_training=True, interpolation="random")
    assert [type(t).__name__ for t in tf.transforms] == [
        "RandomResizedCropAndInterpolation", "RandomHorizontalFlip", "ColorJitter",
        "MaybeToTensor", "Normalize"]
    rrc = tf.transforms[0]
    modes = (F.InterpolationMode.BILINEAR, F.InterpolationMode.BICUBIC)
    assert rrc.interpolation == modes  # one drawn per image, ours from the same two
    assert [m.value for m in modes] == [i.name.lower() for i in transforms.TRAIN_INTERPOLATIONS]
    rng = np.random.default_rng(7)
    for path in [files["a.jpg"], files["c.jpg"], files["palette.png"]]:
        img = pil_loader(path)
        for _ in range(3):
            box = rrc_box(rng, img.width, img.height)
            for interp, mode in zip(transforms.TRAIN_INTERPOLATIONS, modes, strict=True):
                got = np.asarray(resized_crop(img, box, 48, interp))
                monkeypatch.setattr(rrc, "get_params", lambda *a, box=box: box)
                monkeypatch.setattr(rrc, "interpolation", mode)
                assert np.array_equal(got, np.asarray(rrc(img))), (path, box, mode)
                assert np.array_equal(got, np.asarray(F.resized_crop(img, *box, [48, 48], mode)))
            ours = np.asarray(resized_crop(img, box, 48))  # the default: bilinear
            # negative controls: the box one pixel to the right, or a bicubic resize, differ
            top, left, h, w = box
            shifted = (top, left + 1, h, w) if left + w < img.width else (top, left - 1, h, w)
            assert not np.array_equal(np.asarray(resized_crop(img, shifted, 48)), ours)
            bicubic = F.resized_crop(img, *box, [48, 48], F.InterpolationMode.BICUBIC)
            assert not np.array_equal(np.asarray(bicubic), ours)


def test_train_transform_is_rrc_then_flip(files):
    img = Image.open(files["palette.png"])  # P mode: converted to RGB first
    flips = set()
    for seed in range(12):
        out = transforms.train_transform(img, 40, np.random.default_rng(seed))
        assert out.dtype == np.uint8 and out.shape == (40, 40, 3)
        assert np.array_equal(out, transforms.train_transform(img, 40,
                                                              np.random.default_rng(seed)))
        rng = np.random.default_rng(seed)  # the same draws, in order: box, filter, flip
        box = rrc_box(rng, img.width, img.height)
        interp = transforms.TRAIN_INTERPOLATIONS[int(rng.integers(2))]
        expected = np.asarray(resized_crop(to_rgb(img), box, 40, interp))
        flip = rng.random() < 0.5
        flips.add(flip)
        assert np.array_equal(out, expected[:, ::-1] if flip else expected), seed
        assert not np.array_equal(out, expected[:, ::-1] if not flip else expected)  # control
    assert flips == {True, False}


# ---- mixup / cutmix

B, H, W, C, K = 6, 8, 12, 3, 5
LABELS = np.array([0, 3, 1, 4, 2, 0])  # rows 0 and 5 share a class: their targets sum 2 terms


def _batch():
    return np.random.default_rng(3).standard_normal((B, H, W, C)).astype(np.float32)


def _centres(centre):
    """np.random.randint for timm's rand_bbox: returns the centre's y, then x, checking it is
    asked for a y in [0, H), then an x in [0, W)."""
    calls = iter(zip(centre, [H, W], strict=True))

    def randint(lo, hi, size=None):
        v, bound = next(calls)
        assert (lo, hi, size) == (0, bound, None)
        return v

    return randint


def _timm_mix(monkeypatch, x, lam, cutmix, centre, smoothing):
    """timm's Mixup (mode 'batch') on x NHWC at a fixed drawn λ and, for cutmix, box centre."""
    from oracle_libs import torch

    mixup_mod = importlib.import_module("timm.data.mixup")
    m = mixup_mod.Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=smoothing,
                        num_classes=K)
    monkeypatch.setattr(m, "_params_per_batch", lambda: (lam, cutmix))
    monkeypatch.setattr(mixup_mod.np.random, "randint", _centres(centre))
    xt = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
    out, target = m(xt, torch.from_numpy(LABELS))
    return out.numpy().transpose(0, 2, 3, 1), target.numpy()


@pytest.mark.oracle
def test_cutmix_box_is_timms(monkeypatch):
    mixup_mod = importlib.import_module("timm.data.mixup")
    for lam in [0.0, 0.1, 0.37, 0.5, 0.9, 0.999]:
        for cy, cx in [(0, 0), (3, 5), (4, 6), (7, 11), (1, 10)]:  # corners clip the box
            monkeypatch.setattr(mixup_mod.np.random, "randint", _centres((cy, cx)))
            box, lam_t = mixup_mod.cutmix_bbox_and_lam((B, C, H, W), lam)
            ours, lam_ours = mix.cutmix_box(lam, cy, cx, H, W)
            assert ours == tuple(int(v) for v in box) and lam_ours == lam_t, (lam, cy, cx)


@pytest.mark.oracle
def test_apply_is_timms_mixup(monkeypatch):
    x = _batch()
    x0 = x.copy()
    for cutmix, lam in [(False, 0.3), (False, 0.8173), (True, 0.4), (True, 0.75)]:
        centre = (2, 9)
        box, lam_used = (mix.cutmix_box(lam, *centre, H, W) if cutmix else (None, lam))
        ours_x, ours_t = mix.apply(x, LABELS, K, lam_used, box)
        assert np.array_equal(x, x0)  # the input is not mutated
        assert ours_x.dtype == np.float32 and ours_t.dtype == np.float32
        t_x, t_t = _timm_mix(monkeypatch, x, lam, cutmix, centre, smoothing=0.0)
        # the same float32 ops in the same order: bitwise equal
        assert np.array_equal(ours_x, t_x) and np.array_equal(ours_t, t_t), (cutmix, lam)
        # with label smoothing 0.1 on both sides: twinstep smooths the mixed targets, timm mixes
        # smoothed one-hots: equal in exact arithmetic, but the float32 roundings differ
        # (measured max 1.19e-7 = 1 ulp of 1.0, over 200 random λ): tolerance 2 ulp of 1.0
        _, t_smooth = _timm_mix(monkeypatch, x, lam, cutmix, centre, smoothing=0.1)
        assert np.abs(smooth_targets(ours_t, 0.1) - t_smooth).max() <= 2.4e-7
        # negative control: λ off by 0.01 shows in the targets (and the pixels for mixup)
        off_x, off_t = mix.apply(x, LABELS, K, lam_used + 0.01, box)
        assert np.abs(smooth_targets(off_t, 0.1) - t_smooth).max() > 1e-3
        assert cutmix or not np.array_equal(off_x, t_x)
    # negative control for the cutmix pixels: a box one row lower differs
    (y0, y1, x0_, x1), lam_c = mix.cutmix_box(0.4, 2, 9, H, W)
    t_x, _ = _timm_mix(monkeypatch, x, 0.4, True, (2, 9), smoothing=0.0)
    assert not np.array_equal(mix.apply(x, LABELS, K, lam_c, (y0 + 1, y1 + 1, x0_, x1))[0], t_x)


def test_apply_no_mix_and_targets():
    x = _batch()
    out, t = mix.apply(x, LABELS, K, 1.0, None)
    assert np.array_equal(out, x) and out is not x
    assert np.array_equal(t, np.eye(K, dtype=np.float32)[LABELS])
    out, t = mix.apply(x, LABELS, K, 0.3, None)
    # a NumPy float64 λ (as np.random.beta gives) still mixes in float32, as timm's tensors do
    out64, t64 = mix.apply(x, LABELS, K, np.float64(0.3), None)
    assert out64.dtype == t64.dtype == np.float32
    assert np.array_equal(out64, out) and np.array_equal(t64, t)
    assert np.allclose(t.sum(1), 1.0) and t[0, 0] == np.float32(0.3) + np.float32(0.7)
    assert t[1, 3] == np.float32(0.3) and t[1, 2] == np.float32(0.7)  # row 1 with row 4


def test_draw_deterministic_and_rates():
    both = mix.MixParams(mixup_alpha=0.1, cutmix_alpha=1.0)

    def draws(params, seed, n=200):
        rng = np.random.default_rng(seed)
        return [mix.draw(rng, params, H, W) for _ in range(n)]

    a = draws(both, 11)
    assert a == draws(both, 11) and a != draws(both, 12)  # a pure function of the seed
    for lam, box in a:
        assert 0.0 <= lam <= 1.0
        if box is not None:  # cutmix: λ recomputed from the clipped box
            y0, y1, x0, x1 = box
            assert 0 <= y0 <= y1 <= H and 0 <= x0 <= x1 <= W
            assert lam == 1.0 - (y1 - y0) * (x1 - x0) / (H * W)
    # 200 Bernoulli(0.5) draws: sd 7.1, so 100 +- 35 is a 5-sigma bound
    assert 65 <= sum(box is not None for _, box in a) <= 135
    half = draws(mix.MixParams(0.1, 1.0, prob=0.5), 13)
    assert 65 <= sum(d == (1.0, None) for d in half) <= 135
    assert all(d == (1.0, None) for d in draws(mix.MixParams(0.1, 1.0, prob=0.0), 14, 20))
    only_mixup = draws(mix.MixParams(0.2, 0.0), 15, 50)
    assert all(box is None and lam < 1.0 for lam, box in only_mixup)
    assert all(box is not None for _, box in draws(mix.MixParams(0.0, 1.0), 16, 50))
    with pytest.raises(ValueError):
        mix.draw(np.random.default_rng(0), mix.MixParams(0.0, 0.0), H, W)
    assert math.isclose(np.mean([lam for lam, _ in only_mixup]), 0.5, abs_tol=0.15)


def test_the_devices_normalise_and_mix_as_the_host_does():
    """`program.prepare_program`, the devices' side of the pipeline, against the host's
    `normalize` and `mix.apply` (which the tests above hold to torchvision's and timm's bit for
    bit): every byte normalised bit for bit; CutMix's pixels, every target and an unmixed batch
    bit for bit; a mixup's pixels within the rounding of one product, which the FMA XLA fuses
    λ x + (1 - λ) x' into skips; the same over R = 2 replicas, the mix pairing rows of
    different replicas. Controls: λ off by 0.01, the box a row lower."""
    import jax

    from twinstep import dp, program

    every = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 3, 1)
    assert np.array_equal(np.asarray(program.network_input(every, np.float32)),
                          transforms.NORMALIZED)
    assert np.array_equal(transforms.NORMALIZED, normalize(every))
    u8 = np.random.default_rng(4).integers(0, 256, (2, B, H, W, C), dtype=np.uint8)
    labels = np.stack([LABELS, LABELS[::-1]]).astype(np.int32)
    one, two = (program.prepare_program(K, program.Setup(replicas=r)) for r in (1, 2))
    sharded = jax.sharding.NamedSharding(dp.mesh(2), dp.MICRO_BATCH)

    def on_devices(lam, box, prepare=one):
        coeffs = np.array([[np.float32(lam), np.float32(1.0 - lam)]] * 2, np.float32)
        boxes = np.array([box or (0, 0, 0, 0)] * 2, np.int32)
        args = (u8, labels, coeffs, boxes, np.zeros((2, B, 0), np.int32))
        if prepare is two:
            args = (*jax.device_put(args[:2], sharded), *args[2:4],
                    jax.device_put(args[4], sharded))
        return tuple(np.asarray(a) for a in prepare(*args))

    for lam, box in [(0.3, None), (0.8173, None), (1.0, None), *(
            mix.cutmix_box(lam, 2, 9, H, W)[::-1] for lam in (0.4, 0.75))]:
        x, t = on_devices(lam, box)
        assert x.dtype == t.dtype == np.float32
        assert all(np.array_equal(a, b) for a, b in zip(on_devices(lam, box, two), (x, t),
                                                         strict=True))
        for m in range(2):
            hx, ht = mix.apply(normalize(u8[m]), labels[m], K, lam, box)
            assert np.array_equal(t[m], ht), (lam, box)
            if box is None and lam != 1.0:
                # the FMA skips the rounding of one product (at most half an ulp of it), and
                # each side rounds its sum once: the bound, elementwise
                n = normalize(u8[m])
                ax, by = n * np.float32(lam), n[::-1] * np.float32(1.0 - lam)
                bound = np.spacing(np.abs(ax)) + np.spacing(np.abs(by)) + np.spacing(np.abs(hx))
                assert np.all(np.abs(x[m] - hx) <= bound), lam
                assert not np.array_equal(x[m], hx)  # the FMA does show
            else:
                assert np.array_equal(x[m], hx), (lam, box)
            off_x, off_t = mix.apply(normalize(u8[m]), labels[m], K, lam + 0.01, box)
            assert np.abs(off_t - t[m]).max() > 1e-3
            assert box is not None or np.abs(off_x - x[m]).max() > 1e-3
    y0, y1, x0, x1 = mix.cutmix_box(0.4, 2, 9, H, W)[0]
    lower, _ = on_devices(0.4, (y0 + 1, y1 + 1, x0, x1))
    assert not np.array_equal(lower[0], mix.apply(normalize(u8[0]), labels[0], K, 0.4,
                                                  (y0, y1, x0, x1))[0])
