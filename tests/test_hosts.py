"""Many processes (`twinstep.processes.cluster`, `twinstep launch`): real processes joined by JAX's
distributed runtime, their CPU collectives over gloo — P = 2 processes x 2 replicas each.

The claims: a run over two processes trains what one process trains with the same four replicas
(f64, the tie's floor); a process killed with SIGKILL stops the other at once with a line naming
it, and a supervised run restarts both from its last checkpoint; a checkpoint written by two
processes resumes in one process on another topology at the same global batch and continues the
same trajectory; the tie holds across processes and its control fails there."""

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import FAST_COMPILE_NETS

from twinstep import UsageError, recipes
from twinstep.nets import get_net
from twinstep.processes import cluster, launcher
from twinstep.training.checkpoint import load_state

STEPS = 3  # room for two kills, each at a checkpoint that is not the last
# the net these runs train and tie: the smallest, as what is held here is the processes', not
# the net's (the nets' own ties: tests/test_tie.py)
NET = "resnet18"
FAST = ["--fast-compile"] if NET in FAST_COMPILE_NETS else []
# 2 processes x 2 replicas x N = 2: the global batch of test_train's R = 2 x 4 and R = 1 x 8
TRAIN = ["train", f"{NET}in_momdp2", "--data", "digits", "--replicas", "4", "--steps", str(STEPS),
         "--ckpt-every", "1", "--keep", str(STEPS), "--eval-every", str(STEPS), "--log-every",
         "1", "--precision", "f64", *FAST]
WAIT_S = 900


def _launch(*argv) -> list[str]:
    return [sys.executable, "-m", "twinstep.cli", "launch", "--local", "2", "--", *argv]


def _children(pid: int) -> dict[int, int]:
    """{process id (--process-id): pid} of the launcher ``pid``'s children."""
    out = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode().split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and "--process-id" in args:
            out[int(args[args.index("--process-id") + 1])] = int(entry)
    return out


def test_the_flags_go_together_and_in_range():
    for flags, message in (((None, 2, 0), "go together"), (("node0", 2, 0), "HOST:PORT"),
                           (("node0:99999", 2, 0), "HOST:PORT"), (("h:1", 0, 0), ">= 1"),
                           (("h:1", 2, 2), r"\[0, 2\)")):
        with pytest.raises(UsageError, match=message):
            cluster.check_flags(*flags)
    cluster.check_flags("node0:12355", 2, 1)
    cluster.check_flags(None, None, None)
    with pytest.raises(UsageError, match="train, tie"):
        launcher.commands(2, ["render", "x"], 1)
    with pytest.raises(UsageError, match="--process-id itself"):
        launcher.commands(2, ["train", "x", "--process-id", "1"], 1)
    (argv, env), _ = launcher.commands(2, ["tie", "mnv4"], 4242, gpus_per_process=2)
    assert argv[-6:] == ["--coordinator", "localhost:4242", "--num-processes", "2",
                         "--process-id", "0"]
    assert env["JAX_LOCAL_DEVICE_IDS"] == "0,1"


def test_process_0_leaves_a_handover_only_once_the_others_hold_its_value(monkeypatch):
    """`cluster.from_primary` between two processes, played in turn on a key-value store: the
    other process runs where process 0 would block. Process 0 hosts the runtime's service and a
    failed run `os._exit`s right after handing its verdict over, so it must return only after
    the other's last call to the runtime has. Control: a process 0 that returned once it had
    set the value (as it once did) leaves the other's read unstarted — seen as exit 3,
    "Socket closed", on a loaded machine (test_a_render_ties_across_processes...)."""
    store, calls, got = {}, [], []
    me = {"index": 0}

    class Client:
        def key_value_set(self, key, value):
            calls.append((me["index"], "set", key))
            store[key] = value

        def blocking_key_value_get(self, key, timeout_ms):
            if key not in store:  # this process waits: the other runs meanwhile
                assert me["index"] == 0, f"process 1 would wait for {key} forever"
                me["index"] = 1
                with monkeypatch.context() as m:  # each process counts its own meetings
                    m.setattr(cluster, "_barriers", {})
                    got.append(cluster.from_primary("verdict", None))
                me["index"] = 0
            calls.append((me["index"], "get", key))
            return store[key]

    monkeypatch.setattr(cluster, "count", lambda: 2)
    monkeypatch.setattr(cluster.jax, "process_index", lambda: me["index"])
    monkeypatch.setattr(cluster.distributed.global_state, "client", Client())
    monkeypatch.setattr(cluster, "_barriers", {})
    assert cluster.from_primary("verdict", "NOT tied") == "NOT tied"
    assert got == ["NOT tied"]  # the control's process 0 returns with this still empty
    assert calls[-1][0] == 0 and [c for c in calls if c[0] == 1] == [
        (1, "get", "twinstep/verdict/1"), (1, "set", "twinstep/verdict/1/read/1")], calls


