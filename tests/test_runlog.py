"""RUN_DIR's logs (twinstep.training.run_log): metrics.jsonl and the TensorBoard event files
written by RunLog from a fake run's records (no JAX), read back; a resume's truncation and
purge; a torn last line; the curves PNG.

No TensorBoard reader is installed (tensorboardX writes only, and tensorboard is not a
dependency), so the event files are read here: the TFRecord framing (length, masked CRC-32C of
the length, event, masked CRC-32C of the event) with tensorboardX's CRC, each record parsed as
tensorboardX's ``Event`` proto. Which points TensorBoard shows is then modelled after its two
readers' documented rules (tensorboard/backend/event_processing/plugin_event_accumulator.py,
``_CheckForRestartAndMaybePurge``; tensorboard/data/server/reservoir.rs, "Preemption").
"""

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from twinstep.errors import UsageError
from twinstep.training import run_log


def _train_record(step: int, scale: float) -> dict:
    return {"step": step, "epoch": step / 64, "loss": scale * 2.3 / (1 + step) ** 0.5,
            "lr": 0.1 * (1 - step / 100), "img_per_s": 1000.0 / 3 + step}


def _eval_metrics(step: int, scale: float, ema: bool) -> dict:
    out = {"raw": {"loss": scale / step, "top1": 1 - 1 / step, "top5": 1 - 0.1 / step}}
    if ema:
        out["ema"] = {"loss": scale / (step + 1), "top1": 1 - 1 / (step + 3),
                      "top5": 1 - 0.1 / (step + 3)}
    return out


def _log(log, steps, eval_every=30, scale=1.0, ema=True):
    """Write a fake run's records for ``steps`` through ``log``, as the trainer does (train line,
    then the eval line at the same step); returns (train records, eval records)."""
    train, evals = [], []
    for step in steps:
        train.append(_train_record(step, scale))
        log.train(train[-1])
        if step % eval_every == 0:
            evals.append({"step": step, "eval": _eval_metrics(step, scale, ema)})
            log.eval(step, evals[-1]["eval"])
    return train, evals


def _expected(train, evals) -> dict:
    """{tag: [(step, value)]}: the scalars the records should become, written out here by hand
    (not with runlog's flattening), each value rounded to float32, TensorBoard's scalar type."""
    out = {}
    for r in train:
        for key in ("epoch", "loss", "lr", "img_per_s"):
            out.setdefault(f"train/{key}", []).append((r["step"], float(np.float32(r[key]))))
    for r in evals:
        for weights, metrics in r["eval"].items():
            for key in ("loss", "top1", "top5"):
                out.setdefault(f"eval/{weights}/{key}", []).append(
                    (r["step"], float(np.float32(metrics[key]))))
    return out


def _event_files(run_dir) -> list[str]:
    tb = os.path.join(run_dir, "tb")
    return [os.path.join(tb, n) for n in sorted(os.listdir(tb)) if "tfevents" in n]


def _events(path, torn_ok=False):
    """The Event protos of one event file, every CRC checked; a torn last record (a kill
    mid-write) ends the file only where ``torn_ok``."""
    run_log._import_tensorboardx()  # tensorboardX without torch (see there)
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    with open(path, "rb") as f:
        data = f.read()
    out, pos = [], 0
    while pos < len(data):
        header = data[pos:pos + 8]
        end = pos + 12 + (struct.unpack("<Q", header)[0] if len(header) == 8 else 0)
        if end + 4 > len(data):
            assert torn_ok, f"{path}: torn record at byte {pos}"
            break
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == masked_crc32c(header)
        assert struct.unpack("<I", data[end:end + 4])[0] == masked_crc32c(data[pos + 12:end])
        out.append(Event.FromString(data[pos + 12:end]))
        pos = end + 4
    return out


