"""Every verdict means what it says: a control that cannot fire is refused, a tie too loose to
see a small bug says "inconclusive" (exit 4), a crash is exit 3 and not a failed check, an
interrupt is exit 130 — and bad input of every kind is one line on stderr, exit 2, before any
work and with no file left behind (the fuzz below)."""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest

import twinstep
from twinstep import api, cli
from twinstep.checking import bounds, tie, trajectory


def run_cli(argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of the CLI in this process; argparse's errors exit via SystemExit."""
    try:
        with mock.patch.dict(os.environ, child_env()):
            code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def child_env(**more) -> dict:
    """The environment for the CLI in a test: its compilation cache the run's (`make test`'s
    JAX_COMPILATION_CACHE_DIR) or one that ``more`` names, else none — never the user's
    ~/.cache/twinstep, which no test may write."""
    env = {**os.environ, **more}
    if not (env.get("JAX_COMPILATION_CACHE_DIR") or env.get("TWINSTEP_COMPILE_CACHE")):
        env["TWINSTEP_NO_COMPILE_CACHE"] = "1"
    return env


def wait_for(condition, what: str, process: subprocess.Popen, deadline_s: float = 300):
    """Poll ``condition()`` until it is true, failing after ``deadline_s`` or if ``process``
    ends first (what it said is in the failure)."""
    end = time.monotonic() + deadline_s
    while not condition():
        if process.poll() is not None:
            out, err = process.communicate()
            pytest.fail(f"the process ended (exit {process.returncode}) before {what}: "
                        f"{(out + err)[-2000:]}")
        if time.monotonic() > end:
            process.kill()
            pytest.fail(f"no {what} within {deadline_s} s")
        time.sleep(0.05)


# ----------------------------------------------------------------- checks that cannot fire


def test_a_control_that_cannot_fire_is_refused(capsys):
    with pytest.raises(twinstep.UsageError, match="cannot fire"):
        twinstep.tie("resnet50", replicas=1, control="sum")
    code, err = run_cli(["certify", "--replicas", "1"], capsys)
    assert code == 2 and "cannot fire" in err and err.count("\n") == 1


# ------------------------------------------------------------------------- the verdicts


def _report(bounds, errs) -> tie.TieReport:
    """A TieReport of parameter rows with these bounds and errors (nothing computed)."""
    rows = [{"name": f"p{i}", "shape": [1], "rel_err": e, "abs_err": e, "bound": b,
             "ok": e <= b} for i, (b, e) in enumerate(zip(bounds, errs, strict=True))]
    loss = {"replica": 1.0, "single": 1.0, "rel_err": 0.0, "bound": 1e-12, "ok": True}
    return tie.TieReport(tie.TieConfig(), rows, [], loss, 0.0, 0.0, True)


def test_a_loose_bound_makes_a_tie_inconclusive_never_a_pass():
    tight = _report([1e-10, 1e-4], [1e-12, 1e-5])
    assert tight.status == "tied" and tight.ok
    loose = _report([1e-10, 2e-2], [1e-12, 1e-5])  # p1 could hide a 1% bug
    assert loose.status == "inconclusive" and not loose.ok
    assert loose.verdict().startswith("inconclusive") and "p1" in loose.verdict()
    assert bounds.EXIT_CODES[loose.status] == 4 and loose.to_json()["status"] == "inconclusive"
    failed = _report([1e-10, 2e-2], [1e-9, 1e-5])  # a failure is a failure, however loose
    assert failed.status == "NOT tied" and bounds.EXIT_CODES[failed.status] == 1
    # the threshold is where it is claimed to be
    at = _report([bounds.INCONCLUSIVE_BOUND], [0.0])
    over = _report([bounds.INCONCLUSIVE_BOUND * 1.01], [0.0])
    assert (at.status, over.status) == ("tied", "inconclusive")


def test_whole_step_reports_are_inconclusive_alike():
    rows = [{"name": "params/w", "shape": [1], "rel_err": 0.0, "sensitivity": 0.0, "ok": True,
             "bound": 5e-3}]
    loss = {"replica": 1.0, "single": 1.0, "rel_err": 0.0, "bound": 1e-12, "ok": True}
    report = trajectory.StepsReport(tie.TieConfig(), [{"step": 1, "rows": rows, "loss": loss}])
    assert report.status == "inconclusive" and "params/w (step 1)" in report.verdict()
    rows[0]["bound"] = 1e-10
    assert report.status == "tied"


def test_a_crash_is_exit_3_in_one_line_not_a_failed_check(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("the backend fell over")

    monkeypatch.setattr(api, "tie", broken)
    code, err = run_cli(["tie", "resnet50"], capsys)
    assert code == 3 and err.count("\n") == 1
    assert "internal error: RuntimeError: the backend fell over" in err
    with pytest.raises(RuntimeError), mock.patch.dict(os.environ, child_env()):
        cli.main(["--debug", "tie", "resnet50"])  # --debug shows it as it is


# a refusal raised while a step JAX dispatched still runs (a second of matrix products): as the
# interpreter starts to shut down, the step has finished or still runs
LATE_REFUSAL = """
import atexit
import sys

import jax
import jax.numpy as jnp

from twinstep import api
from twinstep.cli.main import entry
from twinstep.errors import UsageError

dispatched = []


def step(x):
    return jax.lax.fori_loop(0, 300, lambda i, x: jnp.tanh(x @ x) * 2, x)


def tie(*args, **kwargs):
    dispatched.append(jax.jit(step)(jnp.full((384, 384), 0.01, jnp.float32)))
    raise UsageError("the render's inputs differ from this step's")


@atexit.register  # the first exit handler to run (the last registered), before JAX's
def shutting_down():
    done = all(a.is_ready() for a in dispatched)
    print(f"{len(dispatched)} step, {'finished' if done else 'still running'}", flush=True)


api.tie = tie
sys.argv = ["twinstep", "tie", "resnet50"]
entry()
"""


def test_a_refusal_while_a_step_runs_waits_for_it_and_is_exit_2():
    """Bad input seen only once a step was dispatched (issue #50: a render's signature, checked
    at its first call, after the tie had dispatched the single-device steps): the one line, then
    the process waits for the step, and only then shuts down, exit 2. Shutting down at once
    left XLA's threads running the step while exit() ran C++'s static destructors (oneDNN's),
    and the process died on its way out (exit 139)."""
    done = subprocess.run([sys.executable, "-c", LATE_REFUSAL], env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert done.stderr == "twinstep tie: the render's inputs differ from this step's\n"
    assert done.stdout == "1 step, finished\n"


@pytest.mark.slow
def test_an_interrupt_is_130_in_one_line_and_leaves_no_report(tmp_path):
    """Ctrl-C while JAX starts and while the tie compiles: exit 130, one line, no report. Each
    moment is seen, not slept to: the CLI makes its compilation cache's folder (a fresh one,
    under tmp_path) once JAX is imported, before the command runs; the first compiled program
    kept there means the tie is compiling (a shape no other test compiles, and nothing to
    load: the rest of the tie takes tens of seconds more)."""
    out = tmp_path / "out"
    out.mkdir()
    report = out / "tie.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "TWINSTEP_NO_COMPILE_CACHE"))}
    for moment in ("starting", "compiling"):
        cache = tmp_path / f"cache-{moment}"
        p = subprocess.Popen([sys.executable, "-m", "twinstep.cli", "tie", "resnet50",
                              "--replicas", "2", "--res", "64", "--classes", "7", "--json",
                              str(report)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**env, "TWINSTEP_COMPILE_CACHE": str(cache)})
        if moment == "starting":
            wait_for(cache.exists, "its compilation cache's folder", p)
        else:
            wait_for(functools.partial(kept_a_program, cache), "a compiled program in its cache",
                     p)
        assert p.poll() is None, "the tie ended before the interrupt: the test saw nothing"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert p.returncode == 130, (moment, p.returncode, err[-2000:])
        assert err == "twinstep tie: interrupted\n"
        assert not os.listdir(out)


def kept_a_program(cache) -> bool:
    """Whether JAX's compilation cache ``cache`` holds a compiled program (KEY-cache)."""
    return cache.exists() and any(n.endswith("-cache") for n in os.listdir(cache))


# ---------------------------------------------------------------------------- the fuzz


def bad_inputs(tmp):
    """(argv, what the one line must say) for each kind of bad input."""
    out = str(tmp / "out")
    a_file = tmp / "a_file"
    a_file.write_text("")
    from twinstep.rendering.manifest import KEYS

    renders = {}  # render manifests of the wrong shape, beside an (empty) render file
    for name, manifest in (("listed", []), ("typed", {**dict.fromkeys(KEYS, 1), "replicas": "2"}),
                           ("huge", {**dict.fromkeys(KEYS, 1), "replicas": 100000})):
        (tmp / f"{name}.json").write_text(json.dumps(manifest))
        (tmp / f"{name}.jaxexport").write_text("")
        renders[name] = str(tmp / f"{name}.jaxexport")
    return [
        (["tie", "resnet50", "--replicas", "100000"], "< 1025"),
        (["train", "mnv4in_adamdp", "--out", out, "--replicas", "5000"], "< 1025"),
        (["tie", "--render", renders["listed"]], "is not a render manifest"),
        (["tie", "--render", renders["typed"]], "replicas = '2'; expected an int >= 1"),
        (["tie", "--render", renders["huge"]], "replicas = 100000; expected an int >= 1 and <= "),
        (["train", "mnv4in_adamdp", "--out", out, "--render", renders["typed"]], "replicas = '2'"),
        (["nope"], "invalid choice"), (["--nope"], "unrecognized"),
        (["tie"], "the net is required"), (["tie", "vgg"], "invalid choice"),
        (["tie", "resnet50", "--res", "x"], "not an integer"),
        (["tie", "resnet50", "--res", "0"], "must be >= 1"),
        (["tie", "resnet50", "--res", "30"], "multiple of 32"),
        (["tie", "resnet50", "--res", "٣٢"], "not an integer"),
        (["tie", "resnet50", "--replicas", "-1"], "must be >= 1"),
        (["tie", "resnet50", "--batch", "0"], "must be >= 1"),
        (["tie", "resnet50", "--classes", "1"], "--classes must be >= 2"),
        (["tie", "resnet50", "--seed", "-1"], "must be >= 0"),
        (["tie", "resnet50", "--seed", str(2**40)], "< 2147483648"),
        (["tie", "resnet50", "--precision", "f16"], "invalid choice"),
        (["tie", "resnet50", "--loss", "mse"], "invalid choice"),
        (["tie", "resnet50", "--control", "nope"], "invalid choice"),
        (["tie", "resnet50", "--replicas", "1", "--control", "sum"], "cannot fire"),
        (["tie", "resnet50", "--precision", "bf16", "--replicas", "3"], "power of two"),
        (["tie", "resnet50", "--steps", "2"], "--steps needs --recipe"),
        (["tie", "resnet50", "--recipe", "mnv4in_adamdp64"], "is for mnv4"),
        (["tie", "resnet50", "--recipe", "resnet50in_lambdp2foo"], "unknown token 'foo'"),
        (["tie", "resnet50", "--recipe", "resnet50in_lambdp2", "--precision", "f32"],
         "run in f64"),
        (["tie", "resnet50", "--json", str(tmp / "no" / "r.json")], "writable folder"),
        (["tie", "resnet50", "--json", str(tmp)], "writable folder"),
        (["tie", "resnet50", "--res", "4096", "--batch", "64"], "needs at least"),
        (["tie", "--render", "x.mlir"], "NAME.jaxexport"),
        (["tie", "--render", str(tmp / "missing.jaxexport")], "cannot read"),
        (["tie", "resnet50", "--render", "x.jaxexport"], "drop net"),
        (["tie", "resnet50", "--artifact", "x.jaxexport"], "unrecognized arguments: --artifact"),
        (["render", "--out", out], "give a recipe NAME or --all"),
        (["render", "rsb-a1", "--out", str(a_file)], "a file, not a folder"),
        (["render", "nope", "--out", out], "unknown net"),
        (["render", "rsb-a1", "--res", "30", "--out", out], "multiple of 32"),
        (["render", "rsb-a1", "--replicas", "0", "--out", out], "must be >= 1"),
        (["render", "rsb-a1", "--classes", "1", "--out", out], "--classes must be >= 2"),
        (["render", "rsb-a1", "--control", "sum", "--out", out], "R = 1 has none"),
        (["render", "rsb-a1", "--replicas", "2", "--control", "unsynced", "--out", out],
         "running statistics"),
        (["recipe", "resnet50in_lambfoo"], "unknown token 'foo'"),
        (["recipe", "resnet50in_lamb٣dp"], "ASCII"),
        (["recipe", "resnet50in_lambdp" + "9" * 40], "too large"),
        (["recipe", "x" * 2000], "at most 1024"),
        (["recipe", "rsb-a1", "--replicas", "0"], "must be >= 1"),
        (["info", "vgg"], "invalid choice"),
        (["info", "resnet50", "--classes", "1"], "must be >= 2"),
        (["info", "resnet50", "--res", "0"], "must be >= 1"),
        (["certify", "--replicas", "0"], "must be >= 1"),
        (["certify", "--seed", "-3"], "must be >= 0"),
        (["parity", "resnet50", "--res", "30"], "multiple of 32"),
        (["tie", "resnet50", "--state", "trained"], "invalid choice"),
        (["train", "mnv4in_adamdp"], "--out"),
        (["train", "mnv4in_adam", "--out", out, "--replicas", "2"], "no 'dp' token"),
        (["train", "mnv4in_adamdp", "--out", str(a_file)], "a file, not a folder"),
        (["train", "mnv4in_adamdp", "--out", out, "--res", "48"], "multiple of 32"),
        (["train", "mnv4in_adamdp", "--out", out, "--data", "cifar"], "no such directory"),
        (["train", "mnv4in_adamdp", "--out", out, "--workers", "65"], "must be >= 0 and < 65"),
        (["train", "mnv4in_adamdp", "--out", out, "--mixup", "x"], "invalid float"),
        (["train", "mnv4in_adamdp", "--out", out, "--init-from", "w.pth"], "no such file"),
        (["train", "mnv4in_adamdp", "--out", out, "--artifact", "x.jaxexport"],
         "unrecognized arguments: --artifact"),  # 0.1.0's name of --render: retired
        (["plot", out], "metrics.jsonl"),
        (["train", "mnv4in_adamdp", "--out", out, "--steps", "0"], "must be >= 1"),
        (["train", "mnv4in_lambfoo", "--out", out], "unknown token 'foo'"),
        (["weights", out], "no checkpoints/"),
        (["weights", out, "--format", "onnx"], "invalid choice"),
        (["export", out], "invalid choice: 'export'"),  # 0.1.0's name of weights: retired
        (["pack", str(tmp / "nope"), "--out", out], "no such directory"),
        (["pack", str(tmp), "--out", str(a_file)], "a file, not a folder"),
        (["pack", str(tmp), "--out", out, "--quality", "0"], "must be >= 1"),
        (["pack", str(tmp), "--out", out], "no train/ folder"),
        (["train", "mnv4in_adamdp", "--out", out, "--coordinator", "h:1"], "go together"),
        (["tie", "mnv4", "--coordinator", "h", "--num-processes", "2", "--process-id", "0"],
         "HOST:PORT"),
        (["tie", "mnv4", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
         "--process-id must be in [0, 2)"),
        (["tie", "mnv4", "--num-processes", "0"], "must be >= 1"),
        (["launch", "--local", "0", "--", "tie", "mnv4"], "must be >= 1"),
        (["launch", "--local", "2", "--", "render", "x"], "launch runs one of train, tie"),
        (["launch", "--local", "2", "--", "tie", "mnv4", "--process-id", "1"], "itself"),
        (["launch", "--", "tie", "mnv4"], "--local"),
    ]


def bad_renders(tmp):
    """(argv, what the one line must say) for a render whose files are whole but whose manifest
    was edited afterwards (issue #50: its res, 32, made 64). Each runs in a process of its own,
    where a crash on the way out shows: this one once printed its line only once the
    single-device step had been dispatched, and the process then died with it (exit 139)."""
    from twinstep.rendering import render

    made = render.make(render.RenderConfig("resnet50in_lambdp2", 2, res=32, classes=10,
                                           precision="f64"))
    paths = render.write(made, str(tmp / "render"))
    with open(paths[".json"]) as f:
        manifest = json.load(f)
    with open(paths[".json"], "w") as f:
        json.dump({**manifest, "res": 64}, f)
    return [(["tie", "--render", paths[".jaxexport"], "--steps", "1"],
             "res = 64 contradicts its inputs (xs [1, 4, 32, 32, 3]")]


@pytest.mark.process
def test_every_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path, capsys):
    cases, alone = bad_inputs(tmp_path), bad_renders(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for argv, says in cases:
        code, err = run_cli(argv, capsys)
        assert code == 2, (argv, code, err)
        assert err.count("\n") == 1 and says in err, (argv, err)
        assert "Traceback" not in err
        assert sorted(os.listdir(tmp_path)) == before, argv
    for argv, says in alone:
        done = subprocess.run([sys.executable, "-m", "twinstep.cli", *argv], env=child_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 2, (argv, done.returncode, done.stderr[-2000:])
        assert done.stderr.count("\n") == 1 and says in done.stderr, (argv, done.stderr)
        assert sorted(os.listdir(tmp_path)) == before, argv
    assert len(cases) + len(alone) >= 40


def test_a_refused_publish_leaves_no_lock_and_no_temporary_file(tmp_path, monkeypatch):
    """`twinstep.processes.disk.publish` on a full disk (the temporary file cannot be made):
    the error propagates, and neither the set's lock nor a temporary file is left."""
    import errno
    import tempfile

    from twinstep.processes import disk

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    disk.publish({str(tmp_path / "a"): b"1"}, lock=str(tmp_path / ".a.lock"))
    assert sorted(os.listdir(tmp_path)) == ["a"]  # published, the lock removed
    monkeypatch.setattr(tempfile, "mkstemp", full)
    with pytest.raises(OSError, match="No space"):
        disk.publish({str(tmp_path / "b"): b"2"}, lock=str(tmp_path / ".b.lock"))
    assert sorted(os.listdir(tmp_path)) == ["a"]


@pytest.mark.process
def test_the_environment_a_user_runs_in_is_exit_3_or_plain_ascii(monkeypatch):
    """A flag XLA does not know is exit 3 in one line, before XLA aborts the command (and a
    flag it knows passes the check); a console that cannot print Unicode gets the report in
    ASCII spellings, exit 0."""
    from twinstep.errors import BackendError
    from twinstep.processes import settings

    env = {**os.environ, "XLA_FLAGS": "--this_is_garbage"}
    done = subprocess.run([sys.executable, "-m", "twinstep.cli", "tie", "mnv4"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stderr.count("\n") == 1, done.stderr
    assert "Unknown flag in XLA_FLAGS: --this_is_garbage" in done.stderr
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    settings.check_xla_flags()  # the control: a known flag passes
    monkeypatch.setenv("XLA_FLAGS", "--this_is_garbage")
    with pytest.raises(BackendError):
        settings.check_xla_flags()
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-m", "twinstep.cli", "recipe", "rsb-a1"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "beta 0.9/0.999" in done.stdout and done.stdout.isascii()


@pytest.mark.process
def test_compiled_programs_are_kept_and_loaded_not_compiled_again(tmp_path):
    """The CLI's compilation cache (`settings.use_compile_cache`): a program compiled once is
    kept, and the same program in a new process adds nothing (loaded); the control, another
    program, adds an entry. TWINSTEP_NO_COMPILE_CACHE keeps nothing; a JAX_COMPILATION_CACHE_DIR
    of the user's own is left to JAX."""
    program = ("from twinstep.processes import settings; settings.use_compile_cache(); "
               "import jax, jax.numpy as jnp; jax.jit(lambda x: jnp.sin(x) * {}).lower("
               "jnp.ones(3)).compile()")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}

    def entries(scale: int, **more) -> int:
        subprocess.run([sys.executable, "-c", program.format(scale)], check=True, timeout=120,
                       env={**env, "TWINSTEP_COMPILE_CACHE": str(cache), **more})
        return len(os.listdir(cache)) if cache.exists() else 0

    first = entries(2)
    assert first > 0 and entries(2) == first  # loaded: nothing compiled again
    assert entries(3) > first  # the control: another program is kept too
    shutil.rmtree(cache)
    assert entries(2, TWINSTEP_NO_COMPILE_CACHE="1") == 0
    assert entries(2, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "theirs"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0") == 0
    assert os.listdir(tmp_path / "theirs")


def test_the_api_checks_a_config_before_anything_compiles():
    cfg = tie.TieConfig()
    for field, value in (("replicas", 0), ("classes", 1), ("seed", -1), ("res", 33),
                         ("loss", "mse"), ("precision", "f16"), ("control", "nope")):
        with pytest.raises(twinstep.UsageError):
            dataclasses.replace(cfg, **{field: value})


@pytest.mark.parametrize("dtype,floor", [("float64", 1e-10), ("float32", 1e-4)])
def test_a_bias_gradient_below_its_dtypes_floor_is_compared_against_zero(dtype, floor):
    """`bounds.grad_err`: a BN bias gradient under FLOOR x its gamma gradient's norm (a structural
    zero, or one no relative comparison can resolve) is held to zero on the gamma's scale; just
    above it, norm-relative as every other tensor."""
    import numpy as np

    from twinstep.checking.bounds import PARAM_FLOOR, grad_err

    assert PARAM_FLOOR[dtype] == floor
    gamma = np.full(4, 1.0, dtype)  # norm 2
    for scale, expected in ((0.4 * floor, "zero"), (1.5 * floor, "relative")):
        ref = {"bn.weight": gamma, "bn.bias": np.full(4, scale, dtype)}
        ours = {"bn.weight": gamma, "bn.bias": np.full(4, -scale, dtype)}
        err = grad_err("bn.bias", ours, ref)
        assert err == pytest.approx(0.4 * floor if expected == "zero" else 2.0, rel=1e-3)


def test_a_running_mean_below_the_floor_is_compared_against_zero_on_its_spread():
    """`bounds.grad_err` on states: a running mean under FLOOR x the norm of its running
    variance's square root (the next BN's mean of a BN's output through a linear map: its
    bias's image, a structural zero) is held to zero on that scale; above it, norm-relative. Its
    control: ours far from zero on that scale is caught all the same."""
    import numpy as np

    from twinstep.checking.bounds import PARAM_FLOOR, grad_err

    floor, var = PARAM_FLOOR["float64"], np.full(4, 4.0)  # sqrt: 2 each, norm 4
    for mean, expected in ((0.4 * floor, 0.2 * floor), (3 * floor, 2.0)):
        ref = {"bn.running_mean": np.full(4, mean), "bn.running_var": var}
        ours = {"bn.running_mean": np.full(4, -mean), "bn.running_var": var}
        assert grad_err("bn.running_mean", ours, ref) == pytest.approx(expected, rel=1e-3)
    ref = {"bn.running_mean": np.full(4, 0.4 * floor), "bn.running_var": var}
    wrong = {"bn.running_mean": np.full(4, 0.1), "bn.running_var": var}  # 0.1 std off
    assert grad_err("bn.running_mean", wrong, ref) == pytest.approx(0.05, rel=1e-9)


def test_a_bn_state_that_is_exactly_zero_is_compared_absolutely_not_as_nan():
    """A state zero for the whole BN — RMSProp's momentum after its first step at lr 0, bias
    and gamma alike — has no spread to compare the bias on: `bounds.grad_err` compares it
    absolutely (0 when both are 0), never 0 / 0. Its control: a bias nonzero where the
    reference's is 0 fails by its own size."""
    import numpy as np

    from twinstep.checking.bounds import grad_err

    zero = {"bn.weight": np.zeros(4), "bn.bias": np.zeros(4)}
    assert grad_err("bn.bias", dict(zero), zero) == 0.0
    wrong = {"bn.weight": np.zeros(4), "bn.bias": np.full(4, 0.5)}
    assert grad_err("bn.bias", wrong, zero) == pytest.approx(1.0)
