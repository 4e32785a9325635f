"""The GPU's train step compiled here, and the bytes its kernels move (bench/gpu/twin.py).

The accounting reads any optimized HLO module's text; it is checked here on a module written by
hand, whose bytes are counted by hand. The compile for a GPU needs JAX's CUDA plugin, which
`make test` installs in ``.venv-gpu`` (the JAX the lent GPUs run; `make gpu-twin`): one test
runs there, in a subprocess, on a small ResNet-50 step. The last runs the lease's profile script
(bench/gpu/kernel_profile.py) whole as its CPU twin, here.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench.gpu import kernel_profile, twin

ROOT = Path(__file__).resolve().parent.parent
GPU_PYTHON = ROOT / ".venv-gpu" / "bin" / "python"


# A loop of 3 trips around a fusion, a cuDNN convolution with its scratch and an in-place
# update of a buffer the loop carries; a copy after it.
MODULE = """\
HloModule m, is_scheduled=true

%fused_add (p0: f32[4,8], p1: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[4,8]{1,0} parameter(1)
  ROOT %add.1 = f32[4,8]{1,0} add(%p0, %p1)
}

%fused_update (q0: f32[16,8], q1: bf16[4,8], q2: s32[]) -> f32[16,8] {
  %q0 = f32[16,8]{1,0} parameter(0)
  %q1 = bf16[4,8]{1,0} parameter(1)
  %wide = f32[4,8]{1,0} convert(%q1)
  %q2 = s32[] parameter(2)
  %zero = s32[] constant(0)
  ROOT %dus = f32[16,8]{1,0} dynamic-update-slice(%q0, %wide, %q2, %zero)
}