def _shown(run_dir, reader: str, honour_start=True, torn_ok=False) -> dict:
    """{tag: [(step, value)]}: the points TensorBoard shows for RUN_DIR/tb.

    ``reader="python"`` (EventAccumulator, purge_orphaned_data on): files in name order; with
    file_version brain.Event:2 the first SessionLog.START is the run's start, and each later
    START at step s purges every tag's points at steps >= s (``honour_start=False``: as if
    there were no markers — the negative control). ``reader="rust"`` (the data server, the
    default): START is ignored; a point at step s drops its tag's points at steps >= s."""
    from tensorboardX.proto.event_pb2 import SessionLog

    shown: dict = {}
    started = False
    for path in _event_files(run_dir):
        events = _events(path, torn_ok)
        assert events[0].file_version == "brain.Event:2"
        for ev in events:
            if reader == "python" and honour_start and ev.HasField("session_log") \
                    and ev.session_log.status == SessionLog.START:
                if started:
                    shown = {t: [p for p in pts if p[0] < ev.step] for t, pts in shown.items()}
                started = True
            for v in ev.summary.value:
                points = shown.setdefault(v.tag, [])
                if reader == "rust":
                    points[:] = [p for p in points if p[0] < ev.step]
                points.append((ev.step, v.simple_value))
    return shown


def _nudged(expected: dict, tag: str, index: int) -> dict:
    """``expected`` with one value moved by one float32 ulp."""
    out = {t: list(pts) for t, pts in expected.items()}
    step, value = out[tag][index]
    out[tag][index] = (step, float(np.nextafter(np.float32(value), np.float32(np.inf))))
    return out


def test_metrics_round_trip(tmp_path):
    with run_log.RunLog(str(tmp_path)) as log:
        train, evals = _log(log, range(10, 70, 10))
    assert run_log.read_metrics(str(tmp_path)) == (train, evals)
    lines = (tmp_path / "metrics.jsonl").read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) - 1 == len(train) + len(evals) == 8
    # negative control: one loss one float64 ulp off is told apart (JSON keeps all 17 digits)
    wrong = [dict(r) for r in train]
    wrong[3]["loss"] = float(np.nextafter(wrong[3]["loss"], 1.0))
    assert run_log.read_metrics(str(tmp_path)) != (wrong, evals)


def test_tensorboard_scalars(tmp_path):
    with run_log.RunLog(str(tmp_path)) as log:
        train, evals = _log(log, range(10, 70, 10))
    expected = _expected(train, evals)
    assert set(expected) == {"train/epoch", "train/loss", "train/lr", "train/img_per_s",
                             *(f"eval/{w}/{m}" for w in ("raw", "ema")
                               for m in ("loss", "top1", "top5"))}
    # exact: the values are stored as float32 and compared after the same rounding
    for reader in ("python", "rust"):
        assert _shown(str(tmp_path), reader) == expected
    # negative controls: one float32 ulp in one value, a point at the wrong step
    assert _shown(str(tmp_path), "python") != _nudged(expected, "train/loss", 2)
    assert _shown(str(tmp_path), "python") != _nudged(expected, "eval/ema/top1", 1)
    moved = {t: list(p) for t, p in expected.items()}
    moved["eval/raw/top1"][0] = (31, moved["eval/raw/top1"][0][1])
    assert _shown(str(tmp_path), "python") != moved
    # one event file; its first events: the file version, then the start marker at step 1
    (path,) = _event_files(str(tmp_path))
    start = _events(path)[1]
    assert start.HasField("session_log") and start.step == 1


