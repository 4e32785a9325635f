"""`bash bench/gpu.sh lease` (bench/gpu/lease.py), as its CPU twin: every part run whole here at
tiny shapes, a deadline that cuts one, a part that fails, the adoption rule, and the XLA options
the lent GPUs' XLA (`.venv-gpu`) takes, so that a broken part is found here, not on a lent GPU.
All of it runs in `make test-all` only (about 3 minutes on 2 cores).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.gpu import kernel_profile, lease, lease_table

ROOT = Path(__file__).resolve().parent.parent
GPU_PYTHON = ROOT / ".venv-gpu" / "bin" / "python"
pytestmark = pytest.mark.all


def _lease(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """bench/gpu/lease.py --twin with ``extra``, its files under ``out``."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "lease.py"), "--twin",
                           "--out", str(out), *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


def _table_last(stdout: str, summary: dict) -> list[str]:
    """The summary table, which must be the last thing printed: its lines (the header line
    before it checked too)."""
    lines = stdout.rstrip("\n").splitlines()
    table = lines[-(len(summary["table"]) + 2):]
    assert table[0] == "| part | measures | result | verdict | wall s | status |", lines[-30:]
    assert all(line.startswith("|") for line in table), lines[-30:]
    assert lines[-len(table) - 2].startswith("lease (CPU twin) on "), lines[-30:]
    return table


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """`LEASE_TWIN=1 bash bench/gpu.sh lease` once: (its --out, the finished process)."""
    out = tmp_path_factory.mktemp("lease")
    env = {**os.environ, "LEASE_TWIN": "1", "PY": sys.executable, "OUT": str(out),
           "LEASE_DEADLINE": "600"}
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "lease"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    return out, done


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.nvimgcodec
@pytest.mark.xdist_group("lease")
def test_the_lease_runs_whole_as_its_cpu_twin(whole):
    """`LEASE_TWIN=1 bash bench/gpu.sh lease` (~2 min): every part runs (feed, train, ab, nets)
    and writes its JSON, holding what each measures: the batch decode equal to one at a time
    on the CPU, the device and Pillow paths against the bare step, every candidate timed
    against the default with its verdict by the rule, the twin's net's step; the summary and
    its table, with a row per candidate and per net, printed last; exit 0."""
    out, done = whole
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = json.loads((out / "lease_summary.json").read_text())
    assert [(p["part"], p["status"]) for p in summary["parts"]] == [
        (name, "ran") for name in ("feed", "train", "ab", "nets")]
    assert all(Path(f).exists() for f in summary["files"].values()), summary["files"]
    feed = json.loads((out / "lease_feed.json").read_text())
    assert feed["batch_vs_libjpeg"] == {"max": 0, "mean": 0.0}
    assert feed["host"] > 0 and feed["devices"] > 0 and feed["decode_cpu_core"] > 0
    train = json.loads((out / "lease_train.json").read_text())
    assert [r["path"] for r in train["runs"]] == ["device", "pillow"]
    assert all(r["train_vs_bare"] > 0 and r["data_vs_bare"] > 0 for r in train["runs"])
    ab = json.loads((out / "profile_resnet18_32.json").read_text())["ab"]
    assert list(ab) == list(lease.CANDIDATES)
    assert all(len(r["paired"]) == 3 and r["speedup"] > 0 for r in ab.values()), ab
    assert ab[kernel_profile.XLA_CANDIDATES[0]]["options"][
        "xla_gpu_enable_command_buffer"].endswith(",CONVOLUTION")
    nets = json.loads((out / "lease_nets.json").read_text())["rows"]
    assert [r["net"] for r in nets] == ["resnet18"] and nets[0]["img_per_s"] > 0
    assert set(summary["candidates"]) == set(lease.CANDIDATES)
    assert all(c["verdict"].split(":")[0] in ("adopt", "remove", "inconclusive")
               for c in summary["candidates"].values())
    table = _table_last(done.stdout, summary)
    for row in (*[f"| ab: {c} |" for c in lease.CANDIDATES], "| nets: resnet18 |", "| feed |"):
        assert any(line.startswith(row) for line in table), row
    assert (out / "lease_log.txt").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.nvimgcodec
