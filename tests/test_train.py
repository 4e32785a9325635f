"""`twinstep train`: its configuration refuses bad input before JAX starts, the sampler and the
eval batches count every example, a run killed with SIGKILL and resumed ends bit for bit where
the uninterrupted run does, and R = 2 replicas train the same parameters as one device at the
same global batch (f64) — the tie, through the real loop and real data."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import FAST_COMPILE_NETS

from twinstep import UsageError
from twinstep.data import batches, digits
from twinstep.trainer import TrainConfig, export, load_state

RECIPE = "mnv4in_adamdp4"  # MobileNetV4: compiling dominates its small steps (conftest)


@pytest.mark.parametrize("kw,message", [
    ({"data": "imagenet"}, "only the embedded"),
    ({"recipe": "mnv4in_adam"}, "no 'dp' token"),
    ({"recipe": "resnet50in_foo"}, "bad recipe"),
    ({"res": 48}, "multiple of 32"),
    ({"steps": 0}, "--steps must be >= 1"),
    ({"keep": 0}, "--keep must be >= 1"),
    ({"seed": -1}, "--seed"),
    ({"precision": "f16"}, "unknown --precision"),
])
def test_a_bad_configuration_is_one_line_before_any_work(kw, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**{"recipe": RECIPE, "out": "/tmp/unused", "replicas": 2, **kw})


def test_the_sampler_sees_every_example_once_an_epoch_and_is_a_function_of_the_step():
    size, rows = 50, 8
    seen = np.concatenate([batches.indices(3, s, rows, size) for s in range(25)])  # 4 epochs
    for epoch in range(4):
        assert sorted(seen[epoch * size:(epoch + 1) * size]) == list(range(size))
    assert np.array_equal(batches.indices(3, 7, rows, size), seen[56:64])
    assert not np.array_equal(batches.indices(4, 7, rows, size), seen[56:64])


def test_eval_batches_count_every_image_once():
    images, labels = np.arange(10)[:, None], np.arange(10)
    got = list(batches.eval_batches(images, labels, 4))
    assert [v.sum() for _, _, v in got] == [4, 4, 2]
    assert np.concatenate([y[v] for _, y, v in got]).tolist() == list(range(10))


def test_digits_split_is_fixed_and_normalised():
    train_x, train_y = digits.split("train", 32)
    val_x, val_y = digits.split("val", 32)
    assert (train_x.shape, val_x.shape) == ((1497, 32, 32, 3), (300, 32, 32, 3))
    assert sorted(set(val_y.tolist())) == list(range(10))
    background = (0 - digits.MEAN) / digits.STD  # a blank pixel, normalised as timm would
    assert np.allclose(train_x[0, 0, 0], background, atol=1e-6)


def _train(out, *extra):
    return [sys.executable, "-m", "twinstep.cli", "train", RECIPE, "--out", str(out),
            "--replicas", "2", "--steps", "6", "--ckpt-every", "2", "--eval-every", "6",
            "--log-every", "1", *(["--fast-compile"] if "mnv4" in FAST_COMPILE_NETS else []),
            *extra]


@pytest.mark.slow
@pytest.mark.oracle  # the exported weights in timm
def test_a_run_killed_and_resumed_ends_bit_for_bit_where_an_uninterrupted_one_does(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(_train(whole), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "val (raw): top-1" in done.stdout
    proc = subprocess.Popen(_train(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while not (killed / "checkpoints" / "2").exists() and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(random.Random(0).uniform(0, 0.5))  # somewhere in steps 3-6
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run(_train(killed), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    a, b = load_state(whole), load_state(killed)
    import jax

    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 400
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "eval" not in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # a killed run's lines past its checkpoint are dropped
    _exported_weights_run_in_timm_as_in_twinstep(whole)
    # refused: the same RUN_DIR with another setting
    other = subprocess.run(_train(killed, "--seed", "1"), capture_output=True, text=True,
                           timeout=300)
    assert other.returncode == 2 and other.stderr.count("\n") == 1
    assert "seed = 0" in other.stderr


def _exported_weights_run_in_timm_as_in_twinstep(run_dir):
    """`twinstep export` (both formats) loads into timm, whose eval logits on the val images are
    twinstep's to f32 precision (1e-4 relative); a K-class classifier included."""
    import timm
    import torch

    from twinstep import program
    from twinstep.compare import rel
    from twinstep.nets import mobilenetv4

    state = load_state(run_dir)
    x = digits.split("val", 32)[0][:16]
    ours = program.eval_program(mobilenetv4, "f32")(state["params"], state["buffers"], x)
    done = subprocess.run([sys.executable, "-m", "twinstep.cli", "export", str(run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for path in (done.stdout.strip(), export(str(run_dir), "pth")):
        model = timm.create_model(mobilenetv4.TIMM_NAME, num_classes=digits.CLASSES,
                                  pretrained=True, pretrained_cfg_overlay=dict(
                                      file=path, num_classes=digits.CLASSES)).eval()
        with torch.no_grad():
            theirs = model(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()).numpy()
        assert rel(theirs, ours) <= 1e-4, (path, rel(theirs, ours))


@pytest.mark.slow
def test_two_replicas_train_what_one_device_trains_at_the_same_global_batch(tmp_path):
    """f64, 2 steps of SGD with momentum on digits: R = 2 x N = 4 against R = 1 x N = 8. Every
    parameter (a BN bias that is a structural zero against zero, `compare.grad_err`), every
    running variance, every running mean in units of its channel's std, and the losses within
    1e-10 — the tie's f64 floor. (Momentum traces are gradients: after two steps those of
    nearly cancelling sums move by 1e-10 under any reordering; the whole-step tie holds them to
    its noise floor.)"""
    from twinstep import api
    from twinstep.compare import grad_err, rel

    common = {"steps": 2, "eval_every": 2, "ckpt_every": 2, "log_every": 1, "precision": "f64",
              "fast_compile": "mnv4" in FAST_COMPILE_NETS}
    api.train("mnv4in_momdp4", str(tmp_path / "r2"), replicas=2, batch=4, **common)
    api.train("mnv4in_momdp4", str(tmp_path / "r1"), replicas=1, batch=8, **common)
    two, one = load_state(tmp_path / "r2"), load_state(tmp_path / "r1")
    assert two["params"]["conv_stem.weight"].dtype == np.float64
    params = [grad_err(k, two["params"], one["params"]) for k in one["params"]]
    buffers = one["buffers"]
    var = [rel(two["buffers"][k], buffers[k]) for k in buffers if k.endswith("var")]
    mean = [np.linalg.norm(two["buffers"][k] - buffers[k])
            / np.linalg.norm(np.sqrt(buffers[k[:-len("mean")] + "var"]))
            for k in buffers if k.endswith("mean")]
    assert (len(params), len(var), len(mean)) == (233, 77, 77)
    assert max(params + var + mean) <= 1e-10, (max(params), max(var), max(mean))
    assert 0 < max(params)  # two programs, not one run twice
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl")
               .read_text().splitlines() if "eval" not in line] for d in ("r2", "r1")]
    assert len(losses[0]) == 2 and rel(losses[0], losses[1]) <= 1e-10
    assert os.path.exists(tmp_path / "r2" / "config.json")