%body (state: (s32[], f32[4,8], f32[16,8])) -> (s32[], f32[4,8], f32[16,8]) {
  %state = (s32[], f32[4,8]{1,0}, f32[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%state), index=1
  %buffer = f32[16,8]{1,0} get-tuple-element(%state), index=2
  %loop_add_fusion = f32[4,8]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  %cudnn-conv.1 = (bf16[4,8]{1,0}, u8[4096]{0}) custom-call(%loop_add_fusion), custom_call_target="__cudnn$convForward", metadata={op_name="jit(train)/conv_general_dilated"}
  %y = bf16[4,8]{1,0} get-tuple-element(%cudnn-conv.1), index=0
  %loop_dynamic_update_slice_fusion = f32[16,8]{1,0} fusion(%buffer, %y, %i), kind=kLoop, calls=%fused_update
  ROOT %next = (s32[], f32[4,8]{1,0}, f32[16,8]{1,0}) tuple(%i, %loop_add_fusion, %loop_dynamic_update_slice_fusion)
}

%cond (c: (s32[], f32[4,8], f32[16,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}, f32[16,8]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (a: f32[4,8], b: f32[16,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[16,8]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}, f32[16,8]{1,0}) tuple(%zero, %a, %b)
  %loop = (s32[], f32[4,8]{1,0}, f32[16,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
  ROOT %copy.1 = f32[4,8]{1,0} copy(%out)
}
"""  # noqa: E501
# by hand, per trip: the fusion reads two f32[4,8] and writes one (3 x 128 bytes); the
# convolution reads 128 and writes bf16[4,8] (64), its u8 scratch not counted; the in-place
# update reads and writes its update (64) and index (4), not the f32[16,8] buffer (512). Then
# the copy: 2 x 128.
PER_TRIP = {"loop_add_fusion": 384, "cudnn-conv.1": 192,
            "loop_dynamic_update_slice_fusion": 2 * (64 + 4)}
AFTER = {"copy.1": 256}


def test_the_twin_counts_each_kernels_bytes_by_hand():
    """`twin.kernels` on MODULE gives the bytes counted by hand, per kernel, times the loop's
    trip count. Controls: read with one trip, the loop's kernels count once (968 bytes in all,
    not 2,392); the in-place update counted whole would be 1,088 bytes, not 136; a reader that
    kept the scratch would count 4,288 for the convolution."""
    found = {k["name"]: k for k in twin.kernels(MODULE)}
    expected = {**{k: 3 * v for k, v in PER_TRIP.items()}, **AFTER}
    assert {k: v["bytes"] for k, v in found.items()} == expected
    assert found["cudnn-conv.1"]["category"] == "conv forward"
    assert found["loop_add_fusion"]["category"] == "XLA fusions"
    assert found["copy.1"]["category"] == "copies and pads"
    assert found["cudnn-conv.1"]["op"] == "conv_general_dilated"
    one_trip = {k["name"]: k["bytes"] for k in twin.kernels(MODULE.replace('"n":"3"', '"n":"1"'))}
    assert sum(one_trip.values()) == 968 != sum(expected.values()) == 2392
    whole = MODULE.replace("dynamic-update-slice(%q0, %wide, %q2, %zero)", "add(%q0, %q0)")
    assert {k["name"]: k["bytes"] for k in twin.kernels(whole)}[
        "loop_dynamic_update_slice_fusion"] == 3 * (512 + 64 + 4 + 512)
    assert twin.type_bytes("(bf16[4,8]{1,0}, u8[4096]{0})") == 64 + 4096
    summary = twin.account(list(found.values()), top=1)
    assert summary["gb"] * 1e9 == pytest.approx(sum(expected.values()))
    assert summary["top"][0]["name"] == "loop_add_fusion"


def test_the_lease_scripts_take_every_net_of_the_catalogue(capsys):
    """`NETS=... bash bench/gpu.sh step hlo` for any net: bench/gpu/step.py and bf16_hlo.py take
    every net of `twinstep.nets.NETS` (here, without a GPU, each then exits 2 saying so, after
    its arguments); a net outside it is refused by the argument parser."""
    from bench.gpu import bf16_hlo, step
    from twinstep.nets import NETS

    for script in (step, bf16_hlo):
        assert script.main(["--nets", *NETS]) == 2
        assert capsys.readouterr().err.startswith("no GPU")
        with pytest.raises(SystemExit):
            script.main(["--nets", "vgg16"])
        assert "invalid choice: 'vgg16'" in capsys.readouterr().err


def test_a_lease_lever_name_reads_as_a_levers_field():
    assert twin._lever("crop_unread=False") == {"crop_unread": False}
    assert twin._lever("bn_moments=one-pass") == {"bn_moments": "one-pass"}


# The subprocess's program: ResNet-50's bf16 train step as bench/gpu/step.py times it (batch
# 512 at 224²: XLA:GPU fuses a small step differently), compiled for an H100 four ways; the
# bytes its XLA fusions move, and all its kernels'.
SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"  # before JAX: twin.deviceless_env
    os.environ["XLA_FLAGS"] = "--xla_gpu_autotune_level=0"
    import jax
    from bench.gpu import twin
    from twinstep.nets import layers
    from twinstep.ops import precision

    def measure(**levers):
        found = twin.kernels(twin.compile_step("resnet50", 512, 224, 1000, "h100", **levers))
        return {"fusions": sum(k["bytes"] for k in found if k["category"] == "XLA fusions"),
                "all": sum(k["bytes"] for k in found)}

    out = {"default": measure(), "store": measure(store="bf16"),
           "bits": measure(relu_mask="bits")}
    # the control: the same rounding without the barrier, as the first store=bf16 was built
    layers.stored = lambda x, store: (
        precision.round_to(x, jax.numpy.bfloat16).astype(x.dtype) if store == "bf16" else x)
    out["round trip"] = measure(store="bf16")
    print(json.dumps(out))
""")


@pytest.mark.gpu_twin
def test_bf16_storage_and_bit_masks_move_fewer_bytes_on_a_gpu():
    """`store="bf16"` compiled for an H100 here (`.venv-gpu`, ~55 s): ResNet-50's step at
    batch 512, 224², moves at least 5 % fewer bytes through XLA's fusions than the same rounding
    without the optimization barrier (8.4 % when written). Control: that round trip, the first
    store=bf16, moves the default's bytes within 0.5 % (+0.1 %): XLA:GPU fuses the rounding
    into the producer and writes f32, which only a GPU's compile shows. `relu_mask="bits"`
    moves at least 5 % fewer than the default's bool masks (10.1 % when written)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    done = subprocess.run([str(GPU_PYTHON), "-c", SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    default, store, control = got["default"], got["store"], got["round trip"]
    assert control["fusions"] == pytest.approx(default["fusions"], rel=0.005), got
    assert store["fusions"] < 0.95 * control["fusions"], got
    assert store["all"] < default["all"], got
    assert got["bits"]["fusions"] < 0.95 * default["fusions"], got


def _profile(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """bench/gpu/kernel_profile.py as its CPU twin (this machine's JAX, XLA:CPU): batch 2 at 32²."""
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "kernel_profile.py"),
                           "--batch", "2", "--res", "32", "--steps", "3", "--traced", "1",
                           "--out", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.all  # ~4 min: both nets, each compiled once per lever
def test_the_lease_profile_runs_whole_as_its_cpu_twin(tmp_path):
    """`bash bench/gpu.sh profile`'s script, up to the device: each net's step traced and
    summarised by kernel kind, then timed against every lever `kernel_profile.LEVERS` names for
    it, each profile written as JSON; a lease finds it working. Control: a part that overruns
    its --limit is named, its net's profile is missing and the script exits 3."""
    done = _profile(tmp_path, "--nets", "resnet50", "mnv4", "--ab", "--limit", "600")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for net in ("resnet50", "mnv4"):
        got = json.loads((tmp_path / f"profile_{net}_32.json").read_text())
        assert got["img_per_s"] > 0 and got["useful_mfu"] > 0, got
        assert "XLA fusions" in got["categories"] and got["top"], got["categories"]
        levers = [name for name, (_, nets) in kernel_profile.LEVERS.items() if net in nets]
        assert list(got["ab"]) == levers
        assert all(r["speedup"] > 0 for r in got["ab"].values()), got["ab"]

    cut = _profile(tmp_path / "cut", "--nets", "resnet50", "--limit", "1")
    assert cut.returncode == 3 and "resnet50: cut at 1 s" in cut.stdout, cut.stdout
    assert not (tmp_path / "cut" / "profile_resnet50_32.json").exists()