def test_a_process_other_than_0_loads_the_step_it_compiled_from_the_cache(tmp_path, monkeypatch):
    """`settings.compiled` in a process other than 0 (whose programs JAX's cache never holds):
    the first call compiles and writes an entry as JAX names its own (KEY-cache, KEY-atime);
    the second loads it, with no compile, and computes what the compiled program does; an entry
    cut short is compiled again. (Control: the compiles are counted, so a load that compiled
    would be seen; in process 0 nothing of ours is written.)"""
    import jax

    from twinstep.processes import settings

    one = jax.devices()[:1]
    lowered = jax.jit(lambda x, y: {"s": x @ y + 1}).lower(np.ones((3, 3)), np.ones(3))
    compiles = []
    real = type(lowered).compile
    monkeypatch.setattr(type(lowered), "compile", lambda self: compiles.append(1) or real(self))
    settings.compiled(lowered, one, str(tmp_path))
    assert len(compiles) == 1 and not list(tmp_path.iterdir())  # process 0: JAX's own cache
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    first = settings.compiled(lowered, one, str(tmp_path))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0].startswith("twinstep-process-"), names
    assert [n.rsplit("-", 1)[1] for n in names] == ["atime", "cache"], names
    again = settings.compiled(lowered, one, str(tmp_path))
    assert len(compiles) == 2  # loaded, not compiled
    x, y = np.arange(9.0).reshape(3, 3), np.arange(3.0)
    assert np.array_equal(again(x, y)["s"], first(x, y)["s"])
    entry = tmp_path / names[1]
    entry.write_bytes(entry.read_bytes()[:100])
    cut = settings.compiled(lowered, one, str(tmp_path))
    assert np.array_equal(cut(x, y)["s"], first(x, y)["s"])
    assert len(compiles) == 3


COMMON = {"steps": STEPS, "eval_every": STEPS, "ckpt_every": 1, "keep": STEPS, "log_every": 1,
          "precision": "f64", "fast_compile": bool(FAST)}


