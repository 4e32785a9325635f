"""`--loader device` (twinstep.data.device, .device_ops) against the Pillow path: its reference.
The resize bit for bit, every RandAugment op alone at several magnitudes within its stated bound
(docs/training.md#device-loader), whole rows as the Pillow path's — each with controls the
bound must catch. Needs the [nvimgcodec] extra."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image
from test_data import write_folder

from twinstep import program
from twinstep.data import augment, device, device_ops, loader, sources

# the [nvimgcodec] extra: conftest refuses to run these without it, never skips them
pytestmark = pytest.mark.nvimgcodec

S = 32
# The ops that differ from Pillow at all, and by at most one level: AutoContrast (Pillow rounds
# i * scale and its sum apart in float64; XLA fuses them), the geometric ops (the same float64
# sampling, fused likewise). Every other op is bit for bit. Mean |Δ| per op and magnitude:
MEAN_BOUND = 0.01  # measured <= 0.004 at 64² on 16 images
OFF_BY_ONE = frozenset({"AutoContrast", *augment.GEOMETRIC})
BILINEAR, BICUBIC = Image.Resampling.BILINEAR, Image.Resampling.BICUBIC


def _photos(n, size=S, seed=0):
    """n noisy gradients [n, size, size, 3] uint8 of rising contrast, edges everywhere: the
    first seldom reach 255, the last are clipped there (equalize and autocontrast read both)."""
    r = np.random.default_rng(seed)
    base = np.linspace(0, 200, size)[None, :, None] + np.linspace(0, 50, size)[:, None, None]
    gain = np.linspace(0.6, 1.2, n)[:, None, None, None]
    return np.clip(base * gain + r.normal(0, 30, (n, size, size, 3)), 0, 255).astype(np.uint8)


CANVAS = device.default_canvas(S)


def _resized(crop, bicubic, flip=False, canvas=CANVAS):
    taps = device.Layout(S, canvas, 0).taps
    padded = np.zeros((canvas, canvas, 3), np.uint8)
    padded[:crop.shape[0], :crop.shape[1]] = crop
    xs, xc = device.resize_table(crop.shape[1], S, bicubic, taps)
    ys, yc = device.resize_table(crop.shape[0], S, bicubic, taps)
    if flip:
        xs, xc = xs[::-1], xc[::-1]
    return np.asarray(_resize(padded[None], xs[None], xc[None], ys[None], yc[None]))[0]


_resize = jax.jit(device_ops.resize)


def test_the_resize_is_pillows_bit_for_bit():
    """Pillow's resize of a crop (bilinear and bicubic, down to S from the whole canvas and up
    from 5 pixels, any aspect) equals the devices', every pixel; the flip (the horizontal table
    reversed) is Pillow's flip of it. Controls: the filters swapped, the crop a pixel wider."""
    rng = np.random.default_rng(0)
    canvas = device.default_canvas(S)
    for t in range(12):
        h, w = (int(v) for v in rng.integers(5, canvas + 1, 2))
        crop = _photos(1, canvas, t)[0][:h, :w]
        for bicubic in (False, True):
            filt = BICUBIC if bicubic else BILINEAR
            want = np.asarray(Image.fromarray(crop).resize((S, S), filt))
            assert np.array_equal(_resized(crop, bicubic), want), (h, w, bicubic)
            assert np.array_equal(_resized(crop, bicubic, flip=True), want[:, ::-1])
            assert not np.array_equal(_resized(crop, not bicubic), want)  # control
            wider = _photos(1, canvas, t)[0][:h, :w + 1] if w < canvas else crop[:, 1:]
            assert not np.array_equal(_resized(wider, bicubic), want)  # control


_layer = jax.jit(lambda x, words: device_ops.rand_augment_layer(
    x, **device.Layout(S, S, 1).unpack(
        jnp.concatenate([jnp.zeros((words.shape[0], device.Layout(S, S, 0).words), jnp.int32),
                         words], 1))["layers"][0]))


def _on_devices(images, op):
    words = np.stack([device.layer_plan(op, S)] * len(images))
    return np.asarray(_layer(jnp.asarray(images, jnp.int32), words))


def _pillows(images, op):
    hp = dataclasses.replace(augment.AugmentParams.from_size(S), interpolation=op.interpolation)
    return np.stack([np.asarray(augment.OPS[op.name](Image.fromarray(im), op.level, op.sign, hp))
                     for im in images])


def _variants(name):
    for level in (0.0, 3.3, 6.0, 10.0):
        for sign in (1, -1) if name in augment.SIGNED else (1,):
            for filt in (BILINEAR, BICUBIC) if name in augment.GEOMETRIC else (None,):
                yield augment.Drawn(name, level, sign, filt)


