"""`twinstep train`: its configuration refuses bad input before JAX starts, the sampler and the
eval batches count every example, a run killed with SIGKILL and resumed ends bit for bit where
the uninterrupted run does, and R = 2 replicas train the same parameters as one device at the
same global batch (f64) — the tie, through the real loop and real data."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import FAST_COMPILE_NETS
from oracle_libs import timm, torch

from twinstep import UsageError
from twinstep.data import batches, digits
from twinstep.nets import NETS, get_net, init
from twinstep.training.checkpoint import load_state
from twinstep.training.config import TrainConfig
from twinstep.training.export import write_from_run

RECIPE = "mnv4in_adamdp4"  # MobileNetV4: compiling dominates its small steps (conftest)
# the killed-and-resumed runs' (`_train`): the smallest net, as what is held is the loop's
RUN_NET = "resnet18"


@pytest.mark.parametrize("kw,message", [
    ({"data": "imagenet"}, "no such directory"),
    ({"workers": -1}, "--workers must be in"),
    ({"init_from": "weights.npz"}, "a timm state dict"),
    ({"init_from": "missing.pth"}, "no such file"),
    ({"mixup": float("nan")}, "mixup"),
    ({"randaugment": -1}, "randaugment"),
    ({"recipe": "mnv4in_adam"}, "no 'dp' token"),
    ({"recipe": "resnet50in_foo"}, "bad recipe"),
    ({"res": 48}, "multiple of 32"),
    ({"steps": 0}, "--steps must be >= 1"),
    ({"keep": 0}, "--keep must be >= 1"),
    ({"seed": -1}, "--seed"),
    ({"precision": "f16"}, "unknown --precision"),
    ({"control": "sync"}, "unknown --control"),
    ({"control": "sum", "replicas": 1}, "R = 1 has none"),
    ({"control": "unsynced"}, "its own running statistics"),
])
def test_a_bad_configuration_is_one_line_before_any_work(kw, message):
    with pytest.raises(UsageError, match=message):
        TrainConfig(**{"recipe": RECIPE, "out": "/tmp/unused", "replicas": 2, **kw})


def test_epochs_count_passes_over_the_training_images():
    cfg = TrainConfig(RECIPE, "/tmp/unused", replicas=2, epochs=3)  # N = 4: 8 rows a step
    assert len(digits.labels("train")) == 1497 and cfg.steps == -(-3 * 1497 // 8) == 562
    assert cfg.parsed_recipe().total_steps == 562
    with pytest.raises(UsageError, match="--epochs must be >= 1"):
        TrainConfig(RECIPE, "/tmp/unused", epochs=0)


def test_a_run_parses_its_recipe_once_and_scans_its_folder_once(tmp_path, monkeypatch):
    """A preset on an image folder, its epochs counted from the folder: the configuration
    parses the recipe once and scans each split once, and the source reuses those splits.
    Control: a source opened from the path alone scans both splits again."""
    from test_data import write_folder

    from twinstep import recipes
    from twinstep.data import folder, sources

    root = write_folder(str(tmp_path / "data"))
    calls = {"parse": 0, "scan": 0}

    def counted(name, f):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(recipes, "parse", counted("parse", recipes.parse))
    monkeypatch.setattr(folder, "scan", counted("scan", folder.scan))
    cfg = TrainConfig("mnv4-conv-m", str(tmp_path / "run"), data=root, epochs=1, res=32,
                      eval_res=32, batch=4)
    cfg.parsed_recipe(), sources.get_source(cfg.data, cfg.res, splits=cfg.splits)
    assert calls == {"parse": 1, "scan": 2} and cfg.steps == -(-cfg.train_images // 4)
    sources.get_source(cfg.data, cfg.res)
    assert calls["scan"] == 4  # control: the path alone is scanned again


def test_the_sampler_sees_every_example_once_an_epoch_and_is_a_function_of_the_step():
    size, rows = 50, 8
    seen = np.concatenate([batches.indices(3, s, rows, size) for s in range(25)])  # 4 epochs
    for epoch in range(4):
        assert sorted(seen[epoch * size:(epoch + 1) * size]) == list(range(size))
    assert np.array_equal(batches.indices(3, 7, rows, size), seen[56:64])
    assert not np.array_equal(batches.indices(4, 7, rows, size), seen[56:64])


def test_eval_batches_count_every_image_once():
    got = [batches.eval_rows(b, 4, 10) for b in range(3)]
    assert [v.sum() for _, v in got] == [4, 4, 2]
    assert np.concatenate([i[v] for i, v in got]).tolist() == list(range(10))


def test_digits_split_is_fixed_and_normalised():
    train_x, train_y = digits.split("train", 32)
    val_x, val_y = digits.split("val", 32)
    assert (train_x.shape, val_x.shape) == ((1497, 32, 32, 3), (300, 32, 32, 3))
    assert sorted(set(val_y.tolist())) == list(range(10))
    background = (0 - digits.MEAN) / digits.STD  # a blank pixel, normalised as timm would
    assert np.allclose(train_x[0, 0, 0], background, atol=1e-6)


def _train(out, data, *extra):
    return [sys.executable, "-m", "twinstep.cli", "train", f"{RUN_NET}in_adamdp4", "--out",
            str(out),
            "--data", str(data), "--replicas", "2", "--res", "32", "--eval-res", "64",
            "--steps", "6", "--ckpt-every", "2",
            "--eval-every", "6", "--log-every", "1", "--randaugment", "9", "--mixup", "0.2",
            "--cutmix", "1", *(["--fast-compile"] if RUN_NET in FAST_COMPILE_NETS else []),
            *extra]


@pytest.mark.slow
@pytest.mark.oracle  # the exported weights in timm
@pytest.mark.xdist_group("folder-run")  # its step is the device loader run's (test_device.py)
def test_a_run_killed_and_resumed_ends_bit_for_bit_where_an_uninterrupted_one_does(tmp_path):
    """On an image folder through timm's transforms, RandAugment, mixup / CutMix and an image
    that does not decode: the uninterrupted run reads with 2 loader processes, the killed and
    resumed one with a thread — and ends bitwise where the other does. Training is
    deterministic, so a "resume" that started again from step 0 would end there too: the kill
    is shown to land mid-run (the process still running, a checkpoint written, not the last),
    and the resumed run to restore that checkpoint (its own line) and run only the steps after
    it (its own event file)."""
    from test_data import write_folder

    from twinstep.processes import launcher
    from twinstep.training import compare

    data = write_folder(str(tmp_path / "data"))
    bad = _two_bad_images(data)  # drawn: 6 steps of 8 rows read each of the 11 left
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = subprocess.run(_train(whole, data, "--workers", "2"), capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    assert "val (raw): top-1" in done.stdout
    _named_once_and_counted(whole, done.stderr, bad)
    assert "11 train, 12 val images; 1 left out" in done.stdout, done.stdout
    # killed mid-run: once it has logged step 3 and its step-2 checkpoint is whole — somewhere
    # in steps 4-6, or writing the step-4 checkpoint — while it still runs (the kill's status)
    proc = subprocess.Popen(_train(killed, data), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _await(proc, lambda: (killed / "checkpoints" / "2").is_dir() and _logged(killed) >= 3)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL  # it was running when the kill landed
    saved = launcher.resume_step(["train", "--out", str(killed)])  # its latest whole one
    assert saved in (2, 4) and not (killed / "checkpoints" / "6").exists(), saved
    resumed = subprocess.run(_train(killed, data), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    # the resumed run continued from that checkpoint (the line the loop prints from the state
    # it restored) and ran steps saved + 1 .. 6 only (its own TensorBoard event file)
    assert f"twinstep train: resumed from step {saved}\n" in resumed.stdout, resumed.stdout
    assert attempts(killed)[-1] == (saved + 1, list(range(saved + 1, 7))), attempts(killed)
    _named_once_and_counted(killed, resumed.stderr, bad, resumed=True)
    a, b = load_state(whole), load_state(killed)
    import jax

    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 3 * len(get_net(RUN_NET).param_shapes())  # all
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if "eval" not in line]
    assert steps == [1, 2, 3, 4, 5, 6]  # a killed run's lines past its checkpoint are dropped
    # each evaluation's per-image results: the resumed run's are the uninterrupted one's, and
    # they count the logged top-1 (within its interval)
    found = compare.compare([str(whole), str(killed)])
    assert found["step"] == 6 and found["pairs"][0]["only_first"] == 0
    assert found["pairs"][0]["only_run"] == 0
    logged = json.loads(lines[-1])["eval"]["raw"]
    assert found["runs"][0]["top1"] == logged["top1"]
    assert logged["top1_low"] <= logged["top1"] <= logged["top1_high"]
    assert "(95% interval" in done.stdout
    _exported_weights_evaluate_in_timm_as_in_twinstep(whole, data)
    again = subprocess.run(_train(killed, data), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and "already finished at step 6;" in again.stdout, again.stdout
    assert (killed / "metrics.jsonl").read_text().splitlines() == lines  # nothing ran
    # refused: the same RUN_DIR with another setting
    other = subprocess.run(_train(killed, data, "--seed", "1"), capture_output=True, text=True,
                           timeout=300)
    assert other.returncode == 2 and other.stderr.count("\n") == 1
    assert "seed = 0" in other.stderr


def _two_bad_images(data: str) -> list[str]:
    """Two images of ``data``'s train/ that do not read, made so: one whose header does not
    (left out before the first step), one cut short after its header (replaced where met)."""
    header, cut = (os.path.join(data, "train", c, "1.JPG") for c in ("ant", "Dog"))
    with open(header, "wb") as f:
        f.write(b"\xff\xd8 truncated")
    whole = open(cut, "rb").read()
    with open(cut, "wb") as f:
        f.write(whole[:len(whole) - 60])
    return [header, cut]


def _named_once_and_counted(run_dir, stderr: str, bad: list[str], resumed: bool = False):
    """Each of ``bad`` named once in skipped.txt, and on stderr by the run that met it (a
    resumed run points to the file); metrics.jsonl's ``skipped`` is 2 from where both were
    met: distinct images, not hits, a resumed run's too."""
    from twinstep.data import screen

    listed = screen.read(str(run_dir))
    assert sorted(b.name for b in listed) == sorted(bad), listed
    assert [b.action for b in listed] == [screen.LEFT_OUT, screen.REPLACED], listed
    if resumed:  # the killed run named the first; the second, if it met it before the kill
        assert "images that do not read so far: " in stderr and bad[0] not in stderr, stderr
        assert stderr.count(bad[1]) <= 1, stderr
    else:
        assert [stderr.count(path) for path in bad] == [1, 1], stderr
    counts = [json.loads(line)["skipped"] for line in
              (run_dir / "metrics.jsonl").read_text().splitlines() if '"skipped"' in line]
    assert counts[0] >= 1 and counts[-1] == 2 and max(counts) == 2, counts