@pytest.mark.xdist_group("lease")
def test_a_deadline_cuts_a_part_and_keeps_what_finished(whole, tmp_path):
    """A deadline that leaves the first part (feed) twice its time in the whole run and the
    second (train, ~40 s) about half its own: feed runs, train is cut by the deadline, ab is
    skipped with no time; feed's JSON stays, the table (printed last) says so; exit 4."""
    walls = {p["part"]: p["wall_s"] for p in json.loads(
        (whole[0] / "lease_summary.json").read_text())["parts"]}
    deadline = int(2 * walls["feed"]) + 12
    done = _lease(tmp_path, "--parts", "feed", "train", "ab", "--deadline", str(deadline))
    assert done.returncode == 4, done.stdout[-3000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "lease_summary.json").read_text())
    assert [(p["part"], p["status"]) for p in summary["parts"]] == [
        ("feed", "ran"), ("train", "cut: the deadline"), ("ab", "skipped: no time")], deadline
    assert json.loads((tmp_path / "lease_feed.json").read_text())["devices"] > 0
    table = _table_last(done.stdout, summary)
    assert any("| cut: the deadline |" in line for line in table)
    assert any("| skipped: no time |" in line for line in table)


@pytest.mark.process
def test_a_part_that_fails_fails_the_lease(tmp_path, monkeypatch, capsys):
    """The control: a part whose command fails (here given an option its script refuses) is
    "failed: exit 2" in the table and the lease exits 3. Without nvImageCodec the feed is
    "skipped: nvImageCodec does not import" (exit 4) and train runs Pillow's path alone. Bad
    usage exits 2; so does a lease without a GPU and without --twin, in one line, with no
    traceback."""
    done = _lease(tmp_path, "--parts", "nets", "--fail", "nets")
    assert done.returncode == 3, done.stdout[-3000:]
    summary = json.loads((tmp_path / "lease_summary.json").read_text())
    assert [(p["part"], p["status"]) for p in summary["parts"]] == [("nets", "failed: exit 2")]
    assert any("| failed: exit 2 |" in line for line in _table_last(done.stdout, summary))
    assert lease.main(["--parts", "nosuch"]) == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err
    # without nvImageCodec: the feed is skipped, and said so; train runs Pillow's path alone
    monkeypatch.setattr(lease, "has_nvimgcodec", lambda: False)
    assert lease.main(["--twin", "--out", str(tmp_path / "no"), "--parts", "feed"]) == 4
    out = capsys.readouterr().out
    assert out.rstrip().endswith("| skipped: nvImageCodec does not import |"), out
    args = lease.argparse.Namespace(twin=True, out=tmp_path, nets=None, fail=[])
    train = lease.command("train", args, "jpegs", 100, False)
    assert train[train.index("--paths") + 1:train.index("--json")] == ["pillow"]
    monkeypatch.setattr(lease.shutil, "which", lambda name: None)  # no nvidia-smi
    assert lease.main(["--out", str(tmp_path / "gpu")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lease.py: no NVIDIA GPU") and err.count("\n") == 1, err
    assert not (tmp_path / "gpu").exists()


def test_the_gpus_command_lines_parse(monkeypatch, tmp_path):
    """Each part's command on a GPU (its sizes, which the twin does not run) is taken by its
    script's parser, which then stops before running anything. Control: the twin's --fail
    option is refused."""
    import argparse
    import importlib

    class Parsed(Exception):
        pass

    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)

    def parsed(argv: list[str]):
        script = importlib.import_module(f"bench.gpu.{Path(argv[1]).stem}")
        monkeypatch.setattr(sys, "argv", argv[1:])
        try:
            script.main(argv[2:]) if "argv" in script.main.__code__.co_varnames else script.main()
        except Parsed as e:
            return e.args[0]
        raise AssertionError(f"{argv[1]} did not parse its arguments")

    for fail in ([], ["nets"]):
        args = argparse.Namespace(twin=False, out=tmp_path, nets=None, fail=fail)
        for part in lease.PARTS:
            argv = lease.command(part.name, args, str(tmp_path / "jpegs"), 100, True)
            if part.name in fail:
                with pytest.raises(SystemExit):
                    parsed(argv)
                continue
            got = parsed(argv)
            if part.name == "ab":
                assert got.candidates == list(lease.CANDIDATES) and got.batch == 512
            if part.name == "nets":
                assert got.nets == list(lease.NETS_ORDER) and got.batch == 256


class Clock:
    """A clock that moves only when a fake part runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_deadline_decides_what_runs_is_cut_or_skipped():
    """`lease.schedule` with fake parts on a fake clock, the GPU's limits: a part that finishes
    runs; one that overruns its own limit is "cut: its limit"; one given less than its limit by
    the deadline and overrunning it is "cut: the deadline"; one left less than its `least` is
    "skipped: no time"; a failing one "failed: exit 3"; a stop (SIGTERM) stops the running part
    and skips the rest."""

    def scenario(takes: dict, deadline: int, skip=None) -> list:
        clock = Clock()

        def run(part, limit):
            t = takes[part.name]
            if t == "stop":
                raise lease.Stopped("SIGTERM")
            if isinstance(t, tuple):  # (seconds, exit status)
                clock.now += t[0]
                return t[1]
            clock.now += min(t, limit)
            return 0 if t <= limit else None

        return [(r["part"], r["status"]) for r in
                lease.schedule(lease.PARTS, deadline, False, run, clock, skip=skip)]

    assert scenario({"feed": 100, "train": 150, "ab": 170, "nets": 10}, 400) == [
        ("feed", "ran"), ("train", "ran"), ("ab", "cut: the deadline"),
        ("nets", "skipped: no time")]
    assert scenario({"feed": 50, "train": 250, "ab": (5, 3), "nets": 10}, 540,
                    skip={"feed": "nvImageCodec does not import"}) == [
        ("feed", "skipped: nvImageCodec does not import"), ("train", "cut: its limit, 200 s"),
        ("ab", "failed: exit 3"), ("nets", "ran")]
    assert scenario({"feed": 10, "train": "stop", "ab": 1, "nets": 1}, 540) == [
        ("feed", "ran"), ("train", "stopped"), ("ab", "skipped: stopped"),
        ("nets", "skipped: stopped")]


def test_the_adoption_rule():
    """A candidate whose paired speedups' median is >= 1.01 with the lower quartile above 1
    is adopted when its tie holds, inconclusive when its tie has not run or fails; one whose
    median and upper quartile are below 1 is removed; the rest (under 1 %, rounds that
    disagree) are inconclusive."""
    verdict = lease_table.verdict
    assert verdict((1.02, 1.004, 1.03), True) == "adopt"
    assert verdict((1.02, 1.004, 1.03), None) == "inconclusive: it wins; its tie has not run"
    assert verdict((1.02, 1.004, 1.03), False) == "inconclusive: it wins; its tie fails"
    assert verdict((0.995, 0.99, 0.998), True) == "remove"
    assert verdict((1.009, 1.001, 1.02), True) == "inconclusive: under 1 %"
    assert verdict((1.05, 0.98, 1.10), True) == "inconclusive: the rounds disagree"
    assert verdict((0.98, 0.97, 1.01), True) == "inconclusive: the rounds disagree"


def test_a_levers_tie_is_read_from_its_sweep(tmp_path):
    """A lever's tie is its bf16 sweep's section of bench/RESULTS.md: bf16 storage's, the bit
    masks' and both together's hold there; without its section a candidate's tie has not run;
    a section whose ties do not all hold (or whose controls do not all fail) fails; an XLA
    option's is `XLA_TIES`'s."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    for candidate in ("store=bf16", "relu_mask=bits", "store=bf16, relu_mask=bits"):
        assert lease_table.tie(candidate, results)[1] is True, candidate
    said, holds = lease_table.tie("store=bf16, relu_mask=bits", "")
    assert holds is None and said.endswith("--store bf16 --relu-mask bits`: not run")
    for summary in ("7 of 8 ties run hold; 4 of 4 controls fail.",
                    "8 of 8 ties run hold; 3 of 4 controls fail.",
                    "8 of 8 ties run hold (2 not run); 4 of 4 controls fail."):
        text = f"## bf16 tie sweep, a GPU's levers, stored in bf16\n\n{summary}\n"
        assert lease_table.tie("store=bf16", text)[1] is False, summary
    for flag in kernel_profile.XLA_CANDIDATES:
        assert lease_table.tie(flag, "") == lease_table.XLA_TIES[flag]


def test_a_check_that_fails_sets_exit_1(tmp_path):
    """The twin's feed check: its batch decode must equal the one-at-a-time decode on the CPU;
    a feed JSON where they differ reads "CHECK FAILED" in the table and exits 1 (a part that
    ran but wrote no JSON: "failed", exit 3)."""
    feed = {"device": "cpu", "decode_cpu_core": 700.0, "decode_batch_cpu_core": 800.0,
            "batch_vs_libjpeg": {"max": 2, "mean": 0.01}, "workers": 1, "host": 500.0,
            "devices": 900.0}
    (tmp_path / "feed.json").write_text(json.dumps(feed))
    parts = [{"part": "feed", "status": "ran", "rc": 0, "wall_s": 1.0, "limit_s": 60}]
    files = {"feed": tmp_path / "feed.json"}

    def summary(parts):
        return lease_table.summarise(parts, files, twin=True, deadline=60, device_path=True,
                                     candidates=lease.CANDIDATES, nets=["resnet18"])

    got = summary(parts)
    assert got["exit"] == 1 and "CHECK FAILED" in got["table"][0][3], got["table"]
    feed["batch_vs_libjpeg"]["max"] = 0
    (tmp_path / "feed.json").write_text(json.dumps(feed))
    assert summary(parts)["exit"] == 0
    (tmp_path / "feed.json").unlink()
    got = summary(parts)
    assert got["exit"] == 3 and got["parts"][0]["status"] == "failed: wrote no JSON"


# In .venv-gpu (the lent GPUs' JAX and XLA): each XLA candidate as XLA_FLAGS spells it, in a
# process of its own (XLA aborts on a flag it does not know), and as the compile option the
# A/B gives it; then a convolution compiled for an H100 without one, its module config's
# command buffer set read back by default and with the candidate.
SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, tempfile
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # before JAX: twin.deviceless_env
    os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"
    import jax
    from jax.experimental import topologies
    from bench.gpu import kernel_profile as kp, twin

    flags = [*kp.XLA_CANDIDATES, "xla_gpu_no_such_flag=true"]
    tiny = "import jax; jax.jit(lambda x: x + 1)(1).block_until_ready()"
    rc = {f: subprocess.run([sys.executable, "-c", tiny], capture_output=True,
                            env=dict(os.environ, XLA_FLAGS="--" + f, JAX_PLATFORMS="cpu"),
                            ).returncode for f in flags}
    refused = {f: kp.xla_refuses(kp.xla_options(f)) for f in flags}
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=twin.target_config("h100"))
    where = jax.sharding.SingleDeviceSharding(topology.devices[0])
    x = jax.ShapeDtypeStruct((8, 16, 16, 32), jax.numpy.bfloat16, sharding=where)
    w = jax.ShapeDtypeStruct((3, 3, 32, 32), jax.numpy.bfloat16, sharding=where)
    conv = jax.jit(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
    sets = {}
    for name, options in (("default", {}), ("candidate", kp.xla_options(kp.XLA_CANDIDATES[0]))):
        with tempfile.TemporaryDirectory() as dump:
            conv.lower(x, w).compile(compiler_options={**options, "xla_dump_to": dump})
            sets[name] = kp.command_buffer_set(dump)
    print(json.dumps({"rc": rc, "refused": refused, "sets": sets}))
""")


@pytest.mark.gpu_twin
def test_the_lent_gpus_xla_takes_the_xla_candidates():
    """The lent GPUs' XLA (JAX 0.11.2 in .venv-gpu, ~15 s) knows both XLA candidates, as
    XLA_FLAGS (a process starts) and as the A/B's compile options (a compile takes them); its
    default command buffer set is `COMMAND_BUFFER_DEFAULT` (the twin's fallback), and the
    candidate's is that set with CONVOLUTION. Control: an unknown flag aborts the process and
    is refused as an option."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    done = subprocess.run([str(GPU_PYTHON), "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for flag in kernel_profile.XLA_CANDIDATES:
        assert got["rc"][flag] == 0 and got["refused"][flag] is None, got
    assert got["rc"]["xla_gpu_no_such_flag=true"] != 0, got
    assert "No such compile option" in got["refused"]["xla_gpu_no_such_flag=true"], got
    assert got["sets"]["default"] == list(kernel_profile.COMMAND_BUFFER_DEFAULT), got
    assert got["sets"]["candidate"] == [*kernel_profile.COMMAND_BUFFER_DEFAULT, "CONVOLUTION"]