@pytest.mark.parametrize("name", list(augment.OPS))
def test_each_randaugment_op_alone_is_pillows(name):
    """One op at magnitudes 0, 3.3, 6 and 10, both signs and both filters where it has them,
    on 6 images: bit for bit, or within one level (mean <= MEAN_BOUND) for the `OFF_BY_ONE`
    ops. Controls, each beyond that bound: the op three levels stronger (where the magnitude
    acts), its sign flipped, its filter swapped."""
    images = _photos(6)
    for op in _variants(name):
        want = _pillows(images, op)
        diff = np.abs(_on_devices(images, op).astype(int) - want)
        assert diff.max() <= (1 if name in OFF_BY_ONE else 0), op
        assert diff.mean() <= MEAN_BOUND, op
        controls = []
        if name not in ("AutoContrast", "Equalize", "Invert") and op.level <= 6.0:
            controls.append(op._replace(level=op.level + 3))
        if name in augment.SIGNED and op.level > 0:
            controls.append(op._replace(sign=-op.sign))
        if name in augment.GEOMETRIC and op.level > 0:
            controls.append(op._replace(interpolation=BILINEAR if op.interpolation == BICUBIC
                                        else BICUBIC))
        for wrong in controls:
            off = np.abs(_on_devices(images, wrong).astype(int) - want)
            assert off.max() > 1 or off.mean() > MEAN_BOUND, (op, wrong)


def test_device_rows_are_the_pillow_paths(tmp_path):
    """Whole training rows with RandAugment m9 and a mix: the host's batch (`loader
    .train_batch`) through the device's crops equals the Pillow path's rows within one level
    (mean <= MEAN_BOUND: only the `OFF_BY_ONE` ops differ), labels, mixes and skipped images
    alike; the val rows are the Pillow path's bit for bit; the prepare program takes the batch.
    Controls: a flip, RandAugment left off."""
    from twinstep.data import mix

    root = write_folder(str(tmp_path / "data"))
    pillow, ours = sources.get_source(root, S), sources.get_source(root, S, "device")
    aug = sources.Augment(9, mix.MixParams(0.2, 1.0))
    rows = 8
    for step in (0, 1):
        want, got = (loader.train_batch(src, aug, seed=0, step=step, micro=1, rows=rows)
                     for src in (pillow, ours))
        assert got.xs.shape == (1, rows, ours.canvas, ours.canvas, 3)
        for a, b in zip(want[1:4] + (want.skipped,), got[1:4] + (got.skipped,), strict=True):
            assert np.array_equal(a, b)
        crops = np.asarray(device_ops.crops(got.xs[0], got.plan[0], ours.layout(aug)))
        diff = np.abs(crops.astype(int) - want.xs[0])
        assert diff.max() <= 1 and diff.mean() <= MEAN_BOUND, step
        assert np.abs(crops[:, :, ::-1].astype(int) - want.xs[0]).mean() > 10  # control
        plain = loader.train_batch(ours, dataclasses.replace(aug, randaugment=None), seed=0,
                                   step=step, micro=1, rows=rows)
        bare = np.asarray(device_ops.crops(plain.xs[0], plain.plan[0],
                                           ours.layout(sources.Augment())))
        assert np.abs(bare.astype(int) - want.xs[0]).max() > 1  # control: RandAugment's effect
    assert np.array_equal(ours.val_rows(np.arange(8))[0], pillow.val_rows(np.arange(8))[0])
    prepare = program.prepare_program(ours.classes, layout=ours.layout(aug))
    xs, ts = prepare(got.xs, got.labels, got.mix, got.box, got.plan)
    assert xs.shape == (1, rows, S, S, 3) and ts.shape == (1, rows, ours.classes)