def test_resume_truncates_and_purges(tmp_path):
    run_dir = str(tmp_path)
    with run_log.RunLog(run_dir) as log:
        old_train, old_evals = _log(log, range(10, 70, 10))  # evals at 30 and 60
    # killed mid-write after step 60: a torn line and a torn event record at the ends
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 70, "epoch": 1.09')
    (first,) = _event_files(run_dir)
    with open(first, "ab") as f:
        f.write(struct.pack("<Q", 90) + b"\x01\x02")
    # the checkpoint at step 40 resumes: new values (scale 2) from step 50 on
    log = run_log.RunLog(run_dir, resume_step=40)
    kept_train, kept_evals = old_train[:4], old_evals[:1]
    assert run_log.read_metrics(run_dir) == (kept_train, kept_evals)
    assert (tmp_path / "metrics.jsonl").read_bytes().endswith(b"}\n")  # the torn tail is gone
    new_train, new_evals = _log(log, [50], scale=2.0)
    # part way (step 50 logged, the eval at 60 not yet): TensorBoard's Python reader has
    # purged everything the killed attempt logged past step 40 ...
    partial = _expected(kept_train + new_train, kept_evals + new_evals)
    assert _shown(run_dir, "python", torn_ok=True) == partial
    # ... which is the marker's doing: without it the killed attempt's steps 50, 60 remain
    stale = _shown(run_dir, "python", honour_start=False, torn_ok=True)
    assert stale != partial and (60, partial["train/loss"][-1][1]) not in stale["train/loss"]
    assert [s for s, _ in stale["train/loss"]] == [10, 20, 30, 40, 50, 60, 50]
    # the Rust reader ignores the marker: the old eval at 60 shows until a new one replaces it
    assert [s for s, _ in _shown(run_dir, "rust", torn_ok=True)["eval/raw/top1"]] == [30, 60]
    more_train, more_evals = _log(log, [60], scale=2.0)
    log.close()
    whole = (kept_train + new_train + more_train, kept_evals + new_evals + more_evals)
    assert [r["step"] for r in whole[0]] == [10, 20, 30, 40, 50, 60]
    assert run_log.read_metrics(run_dir) == whole
    for reader in ("python", "rust"):
        assert _shown(run_dir, reader, torn_ok=True) == _expected(*whole)
    # the killed attempt's values at 50 and 60 differ from the resumed run's: a reader that
    # kept them would be told apart
    assert _expected(*whole) != _expected(old_train, old_evals)
    # two event files (created within the same second), in creation order, the resumed one
    # starting with the purge marker at step 41 (= tensorboardX's purge_step = resume + 1)
    first_again, second = _event_files(run_dir)
    assert first_again == first
    assert [e.step for e in _events(second)[1:2] if e.HasField("session_log")] == [41]


def test_torn_final_line_is_skipped(tmp_path):
    with run_log.RunLog(str(tmp_path)) as log:
        train, evals = _log(log, range(10, 40, 10))
    path = tmp_path / "metrics.jsonl"
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"step": 40, "epoch": 0.625, "lo')
    with pytest.raises(ValueError):  # the control: the last line really is not JSON
        json.loads(path.read_bytes().split(b"\n")[-1])
    assert run_log.read_metrics(str(tmp_path)) == (train, evals)
    # damage elsewhere is not taken for a torn line: one clear line
    path.write_bytes(b'{"step": 10, "lo\n' + whole)
    with pytest.raises(UsageError, match="line 1: not a metrics record") as e:
        run_log.read_metrics(str(tmp_path))
    assert "\n" not in str(e.value)