def _await(proc, condition, seconds: float = 900) -> None:
    """Wait until ``condition()`` holds while ``proc`` runs (failing if it ends first)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"the run ended first (status {proc.returncode})"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _logged(run_dir) -> int:
    """The last step RUN_DIR's metrics.jsonl has a train record of (0: none yet)."""
    from twinstep.training import run_log

    if not (run_dir / run_log.METRICS).exists():
        return 0
    return max((r["step"] for r in run_log.read_metrics(str(run_dir))[0]), default=0)


def attempts(run_dir) -> list[tuple[int, list[int]]]:
    """What each attempt at RUN_DIR's run — the first and each resume — logged: (the step its
    TensorBoard event file starts at, the steps of the train records in it), in order. Each
    attempt's `RunLog` writes a file of its own, starting at the restored step + 1."""
    from test_runlog import _event_files, _events

    from twinstep.training import run_log

    run_log._import_tensorboardx()  # without torch
    from tensorboardX.proto.event_pb2 import SessionLog

    out = []
    for path in _event_files(run_dir):
        events = _events(path, torn_ok=True)  # a killed attempt's
        start = [e.step for e in events if e.HasField("session_log")
                 and e.session_log.status == SessionLog.START]
        out.append((start[0], [e.step for e in events
                               if any(v.tag == "train/loss" for v in e.summary.value)]))
    return out