def test_device_batches_are_a_function_of_seed_and_step(tmp_path):
    """Whatever the workers, and from wherever a stream starts (a resumed run's), step s's
    canvases and plans are the same; labels and skipped images are the Pillow path's (one file
    truncated, one whose header reads and whose data does not)."""
    import os

    root = write_folder(str(tmp_path / "data"))
    with open(os.path.join(root, "train", "ant", "1.JPG"), "wb") as f:
        f.write(b"\xff\xd8 truncated")
    good = os.path.join(root, "train", "Dog", "1.JPG")
    with open(good, "rb") as f:
        head = f.read()
    with open(good, "wb") as f:  # the header and a little of the scan: Pillow's refuses it too
        f.write(head[:len(head) // 3])
    aug = sources.Augment(9, None)

    def stream(start, workers, kind="device"):
        src = sources.get_source(root, S, kind)
        assert isinstance(src, sources.Source)
        return list(loader.train_stream(src, aug, seed=7, start=start, stop=4, micro=1, rows=8,
                                        workers=workers))

    whole, resumed, pillow = stream(0, 2), stream(2, 0), stream(0, 0, "pillow")
    assert all(np.array_equal(a, b) for x, y in zip(whole[2:], resumed, strict=True)
               for a, b in zip(x, y, strict=True))
    assert [b[1].tolist() for b in whole] == [b[1].tolist() for b in pillow]
    assert [b[-1] for b in whole] == [b[-1] for b in pillow] and sum(len(b[-1]) for b in whole) > 0


@pytest.mark.slow
@pytest.mark.xdist_group("folder-run")  # its step is the resume test's (tests/test_train.py)
def test_a_run_with_the_device_loader_killed_and_resumed_ends_where_it_would_have(tmp_path):
    """`twinstep train --loader device` on 2 replicas, RandAugment, mixup / CutMix and a
    truncated image: the uninterrupted run reads with 2 loader processes, evaluates and counts
    the image it skipped; one killed mid-run (the kill shown to land after a checkpoint, not the
    last) and resumed with a thread ends bitwise where it does."""
    import os
    import signal
    import subprocess

    from test_train import RUN_NET, _await, _logged, _train

    from twinstep.nets import get_net
    from twinstep.processes import launcher
    from twinstep.training.checkpoint import load_state

    data = write_folder(str(tmp_path / "data"))
    with open(os.path.join(data, "train", "ant", "1.JPG"), "wb") as f:
        f.write(b"\xff\xd8 truncated")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(_train(whole, data, "--loader", "device", "--workers", "2"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "val (raw): top-1" in done.stdout and done.stderr.count("does not read") == 1
    proc = subprocess.Popen(_train(killed, data, "--loader", "device"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _await(proc, lambda: (killed / "checkpoints" / "2").is_dir() and _logged(killed) >= 3)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # it was running when the kill landed
    saved = launcher.resume_step(["train", "--out", str(killed)])
    assert saved in (2, 4), saved
    resumed = subprocess.run(_train(killed, data, "--loader", "device"), capture_output=True,
                             text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert f"twinstep train: resumed from step {saved}\n" in resumed.stdout, resumed.stdout
    a, b = jax.tree.leaves(load_state(whole)), jax.tree.leaves(load_state(killed))
    assert len(a) == len(b) > 3 * len(get_net(RUN_NET).param_shapes())
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_loader_is_refused_where_it_cannot_read_and_is_part_of_a_run(tmp_path):
    import json
    import os

    from twinstep import UsageError
    from twinstep.training.config import TrainConfig, check_run_dir

    with pytest.raises(UsageError, match="--loader device decodes images"):
        TrainConfig("mnv4in_adamdp4", str(tmp_path / "a"), loader="device")
    with pytest.raises(UsageError, match="unknown --loader"):
        TrainConfig("mnv4in_adamdp4", str(tmp_path / "a"), loader="opencv")
    root = write_folder(str(tmp_path / "data"))
    run = TrainConfig("mnv4in_adamdp4", str(tmp_path / "run"), data=root, replicas=2)
    assert check_run_dir(run) is False
    config = {k: v for k, v in run.__dict__.items() if k != "loader"}  # a run before --loader
    config["resolved_recipe"] = run.parsed_recipe().__dict__
    with open(os.path.join(run.out, "config.json"), "w") as f:
        json.dump(config, f, default=str)
    assert check_run_dir(run) is True  # recorded no loader: it had the default
    other = TrainConfig("mnv4in_adamdp4", run.out, data=root, replicas=2, loader="device")
    with pytest.raises(UsageError, match="loader = 'pillow', not 'device'"):
        check_run_dir(other)


def test_the_gpu_decoder_is_asked_for_where_jax_has_a_gpu(tmp_path):
    """The decoder follows JAX's backend: the CPU one here, a GPU one (nvJPEG) when asked,
    which this CPU machine refuses in one line — so the GPU branch is the one that ran."""
    from twinstep.errors import BackendError

    root = write_folder(str(tmp_path / "data"))
    ours = sources.get_source(root, S, "device")
    assert ours.decoder.gpu is False  # JAX runs on the CPU here
    gpu = device.Device((ours.train, ours.val), S, gpu_decode=True)
    aug = sources.Augment(None, None)
    with pytest.raises(BackendError, match="opened no GPU decoder"):
        gpu.train_rows(np.arange(2), 0, 0, np.arange(2), aug)


def test_the_blend_is_pillows_for_every_pair_of_levels():
    """Image.blend, which Color, Contrast, Brightness and Sharpness end in, for all 65,536
    (pixel, degenerate) pairs at 21 factors: bit for bit. Control: the same arithmetic with the
    product left to XLA in float32 (fused into one FMA with the sum) differs on some pairs."""
    x, d = (np.repeat(a[None, :, :, None], 3, -1).astype(np.int32)
            for a in np.meshgrid(np.arange(256), np.arange(256), indexing="ij"))
    blend = jax.jit(device_ops._blend)
    fused = jax.jit(lambda x, d, f: jnp.trunc(jnp.clip(
        d + f[:, None, None, None] * (x - d).astype(jnp.float32), 0, 255)).astype(jnp.int32))
    seen = 0
    for level in np.linspace(0, 10, 21):
        factor = augment._enhance_factor(level, 1 if level < 5 else -1)
        f = jnp.asarray([factor], jnp.float32)
        want = np.asarray(Image.blend(Image.fromarray(d[0].astype(np.uint8)),
                                      Image.fromarray(x[0].astype(np.uint8)), factor))
        assert np.array_equal(np.asarray(blend(x, d, f))[0], want), factor
        seen += np.count_nonzero(np.asarray(fused(x, d.astype(jnp.float32), f))[0] != want)
    assert seen > 0  # control