def _killed_after_step_1(run, *argv) -> tuple[float, int, str]:
    """A run of 2 processes x 2 replicas (TRAIN, then ``argv``) into ``run``, its process 1
    killed with SIGKILL once the step-1 checkpoint is whole: (seconds from the kill to the
    launcher's end, its status, its stderr)."""
    proc = subprocess.Popen(_launch(*TRAIN, *argv, "--out", str(run)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + WAIT_S
    while not (run / "checkpoints" / "1").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    os.kill(_children(proc.pid)[1], signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=60)
    return time.monotonic() - t0, proc.returncode, err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A run of 2 processes x 2 replicas (TRAIN), every step's checkpoint kept: the two-process
    trajectory the tests below hold one process's and a supervised run's to."""
    run = tmp_path_factory.mktemp("hosts") / "uninterrupted"
    done = subprocess.run(_launch(*TRAIN, "--out", str(run)), capture_output=True, text=True,
                          timeout=WAIT_S)
    assert done.returncode == 0, done.stderr
    return run


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run of 2 processes x 2 replicas, killed with SIGKILL after its step-1 checkpoint, and
    what the launcher said: (RUN_DIR, seconds from the kill to the launcher's end, status,
    stderr)."""
    run = tmp_path_factory.mktemp("hosts") / "two"
    return run, *_killed_after_step_1(run)


def _copy(killed, tmp_path) -> str:
    """A copy of the killed run to resume (each test its own: the fixture's stays as killed)."""
    shutil.copytree(killed[0], tmp_path / "resumed")
    return str(tmp_path / "resumed")


def _at_step_1(run, dest) -> str:
    """A copy of ``run`` as a kill just after its step-1 checkpoint would leave it: the later
    checkpoints gone (the log's later lines the resume drops)."""
    shutil.copytree(run, dest)
    for name in os.listdir(dest / "checkpoints"):
        if name.isdigit() and int(name) > 1:
            shutil.rmtree(dest / "checkpoints" / name)
    return str(dest)


def _resumed(moved: str, capsys, recipe: str, replicas: int) -> dict:
    """The step-1 checkpoint in ``moved`` resumed in this one process as ``replicas`` x its N —
    shown to restore step 1 (the loop's line) and to run steps 2.. alone (its event file)."""
    from test_train import attempts

    from twinstep import api

    capsys.readouterr()
    api.train(recipe, moved, replicas=replicas, resume=True, **COMMON)
    assert "twinstep train: resumed from step 1\n" in capsys.readouterr().out
    assert attempts(moved)[-1] == (2, list(range(2, STEPS + 1))), attempts(moved)
    return load_state(moved)


def _max_err(a: dict, b: dict) -> float:
    from twinstep.checking.bounds import grad_err

    errors = [grad_err(k, a["params"], b["params"]) for k in b["params"]]
    assert len(errors) == len(get_net(NET).param_shapes())
    return max(errors)


@pytest.mark.slow
@pytest.mark.xdist_group("hosts")
def test_two_processes_train_what_one_does_stop_together_and_resume_in_one(uninterrupted,
                                                                          tmp_path, capsys):
    """2 processes x 2 replicas: their step 1 is one process's with the same 4 replicas (f64,
    every parameter within the tie's floor 1e-10), and their step-1 checkpoint, resumed in one
    process as 2 replicas x 2N, ends the run where that process does; resumed at another global
    batch, it is refused. (Controls: a wrong distributed program — the two processes training
    with the shard-gamma bug — ends step 1 far outside the bound; the last step is > 1e-6 away
    from step 1 — the bound sees a step.) That run, killed with SIGKILL after its first
    checkpoint, shows the launcher stopping the other process at once, naming the dead one."""
    from twinstep import api

    api.train(f"{NET}in_momdp2", str(tmp_path / "one"), replicas=4, **COMMON)
    one = {s: load_state(tmp_path / "one", s) for s in (1, STEPS)}
    two = load_state(uninterrupted, 1)
    assert _max_err(two, one[1]) <= 1e-10
    bitwise = all(np.array_equal(two["params"][k], one[1]["params"][k]) for k in two["params"])
    with pytest.raises(UsageError, match=r"R N = 4 x 2 = 8; this one is 2 x 2 = 4"):
        api.train(f"{NET}in_momdp2", _at_step_1(uninterrupted, tmp_path / "refused"), replicas=2,
                  resume=True, **COMMON)  # another global batch: refused before any work
    moved = _resumed(_at_step_1(uninterrupted, tmp_path / "moved"), capsys, f"{NET}in_momdp4", 2)
    assert int(moved["step"]) == STEPS
    assert _max_err(moved, one[STEPS]) <= 1e-10
    assert _max_err(one[1], one[STEPS]) > 1e-6
    # the control: the same two processes with BN's gamma gradient from each replica's own
    # statistics (a classic sync-BN bug) are not one process's step 1; killed after it, as any
    # run (the launcher does not read the program)
    broken = tmp_path / "shard-gamma"
    seconds, status, err = _killed_after_step_1(broken, "--control", "shard-gamma")
    assert seconds < 60 and status == 3, (seconds, status, err)
    assert "process 1 was killed by SIGKILL; stopping the others" in err, err
    assert re.search(r"(stopped process 0|process 0 exited with status 3 too) \(process 1 had "
                     r"failed\)", err), err
    assert not (broken / "checkpoints" / str(STEPS)).exists()  # killed before the end
    wrong = _max_err(load_state(broken, 1), one[1])
    print(f"two processes vs one, 4 replicas, f64, step 1: bitwise {bitwise}; under "
          f"shard-gamma {wrong:.1e} away")
    assert wrong > 1e-6, wrong


@pytest.mark.slow
@pytest.mark.all
@pytest.mark.xdist_group("hosts")
def test_the_killed_run_resumes_over_two_processes_and_in_one_on_one_replica(killed, tmp_path,
                                                                            capsys):
    """The killed run resumed as it was (the launcher, --resume) and in one process on ONE
    replica of 4N: both end step 2 where the two-process run would (each other's, 1e-10)."""
    from twinstep import api
    from twinstep.training import compare

    again = _copy(killed, tmp_path / "two")
    resumed = subprocess.run(_launch(*TRAIN, "--out", again, "--resume"), text=True,
                             capture_output=True, timeout=WAIT_S)
    assert resumed.returncode == 0, resumed.stderr
    assert "[0] val (raw): top-1" in resumed.stdout and "[1] val" not in resumed.stdout
    for i in (0, 1):  # each process restored step 1
        assert f"[{i}] twinstep train: resumed from step 1\n" in resumed.stdout, resumed.stdout
    two = load_state(again)
    assert int(two["step"]) == STEPS
    one = _copy(killed, tmp_path / "one")
    capsys.readouterr()
    api.train(f"{NET}in_momdp8", one, replicas=1, resume=True, **COMMON)
    assert "twinstep train: resumed from step 1\n" in capsys.readouterr().out
    assert _max_err(load_state(one), two) <= 1e-10
    pair = compare.compare([again, one])["pairs"][0]  # the processes' hits totalled
    assert pair["only_first"] == pair["only_run"] == 0


@pytest.mark.slow
@pytest.mark.all
def test_the_tie_holds_across_processes_and_its_control_fails_there(tmp_path):
    """R = 4 over 2 processes against the single device at R N (f64): every parameter within
    its bound; the wrong-divisor control run the same way is NOT tied."""
    tie = ["tie", NET, "--replicas", "4", "--batch", "1", *FAST]
    done = subprocess.run(_launch(*tie), capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    n = len(get_net(NET).param_shapes())
    assert f"[0] tied: {n}/{n} parameters" in done.stdout and "[1] tied" not in done.stdout
    broken = subprocess.run(_launch(*tie, "--control", "sum"), capture_output=True, text=True,
                            timeout=WAIT_S)
    assert broken.returncode == 1 and "NOT tied" in broken.stdout, broken.stderr
    assert "exited with status 1; stopping the others" in broken.stderr


def _rendered(out, name: str, control: str = "none") -> str:
    """``name``'s step rendered in f64 for R = 4 at 32², K = 10 into ``out``: its NAME.jaxexport."""
    from twinstep import api

    api.render(name, 4, str(out), res=32, classes=10, precision="f64", control=control)
    return str(out / f"{name}.jaxexport")


@pytest.mark.slow
def test_a_render_ties_across_processes_and_a_broken_one_fails_there(tmp_path):
    """`tie --render` under the launcher: the render's R = 4 over 2 processes x 2 devices
    against the single device (f64, every state tensor after each of two steps); the
    wrong-divisor render, tied the same way, is NOT tied — the control of the one-process
    `tie --render` too (tests/test_render.py) — and both processes exit 1, the one that
    compares nothing with the other's verdict. (The render's placement and the whole-step
    tie's across processes, which `tie --recipe` and `train --render` share.)"""
    name, fast = f"{NET}in_adamdp1", FAST
    good = _rendered(tmp_path / "good", name)
    done = subprocess.run(_launch("tie", "--render", good, "--steps", "2", *fast),
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "[0] tied over 2 steps: 229/229 state tensors" in done.stdout
    # the broken render's processes started as the launcher starts them, each one's own exit
    # status read: process 1, which runs no single device and compares nothing, exits 1 too
    # (process 0's verdict, handed over), where the launcher would only show the first failure
    bad = _rendered(tmp_path / "bad", name, "wrong-divisor")
    outs = [tmp_path / f"broken-{i}.out" for i in (0, 1)]
    procs = []
    for (argv, env), out in zip(launcher.commands(2, ["tie", "--render", bad, "--steps", "1",
                                                      *fast], launcher.free_port()), outs,
                                strict=True):
        with open(out, "w") as f:
            procs.append(subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT))
    statuses = [p.wait(timeout=WAIT_S) for p in procs]
    said = [out.read_text() for out in outs]
    assert statuses == [1, 1], (statuses, said[0][-2000:], said[1][-2000:])
    assert "NOT tied" in said[0] and "NOT tied" not in said[1], said


@pytest.mark.slow
@pytest.mark.all
@pytest.mark.parametrize("recipe,tensors", [("resnet18in_emaadamdp2wxdropdo", 331),
                                            ("mnv4in_emaadamdp2wxdropdo", 1243),
                                            ("efficientnetin_emarmsdp2wxdropdo", 1050)])
def test_a_recipe_ties_across_processes_and_its_control_fails_there(recipe, tensors):
    """`tie --recipe` under the launcher (R = 4 over 2 processes, f64, two steps with EMA,
    drop-path and dropout: one recipe per family, AdamW on ResNet-18 and MobileNetV4, RMSProp on
    EfficientNet-B0): every state tensor within its bound; with the masks replicated — each
    replica drawing the whole batch's masks — NOT tied."""
    net = recipes.parse(recipe).net
    tie = ["tie", "--recipe", recipe, "--replicas", "4", "--batch", "1",
           "--steps", "2", *(["--fast-compile"] if net in FAST_COMPILE_NETS else [])]
    done = subprocess.run(_launch(*tie), capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert f"[0] tied over 2 steps: {tensors}/{tensors} state tensors" in done.stdout
    broken = subprocess.run(_launch(*tie, "--control", "replicated-masks"), capture_output=True,
                            text=True, timeout=WAIT_S)
    assert broken.returncode == 1 and "[0] NOT tied" in broken.stdout, broken.stderr


@pytest.mark.slow
@pytest.mark.all
def test_training_with_a_render_over_two_processes_trains_what_one_does(tmp_path):
    """`train --render` (momentum SGD, R = 4, f64, two steps): over 2 processes x 2 devices
    it ends where one process with 4 devices does, to 1e-10 as the Python step's runs above;
    the wrong-divisor render trained over the 2 processes ends far from it (the run runs the
    render it is given)."""
    from twinstep import api

    name, argv = f"{NET}in_momdp2", TRAIN[2:]
    good, bad = _rendered(tmp_path / "good", name), _rendered(tmp_path / "bad", name,
                                                              "wrong-divisor")
    ends = {}
    for which, render in (("good", good), ("bad", bad)):
        run = tmp_path / f"two-{which}"
        done = subprocess.run(_launch("train", name, *argv, "--render", render, "--out",
                                      str(run)), capture_output=True, text=True, timeout=WAIT_S)
        assert done.returncode == 0, done.stderr
        ends[which] = load_state(run)
    api.train(name, str(tmp_path / "one"), data="digits", replicas=4, render=good, **COMMON)
    one = load_state(tmp_path / "one")
    assert _max_err(ends["good"], one) <= 1e-10
    assert _max_err(ends["bad"], one) > 1e-3


@pytest.mark.slow
@pytest.mark.xdist_group("hosts")
def test_a_supervised_run_killed_twice_ends_where_the_uninterrupted_one_does(uninterrupted,
                                                                           tmp_path):
    """`launch --max-restarts 2`: process 1 killed with SIGKILL twice, each time as a new
    checkpoint (not the last) is whole; the launcher restarts both processes each time (a line
    naming the process and the step resumed, a line of restarts.jsonl), each restarted process
    restores that step (its own line) and the attempt runs only the steps after it (its event
    file), and the run ends bitwise where the same launch without kills ends (f64, the same
    topology)."""
    import json

    from test_train import attempts

    steps = STEPS
    run, out = tmp_path / "supervised", tmp_path / "supervised.out"
    launch = _launch(*TRAIN, "--out", str(run))
    with open(out, "w") as stdout:  # the processes' lines, [i]-prefixed
        proc = subprocess.Popen([*launch[:6], "--max-restarts", "2", *launch[6:]],
                                stdout=stdout, stderr=subprocess.PIPE, text=True)
    deadline, after = time.monotonic() + WAIT_S, 0
    for kill in range(2):
        while True:  # a checkpoint past the last resume, written by these processes
            saved = [int(n) for n in os.listdir(run / "checkpoints") if n.isdigit()] if (
                run / "checkpoints").is_dir() else []
            children = _children(proc.pid)
            if max(saved, default=0) > after and 1 in children and max(saved) < steps:
                break
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        os.kill(children[1], signal.SIGKILL)
        while not (run / "restarts.jsonl").exists() or len(
                (run / "restarts.jsonl").read_text().splitlines()) <= kill:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        after = json.loads((run / "restarts.jsonl").read_text().splitlines()[-1])["resumed_step"]
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    restarts = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["process"], r["signal"]) for r in restarts] == [
        (1, 1, "SIGKILL"), (2, 1, "SIGKILL")]
    for r in restarts:
        assert f"restart {r['restart']} of 2: process 1 was killed by SIGKILL; resuming from " \
               f"step {r['resumed_step']}" in err, err
    # what each restarted process restored, and what each attempt ran: the launcher's step
    # above is its reading of the checkpoint folder
    resumed = [r["resumed_step"] for r in restarts]
    assert all(0 < k < steps for k in resumed), resumed
    lines = re.findall(r"^\[(\d)\] twinstep train: resumed from step (\d+)", out.read_text(),
                       re.M)
    assert [int(k) for i, k in lines if i == "0"] == resumed, lines
    assert [int(k) for i, k in lines if i == "1"] == resumed, lines
    logged = attempts(run)
    assert [start for start, _ in logged] == [1] + [k + 1 for k in resumed], logged
    assert all(ran[:1] == [start] for start, ran in logged), logged
    assert logged[-1][1] == list(range(resumed[-1] + 1, steps + 1)), logged
    a, b = load_state(uninterrupted), load_state(run)
    import jax

    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert int(b["step"]) == steps
    assert len(leaves_a) == len(leaves_b) > 2 * len(get_net(NET).param_shapes())  # all of it
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


@pytest.mark.slow
@pytest.mark.xdist_group("hosts")
def test_a_frozen_process_is_named_by_the_watchdog_of_the_other(tmp_path):
    """Process 1 frozen whole (SIGSTOP) mid-run: process 0 waits in the step's collective, its
    watchdog (--stall-timeout 5) ends it in one line naming process 1 — behind it, or no
    longer beating — exit 3, and the launcher kills the frozen one (which would act on SIGTERM
    only once continued) and exits 3 too."""
    argv = [*TRAIN[:TRAIN.index("--steps")], "--steps", "400", "--ckpt-every", "400",
            "--eval-every", "400", "--log-every", "1", "--stall-timeout", "5",
            *TRAIN[TRAIN.index("--precision"):]]
    run = tmp_path / "frozen"
    proc = subprocess.Popen(_launch(*argv, "--out", str(run)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # the processes' lines: stdout
    log, deadline = run / "metrics.jsonl", time.monotonic() + WAIT_S
    while not log.exists() or len(log.read_text().splitlines()) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    frozen = _children(proc.pid)[1]
    os.kill(frozen, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
    stall = [line for line in out.splitlines() if "no progress for" in line]
    assert proc.returncode == 3 and len(stall) == 1, out[-2000:] + err
    assert stall[0].startswith("[0] ") and re.search(
        r"after step \d+ \(the stall limit, 5 s: --stall-timeout\); process 1 "
        r"(reported step \d+ last|stopped reporting)$", stall[0]), err
    assert "process 0 exited with status 3; stopping the others" in err, err
    assert time.monotonic() - t0 < 20  # the limit, a beat, and the frozen one killed at once


@pytest.mark.process
def test_the_supervisor_restarts_up_to_its_limit_then_exits_with_the_failure(monkeypatch, capfd):
    """A command that fails every time (exit 3: an XLA flag XLA refuses) is started 1 + N times
    and the launcher exits 3; bad usage (exit 2) is never restarted."""
    monkeypatch.setenv("XLA_FLAGS", "--this_is_garbage")
    assert launcher.run(1, ["tie", "mnv4"], max_restarts=2) == 3
    err = capfd.readouterr().err
    assert err.count("restart ") == 2 and "restart 2 of 2: process 0 exited with status 3" in err
    monkeypatch.delenv("XLA_FLAGS")
    assert launcher.run(1, ["tie", "mnv4", "--classes", "1"], max_restarts=2) == 2
    assert "restart" not in capfd.readouterr().err
