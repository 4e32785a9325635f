"""`--loader dali` (twinstep.data.dali) on DALI's CPU operators — the CPU twin of the GPU path,
which differs only in the decoder's device: its crops are the Pillow path's (timm's transform,
tests/test_transforms.py) within DALI's resampling arithmetic, its batches are a function of
(seed, step) whatever its threads, and a run trains with it. Needs the [dali] extra."""

import os
import subprocess

import numpy as np
import pytest
from test_data import write_folder
from test_train import _train

from twinstep import UsageError, cli
from twinstep.data import dali, loader, mix, sources
from twinstep.training.config import TrainConfig, check_run_dir

# the [dali] extra: conftest refuses to run these without it, never skips them
pytestmark = pytest.mark.dali

# Mean |Δ| per crop (of 255) between DALI's and Pillow's resampling of the same box: their
# filters agree, their fixed-point arithmetic does not (measured <= 0.27 here, max |Δ| <= 5)
PIXEL_BOUND = 0.5


def _rows(src, step, augment=None, rows=8):
    idx = np.arange(rows)
    return src.train_rows(idx, 0, step, idx, augment or sources.Augment())[:3]


def _worst(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b).mean(axis=(1, 2, 3)).max())


def test_dali_crops_are_the_pillow_paths_and_a_swapped_filter_is_seen(tmp_path, monkeypatch):
    """Train crops (box, filter, flip: the same draws) and eval crops (timm's resize and centre
    crop) within PIXEL_BOUND of the Pillow path's, per crop, on two steps; the controls: the
    bilinear and bicubic filters swapped, and a flip, exceed it."""
    from nvidia.dali import types

    assert dali.INTERP == (int(types.DALIInterpType.INTERP_TRIANGULAR),
                           int(types.DALIInterpType.INTERP_CUBIC))
    root = write_folder(str(tmp_path / "data"))
    pillow, ours = sources.get_source(root, 16), sources.get_source(root, 16, "dali", 1)
    for step in (0, 1):
        want, got = _rows(pillow, step)[0], _rows(ours, step)[0]
        assert _worst(got, want) <= PIXEL_BOUND, step
        assert _worst(got[:, :, ::-1], want) > 20 * PIXEL_BOUND  # control: a flip
    assert _worst(ours.val_rows(np.arange(8))[0], pillow.val_rows(np.arange(8))[0]) <= PIXEL_BOUND
    monkeypatch.setattr(dali, "INTERP", dali.INTERP[::-1])  # control: the filters swapped
    swapped = sources.get_source(root, 16, "dali", 1)
    assert _worst(_rows(swapped, 0)[0], _rows(pillow, 0)[0]) > 2 * PIXEL_BOUND


def test_dali_batches_are_a_function_of_seed_and_step(tmp_path):
    """Whatever DALI's threads, and from wherever a stream starts (a resumed run's), step s's
    batch is the same; labels and skipped images are the Pillow path's (one file truncated);
    a row whose RandAugment ops were all skipped is its crop without RandAugment, bit for bit,
    and rows that drew an op change; a packed folder reads as its folder does."""
    root = write_folder(str(tmp_path / "data"))
    with open(os.path.join(root, "train", "ant", "1.JPG"), "wb") as f:
        f.write(b"\xff\xd8 truncated")
    augment = sources.Augment(randaugment=9, mix=mix.MixParams(0.2, 1.0))
    def stream(threads, start, workers):
        src = sources.get_source(root, 16, "dali", threads)
        assert isinstance(src, sources.Source)  # every attribute and method of the protocol
        return list(loader.train_stream(src, augment, 7, start, 4, 2, 4, workers))

    whole, resumed = stream(2, 0, 2), stream(1, 2, 0)
    assert all(np.array_equal(a, b) for x, y in zip(whole[2:], resumed, strict=True)
               for a, b in zip(x, y, strict=True))
    pillow = list(loader.train_stream(sources.get_source(root, 16), augment, 7, 0, 4, 2, 4, 0))
    assert [b.labels.tolist() for b in whole] == [b.labels.tolist() for b in pillow]
    assert [b.skipped for b in whole] == [b.skipped for b in pillow] and sum(
        b.skipped for b in whole) > 0
    src = sources.get_source(root, 16, "dali", 1)
    plain, augmented = _rows(src, 3)[0], _rows(src, 3, sources.Augment(randaugment=9))[0]
    sizes = [src._readable(src.train, r)[1] for r in range(8)]  # the rows' images: 0 ... 7
    idle = [all(dali.draws(np.random.default_rng([0, 3, 0, r]), *sizes[r], 9)[f"op{k}"]
                == dali.IDENTITY for k in range(dali.RA_LAYERS)) for r in range(8)]
    assert 0 < sum(idle) < 8, idle  # both kinds of row among these 8
    same = [np.array_equal(plain[r], augmented[r]) for r in range(8)]
    assert all(same[r] for r in range(8) if idle[r]), (same, idle)
    # an op may leave a row as it was (colour on a grey image); most do not
    assert sum(not same[r] for r in range(8) if not idle[r]) >= 2, (same, idle)
    packed = str(tmp_path / "packed")
    assert cli.main(["pack", root, "--out", packed, "--max-side", "320"]) == 0
    from_packed = sources.get_source(packed, 16, "dali", 1)
    assert _rows(from_packed, 0)[0].shape == (8, 16, 16, 3)


def test_a_loader_is_refused_where_it_cannot_read_and_is_part_of_a_run(tmp_path):
    with pytest.raises(UsageError, match="--loader dali decodes images"):
        TrainConfig("mnv4in_adamdp4", str(tmp_path / "a"), loader="dali")
    with pytest.raises(UsageError, match="unknown --loader"):
        TrainConfig("mnv4in_adamdp4", str(tmp_path / "a"), loader="opencv")
    root = write_folder(str(tmp_path / "data"))
    run = TrainConfig("mnv4in_adamdp4", str(tmp_path / "run"), data=root, replicas=2)
    assert check_run_dir(run) is False
    config = {k: v for k, v in run.__dict__.items() if k != "loader"}  # a run before --loader
    config["resolved_recipe"] = run.parsed_recipe().__dict__
    with open(os.path.join(run.out, "config.json"), "w") as f:
        import json

        json.dump(config, f, default=str)
    assert check_run_dir(run) is True  # recorded no loader: it had the default
    other = TrainConfig("mnv4in_adamdp4", run.out, data=root, replicas=2, loader="dali")
    with pytest.raises(UsageError, match="loader = 'pillow', not 'dali'"):
        check_run_dir(other)


@pytest.mark.slow
@pytest.mark.xdist_group("folder-run")  # one worker, in turn: one compiles, the other loads
def test_a_run_trains_with_dali(tmp_path):
    """`twinstep train --loader dali`, RandAugment, mixup / CutMix and a truncated image: the
    run ends, evaluates and counts the image it skipped (its compiles are the resume test's)."""
    data = write_folder(str(tmp_path / "data"))
    with open(os.path.join(data, "train", "ant", "1.JPG"), "wb") as f:
        f.write(b"\xff\xd8 truncated")
    done = subprocess.run(_train(tmp_path / "run", data, "--loader", "dali", "--workers", "2"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert "val (raw): top-1" in done.stdout and done.stderr.count("does not decode") == 1
    assert done.stdout.splitlines()[0].endswith("train 32² (given), eval 64² (given), 6 steps "
                                                 "(given), N = 4 x R = 2, f32 (the default)")