def _exported_weights_evaluate_in_timm_as_in_twinstep(run_dir, data: str):
    """`twinstep weights` (both formats) writes a timm model folder that timm loads by itself
    ('local-dir:'), whose config makes timm's own eval transform over the val images give the
    run's last evaluation: the same top-1, the loss to f32 precision (1e-5 relative). Control:
    the same with timm's default resize for a net, bicubic, moves the loss past that bound.
    The state dict alone loads too (`pretrained_cfg_overlay`), its eval logits twinstep's to
    f32 precision (1e-4 relative); a K-class classifier included."""
    import timm
    import torch

    from bench.first_hour import timm_scores
    from twinstep import program
    from twinstep.checking.bounds import rel
    from twinstep.training import export

    net, state = get_net(RUN_NET), load_state(run_dir)
    classes = json.loads((run_dir / "config.json").read_text())["classes"]
    x = digits.split("val", 32)[0][:16]
    ours = program.eval_program(net)(state["params"], state["buffers"], x)

    logged = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["eval"]["raw"]
    done = subprocess.run([sys.executable, "-m", "twinstep.cli", "weights", str(run_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{run_dir / 'timm'}: step 6's raw weights"), done.stdout
    pth = export.write_from_run(str(run_dir), "pth", out=str(run_dir / "timm_pth"))
    assert pth == (str(run_dir / "timm_pth"), 6)
    modes = {os.stat(p).st_mode & 0o777 for p in (run_dir / "config.json", run_dir / "timm" /
                                                  "model.safetensors", run_dir / "timm_pth" /
                                                  "pytorch_model.pth")}
    assert len(modes) == 1, modes  # the weights as readable as the rest of RUN_DIR

    def evaluated(folder, **change):
        top1, loss, labels = timm_scores(folder, os.path.join(data, "val"), **change)
        assert labels == ["Dog", "ant", "cat", "zebra"]
        return top1, loss

    for folder in (run_dir / "timm", run_dir / "timm_pth"):
        top1, loss = evaluated(folder)
        assert top1 == logged["top1"] and rel(loss, logged["loss"]) <= 1e-5, (top1, loss, logged)
        path = next(str(folder / f) for f in export.FILES.values() if (folder / f).exists())
        model = timm.create_model(net.TIMM_NAME, num_classes=classes, pretrained=True,
                                  pretrained_cfg_overlay=dict(file=path,
                                                              num_classes=classes)).eval()
        with torch.no_grad():
            theirs = model(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()).numpy()
        assert rel(theirs, ours) <= 1e-4, (path, rel(theirs, ours))
    _, bicubic = evaluated(run_dir / "timm", interpolation="bicubic")
    assert rel(bicubic, logged["loss"]) > 1e-5, (bicubic, logged)  # control


@pytest.mark.slow
@pytest.mark.all  # make test: tests/test_hosts.py continues a 4-replica run on 2 and 1 x 8
def test_two_replicas_train_what_one_device_trains_at_the_same_global_batch(tmp_path):
    """f64, 2 steps of SGD with momentum on digits: R = 2 x N = 4 against R = 1 x N = 8. Every
    parameter (a BN bias that is a structural zero against zero, `bounds.grad_err`), every
    running variance, every running mean in units of its channel's std, and the losses within
    1e-10 — the tie's f64 floor. (Momentum traces are gradients: after two steps those of
    nearly cancelling sums move by 1e-10 under any reordering; the whole-step tie holds them to
    its noise floor.) And a run checkpointed at R = 2 resumes at R = 1 with the same R N."""
    from twinstep import api
    from twinstep.checking.bounds import grad_err, rel

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

    # a run moves between topologies: stopped after step 1 at R = 2 x N = 4, resumed at R = 1 x
    # N = 8 (the same global batch), its step 2 ends where the uninterrupted R = 2 run does
    class Stop(Exception):
        pass

    def stop_after_1(step, metrics):
        if step == 1:
            raise Stop

    moved = str(tmp_path / "moved")
    with pytest.raises(Stop):
        api.train("mnv4in_momdp4", moved, replicas=2, batch=4, progress=stop_after_1,
                  **{**common, "ckpt_every": 1})
    with pytest.raises(UsageError, match=r"R N = 2 x 4 = 8; this one is 1 x 4 = 4"):
        api.train("mnv4in_momdp4", moved, replicas=1, batch=4, **common)  # refused: R N moves
    api.train("mnv4in_momdp8", moved, replicas=1, **common)
    after = load_state(moved)
    assert int(after["step"]) == 2
    assert max(grad_err(k, after["params"], two["params"]) for k in one["params"]) <= 1e-10


class _StandIn:
    """A stand-in for the compiled programs (`program.train_program` / `eval_program` /
    `compile_step`): the real state's shape, a step that only counts — and a loss that turns NaN
    at ``nan_at`` — so the loop's own behaviour is tested without compiling a network."""

    def __init__(self, nan_at=None):
        self.nan_at = nan_at

    def train_program(self, net, recipe, setup=None, *, classes, **kw):
        from twinstep import optim, program, step

        def init(params, buffers):
            return step.init_state(recipe, params, buffers, optim.for_recipe(recipe, params))

        def one_step(state, xs, ts, key):
            done = int(state.step) + 1
            loss = float("nan") if done == self.nan_at else 1.0 / done
            return state._replace(step=state.step + 1), {"loss": loss, "lr": 0.0}

        return program.TrainProgram(None, init, one_step, None, None, lambda state: state)

    def eval_program(self, *a, **kw):
        return lambda params, buffers, x: np.zeros((len(x), 10), np.float32)

    def compile_step(self, prog, setup, **kw):
        return prog.step  # nothing to compile


def test_a_nan_stops_at_its_step_and_a_cut_off_checkpoint_write_leaves_the_last_one(
        tmp_path, monkeypatch, capsys):
    from twinstep import program
    from twinstep.training import loop

    stand_in = _StandIn(nan_at=5)
    monkeypatch.setattr(program, "train_program", stand_in.train_program)
    monkeypatch.setattr(program, "eval_program", stand_in.eval_program)
    monkeypatch.setattr(program, "compile_step", stand_in.compile_step)
    cfg = TrainConfig(RECIPE, str(tmp_path / "run"), steps=8, ckpt_every=2, eval_every=8)
    with pytest.raises(loop.NonFinite, match=r"nan at step 5; the last checkpoint \(step 4\)"):
        loop.run(cfg)
    assert int(load_state(tmp_path / "run")["step"]) == 4
    # a checkpoint write cut off part-way leaves orbax's temporary folder, never a checkpoint:
    # the previous one still loads, and --resume continues from it
    partial = tmp_path / "run" / "checkpoints" / "6.orbax-checkpoint-tmp-1"
    partial.mkdir()
    (partial / "_CHECKPOINT_METADATA").write_text("{")
    assert int(load_state(tmp_path / "run")["step"]) == 4
    monkeypatch.setattr(stand_in, "nan_at", None)
    resumed = []
    capsys.readouterr()
    loop.run(dataclasses.replace(cfg, resume=True),
             progress=lambda s, m: resumed.append((s, m.get("phase"))))
    assert capsys.readouterr().out == "twinstep train: resumed from step 4\n"
    assert resumed[0] == (5, None) and int(load_state(tmp_path / "run")["step"]) == 8
    # the evaluation at step 8 is announced as it starts (the bar's "compiling the
    # evaluation..."), then step 8 is told of with its result
    assert resumed[-3:] == [(7, None), (8, "compiling the evaluation"), (8, None)]
    # control: --resume on a RUN_DIR with no run is refused
    with pytest.raises(UsageError, match="--resume: .* holds no run"):
        loop.run(TrainConfig(RECIPE, str(tmp_path / "new"), resume=True))


def test_init_from_loads_every_tensor_and_starts_a_classifier_of_another_width_afresh(
        tmp_path, monkeypatch):
    from twinstep import program
    from twinstep.nets import NETS, layers
    from twinstep.training import state_dict

    mobilenetv4 = NETS["mnv4"]
    monkeypatch.setattr(program, "train_program", _StandIn().train_program)
    shapes = mobilenetv4.param_shapes(1000)
    rng = np.random.default_rng(0)
    saved = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in {**shapes, **layers.buffer_shapes(shapes)}.items()}
    path = str(tmp_path / "pretrained.safetensors")
    state_dict.save(path, saved)
    cfg = TrainConfig(RECIPE, str(tmp_path / "run"), init_from=path)
    prog = program.train_program(mobilenetv4, cfg.parsed_recipe(), classes=10)
    state = state_dict.initial_state(cfg, mobilenetv4, prog, 10)
    head = ("classifier.weight", "classifier.bias")
    assert all(np.array_equal(state.params[n], saved[n]) for n in shapes if n not in head)
    assert all(np.array_equal(state.buffers[n], saved[n]) for n in state.buffers)
    assert state.params["classifier.weight"].shape == (10, mobilenetv4.FEATURES)
    fresh = state_dict.initial_state(TrainConfig(RECIPE, str(tmp_path / "r")), mobilenetv4, prog,
                                     10)
    assert np.array_equal(state.params["classifier.weight"], fresh.params["classifier.weight"])
    assert not np.array_equal(state.params["conv_stem.weight"], fresh.params["conv_stem.weight"])
    del saved["conv_stem.weight"]  # not a whole MobileNetV4 state dict: refused, one line
    state_dict.save(path, saved)
    with pytest.raises(UsageError, match="--init-from .*missing.*conv_stem.weight"):
        state_dict.initial_state(cfg, mobilenetv4, prog, 10)


def test_a_render_must_match_the_run_it_trains(tmp_path):
    path = tmp_path / "r.jaxexport"
    path.write_bytes(b"")
    from twinstep import recipes
    from twinstep.rendering.manifest import KEYS

    recipe = recipes.parse(RECIPE)  # a manifest that passes the schema check
    manifest = {**dict.fromkeys(KEYS), "name": RECIPE, "recipe": recipe.name, "net": recipe.net,
                "replicas": 2, "batch": 4, "global_batch": 8, "accum": 1, "res": 32,
                "classes": 10, "precision": "f32", "platform": "cpu", "control": "none",
                "inputs": [], "outputs": []}
    (tmp_path / "r.json").write_text(json.dumps(manifest))
    TrainConfig(RECIPE, "/tmp/unused", replicas=2, render=str(path))  # matches: accepted
    for kw, field in (({"replicas": 1, "recipe": "mnv4in_adam4"}, "recipe"),
                      ({"replicas": 4}, "replicas"), ({"replicas": 2, "res": 64}, "res"),
                      ({"replicas": 2, "precision": "f64"}, "precision")):
        with pytest.raises(UsageError, match=f"rendered with {field} = "):
            TrainConfig(**{"recipe": RECIPE, "out": "/tmp/unused", "render": str(path), **kw})
    with pytest.raises(UsageError, match="drop --epochs"):
        TrainConfig(RECIPE, "/tmp/unused", replicas=2, render=str(path), mixup=0.2)
    with pytest.raises(UsageError, match="NAME.jaxexport"):
        TrainConfig(RECIPE, "/tmp/unused", replicas=2, render=str(tmp_path / "r.json"))
    # a run that an older twinstep trained with a render recorded it as "artifact": refused
    from twinstep.training.config import check_run_dir

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps({"artifact": str(path)}))
    with pytest.raises(UsageError, match="older twinstep trained with a render"):
        check_run_dir(TrainConfig(RECIPE, str(tmp_path / "old"), replicas=2, render=str(path)))


@pytest.mark.slow
def test_evaluation_sharded_over_the_replicas_is_the_single_devices():
    """The trainer's evaluation places each replica's rows on its own device (`eval_placement`):
    its logits are the single device's to f32 rounding (measured 1.5e-6 relative; XLA picks
    per-shard convolution algorithms) and row for row — a rows-to-replicas mix-up (the control:
    the shards in another order) is 100 000 times larger."""
    import jax

    from twinstep import program
    from twinstep.checking.bounds import rel
    from twinstep.nets import NETS
    from twinstep.training import evaluation

    mobilenetv4 = NETS["mnv4"]
    shapes = mobilenetv4.param_shapes(10)
    weights = (init.init_params(jax.random.key(0), shapes, (), np.float32,
                                  linear=mobilenetv4.LINEAR_INIT),
               init.init_buffers(shapes, np.float32))
    x = digits.split("val", 32)[0][:8]
    logits = program.eval_program(mobilenetv4, fast_compile="mnv4" in FAST_COMPILE_NETS)

    def on(replicas):
        on_all, by_rows = evaluation.eval_placement(replicas)
        return np.asarray(logits(*jax.device_put(weights, on_all), jax.device_put(x, by_rows)))

    one, four = on(1), on(4)
    assert rel(four, one) <= 1e-5
    assert np.array_equal(four.argmax(1), one.argmax(1))
    assert rel(np.roll(four, 2, axis=0), one) > 1e5 * rel(four, one)


@pytest.mark.slow
def test_a_stalled_run_ends_in_one_line_and_a_compile_is_not_a_stall(tmp_path):
    """The watchdog (--stall-timeout 5): a loader worker frozen (SIGSTOP) mid-run stalls the
    loop, and the run ends within the limit and a beat (< 20 s) — exit 3, one line naming the
    last step — leaving neither the worker nor shared memory behind. Before that, the same run
    is the control: its first evaluation (step 2) compiles for over 5 s — in a compilation cache
    of its own, so it compiles — and the watchdog, paused for it, lets it be (else the run
    would end before the evaluation's line and step 3's)."""
    from twinstep.data import workers

    argv = [sys.executable, "-m", "twinstep.cli", "train", RECIPE, "--data", "digits",
            "--replicas", "2", "--res", "32", "--steps", "400", "--log-every", "1",
            "--ckpt-every", "400", "--eval-every", "2", "--workers", "1",
            "--stall-timeout", "5", *(["--fast-compile"] if "mnv4" in FAST_COMPILE_NETS else [])]
    proc = subprocess.Popen([*argv, "--out", str(tmp_path / "stalled")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "c")})
    log, deadline = tmp_path / "stalled" / "metrics.jsonl", time.monotonic() + 900
    while not log.exists() or len(log.read_text().splitlines()) < 4:  # 1, 2, eval, 3
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    assert '"eval"' in log.read_text().splitlines()[2]
    worker = next(int(pid) for pid in os.listdir("/proc") if pid.isdigit() and _parent(pid)
                  == proc.pid and b"spawn_main" in _cmdline(pid))  # not its resource tracker
    os.kill(worker, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=60)
    finally:  # a frozen worker left alive would hold the stderr pipe open
        gone = _state(worker) in ("", "Z")  # ended (a zombie until reaped)
        if not gone:
            os.kill(worker, signal.SIGKILL)
    err = proc.stderr.read()
    assert gone  # the watchdog killed it
    assert proc.returncode == 3 and err.count("\n") == 1, err
    assert "no progress for" in err and "(the stall limit, 5 s: --stall-timeout)" in err, err
    assert time.monotonic() - t0 < 20
    assert not [n for n in os.listdir("/dev/shm")
                if n.startswith(f"{workers.BLOCK_PREFIX}{proc.pid}_")]


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_checkpoints_keep_the_last_k_and_every_kth_and_a_partial_one_is_not_one(tmp_path):
    """`--keep 1 --keep-every 2` over steps 1-5 leaves 2, 4 (kept for good) and 5 (the last);
    a checkpoint whose write was cut short (orbax's temporary folder) is not the latest, for
    the run nor for the supervisor's resume step. --keep-every off the --ckpt-every grid is
    refused."""
    from twinstep.processes import launcher
    from twinstep.training.checkpoint import Checkpoints

    with Checkpoints(str(tmp_path), keep=1, keep_every=2) as c:
        for s in range(1, 6):
            c.save(s, {"w": np.full(3, float(s)), "step": np.int32(s)})
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4", "5"]
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()  # a write killed midway
    with Checkpoints(str(tmp_path), keep=1) as c:
        assert c.latest() == 5
    assert launcher.resume_step(["train", "x", "--out", str(tmp_path)]) == 5
    assert int(load_state(str(tmp_path))["step"]) == 5
    with pytest.raises(UsageError, match="--keep-every must be a multiple of --ckpt-every"):
        TrainConfig(RECIPE, str(tmp_path / "x"), replicas=2, ckpt_every=4, keep_every=6)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("name", [  # ResNet-18's and -50's, MNv4-M's: the tests above, test_render
    pytest.param(n, marks=() if n == "efficientnet" else pytest.mark.all)
    for n in NETS if n not in ("resnet18", "resnet50", "mnv4")])