def _pixels(path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.width > 0 and im.height > 0
        return np.asarray(im.convert("RGB"))


def test_plot_writes_png(tmp_path):
    run_dir = str(tmp_path / "run")
    with run_log.RunLog(run_dir) as log:
        _log(log, range(10, 70, 10))
    path = run_log.plot(run_dir)
    assert path == os.path.join(run_dir, "curves.png")
    assert sorted(os.listdir(run_dir)) == ["curves.png", "metrics.jsonl", "tb"]  # no temporary
    # the same records draw the same picture (the control for the next test)
    again = run_log.plot(run_dir, str(tmp_path / "again.png"))
    assert np.array_equal(_pixels(again), _pixels(path))


def test_plot_draws_the_records(tmp_path):
    pictures = []
    for name, scale, ema in (("a", 1.0, True), ("b", 1.5, True), ("c", 1.0, False)):
        run_dir = str(tmp_path / name / "run")  # one name: the title is the same
        with run_log.RunLog(run_dir) as log:
            _log(log, range(10, 70, 10), scale=scale, ema=ema)
        pictures.append(_pixels(run_log.plot(run_dir)))
    # other train losses (b) or no EMA (c) draw another picture than a's
    assert not np.array_equal(pictures[1], pictures[0])
    assert not np.array_equal(pictures[2], pictures[0])


def test_plot_refuses_nothing_to_draw(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(str(tmp_path / "missing"), "no metrics.jsonl"), (str(empty), "no metrics.jsonl")]
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_bytes(b'{"step": 10, "lo')  # a kill before the first line
    cases.append((str(torn), "no records yet"))
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "metrics.jsonl").write_bytes(b"")
    cases.append((str(blank), "no records yet"))
    for run_dir, why in cases:
        with pytest.raises(UsageError, match=why) as e:
            run_log.plot(run_dir)
        assert "\n" not in str(e.value)
        assert not os.path.exists(os.path.join(run_dir, "curves.png"))
    with run_log.RunLog(str(torn)) as log:  # from scratch: the torn line goes
        _log(log, [10])
    with pytest.raises(UsageError, match="a .png file name"):
        run_log.plot(str(torn), str(tmp_path / "curves.jpg"))


def test_closed_log_refuses_records(tmp_path):
    log = run_log.RunLog(str(tmp_path))
    log.close()
    log.close()  # again: nothing
    with pytest.raises(ValueError, match="closed"):
        log.train(_train_record(10, 1.0))
    assert run_log.read_metrics(str(tmp_path)) == ([], [])


def test_imports_stay_light(tmp_path):
    """``import twinstep.training.run_log`` loads neither tensorboardX nor matplotlib (nor JAX),
    and a RunLog loads tensorboardX without torch (which tensorboardX imports when installed)."""
    code = ("import sys; import twinstep.training.run_log as r\n"
            "heavy = ('tensorboardX', 'matplotlib', 'jax', 'torch', 'numpy')\n"
            "print([m for m in heavy if m in sys.modules])\n"
            f"r.RunLog({str(tmp_path)!r}).close()\n"
            "print('tensorboardX' in sys.modules, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split("\n")
    assert out[:2] == ["[]", "True False"]


@pytest.mark.parametrize("recipe", ["mnv4in_adamdp16", "efficientnetin_emarmsdp64dropdo"])
def test_plot_draws_the_whole_schedule_the_optimizer_steps(tmp_path, recipe):
    """The lr panel draws every step's lr from the run's config.json — NumPy's evaluation of the
    optimizer's own schedule (cosine; step decay), equal to JAX's in f64 at every step, warmup
    included — under the logged points; without a config.json only the records are drawn (the
    control: another picture)."""
    import dataclasses
    import json

    import jax.numpy as jnp

    from twinstep import optim
    from twinstep.training.config import TrainConfig

    cfg = TrainConfig(recipe, str(tmp_path / "unused"), steps=60)
    run = json.loads(json.dumps({"steps": cfg.steps, "resolved_recipe": dataclasses.asdict(
        cfg.parsed_recipe())}))
    steps, lr = run_log._schedule(run)
    want = np.asarray(optim.recipe_schedule(cfg.parsed_recipe())(jnp.arange(60.0)))  # f64
    assert want.dtype == np.float64
    # one formula: NumPy's cos and XLA's differ by an ulp or two
    assert steps.tolist() == list(range(1, 61)) and np.abs(lr - want).max() <= 1e-15 * want.max()
    warmup = cfg.parsed_recipe().warmup_steps
    assert warmup > 0 and lr[0] < lr[warmup - 1] < lr[warmup]  # the ramp is drawn
    pictures = []
    for with_config in (True, False):
        run_dir = tmp_path / f"run{with_config}" / "run"
        with run_log.RunLog(str(run_dir)) as log:
            _log(log, range(10, 70, 10))
        if with_config:
            (run_dir / "config.json").write_text(json.dumps(run))
        pictures.append(_pixels(run_log.plot(str(run_dir))))
    assert not np.array_equal(*pictures)