def test_every_net_trains_exports_its_weights_to_timm_and_renders_a_tied_step(name, tmp_path,
                                                                             release_memory):
    """Two steps of ``NAMEin_adamdp2`` on the digits (R = 2, f64, 32²); the run's weights
    (`twinstep weights`'s writer, float32) load into timm strictly and evaluate there, in f64, to
    twinstep's eval logits from the same float32 weights (parity's f64 bound); the recipe's step
    rendered for R = 2 ties over two steps. (Compared in f64, not f32: after two steps an f32
    forward's own rounding reaches 1e-3 of MobileNetV2's logits.) The training's programs are
    released before the tie: ResNet-152's held 5 GiB that its tie's memory check then counted as
    taken (the test's peak RSS, run alone: 18.6 -> 13.4 GiB)."""
    from twinstep import api, program
    from twinstep.checking import parity
    from twinstep.checking.bounds import rel

    recipe, run = f"{name}in_adamdp2", tmp_path / "run"
    api.train(recipe, str(run), data="digits", replicas=2, res=32, steps=2, eval_every=2,
              ckpt_every=2, precision="f64", fast_compile=True)
    state = load_state(str(run))
    x = np.asarray(digits.split("val", 32)[0][:8], np.float64)
    as_written = [{k: np.asarray(v, np.float32).astype(np.float64) for k, v in state[d].items()}
                  for d in ("params", "buffers")]
    ours = program.eval_program(NETS[name], program.Setup(precision="f64"))(*as_written, x)
    folder, _ = write_from_run(str(run))
    model = timm.create_model(f"local-dir:{folder}", pretrained=True)  # strict
    assert model.pretrained_cfg["architecture"] == NETS[name].TIMM_NAME
    with torch.no_grad():
        theirs = model.eval().double()(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous())
    assert rel(theirs.numpy(), ours) <= parity.LOGITS_BOUND["f64"]
    del state, as_written, model
    release_memory()
    api.render(recipe, 2, str(tmp_path / "render"), res=32, classes=10, precision="f64")
    report = api.tie_render(str(tmp_path / "render" / f"{recipe}.jaxexport"), steps=2,
                            fast_compile=True)
    assert report.ok, report.verdict()


def test_data_digits_never_silently_means_a_folder_named_digits(tmp_path, monkeypatch):
    """`--data digits` is the embedded set; where ./digits exists too it names both and is
    refused (exit 2, saying how to name either), `builtin:digits` is the set whatever ./digits is,
    and the run's first line says which data it read. Control: without ./digits, `digits` is
    the embedded set as always."""
    from twinstep.data import sources

    monkeypatch.chdir(tmp_path)
    assert TrainConfig(RECIPE, str(tmp_path / "a")).data == sources.DIGITS
    (tmp_path / "digits").mkdir()
    with pytest.raises(UsageError, match=r"names both .* --data ./digits .* builtin:digits"):
        TrainConfig(RECIPE, str(tmp_path / "b"), data="digits")
    cfg = TrainConfig(RECIPE, str(tmp_path / "c"), data="builtin:digits")
    assert cfg.data == sources.DIGITS and " on the embedded digits:" in cfg.summary()

