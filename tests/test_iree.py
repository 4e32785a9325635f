"""IREE (twinstep.rendering.iree; 'render --target iree'; 'tie --artifact NAME.vmfb'): a render's
StableHLO compiled by IREE's llvm-cpu backend, run by IREE's runtime, tied to the single-device
Python step. A whole net takes IREE a minute (ResNet-50) to several (MNv4) to compile, so the
whole-step tie runs in make test-all; make test checks the backend on a small f64 program and
the refusals. The tests that run IREE are marked ``iree`` (the [iree] extra)."""

import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twinstep import cli
from twinstep.checking import tie, trajectory
from twinstep.errors import BackendError
from twinstep.processes import settings
from twinstep.rendering import iree, reader, render

# R = 1 with N = 8: the single device's BNs reduce 8 rows, as the XLA artifact tie's R = 4 x 2
# does (at N = 2 layer4's 1x1 BNs leave the f64 noise floor above the inconclusive bound).
# The recipe holds the step's features but masks: EMA, LAMB, k = 2 micro-steps, weight-decay
# mask, clip, BCE. Masks in k >= 2 micro-steps fail IREE's runtime (bench/iree_masks.py): MASKED
# ties drop path at k = 1.
RECIPE = "resnet50in_emalambaccdp2x8wxclipbce"
MASKED = "resnet50in_adamdp8drop"
SMALL = {"res": 32, "classes": 10}


def _f64_program() -> str:
    """StableHLO of a small f64 function with a libm call (cos), as a render holds one (the
    cosine schedule)."""
    def f(x, w):
        return jnp.cos(x) @ w + x.sum() / 3

    with settings.jax_settings(jax_enable_x64=True):
        spec = jax.ShapeDtypeStruct((4, 5), jnp.float64), jax.ShapeDtypeStruct((5, 3),
                                                                              jnp.float64)
        return jax.export.export(jax.jit(f))(*spec).mlir_module()


@pytest.mark.iree
def test_an_f64_program_runs_in_f64_on_iree(tmp_path, monkeypatch):
    """`iree_backend.flags("f64")` keeps an f64 program f64 and links its cos: the result is
    numpy's to 1e-14. The control, the same program under IREE's defaults (what flags("f32")
    gives), is demoted to f32: it takes f32 arguments and is 1e-8 off — six orders of magnitude
    above the bound, so the bound can tell f64 from f32."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 5)), rng.standard_normal((5, 3))
    want = np.cos(x) @ w + x.sum() / 3
    mlir = _f64_program()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    (got,) = iree.load(iree.compile_mlir(mlir, "f64"))(x, w)
    assert not list(tmp_path.iterdir())  # IREE's iree_dylib_* folder not left behind
    assert got.dtype == np.float64
    assert np.abs(got - want).max() <= 1e-14 * np.abs(want).max()
    demoted = iree.load(iree.compile_mlir(mlir, "f32"))
    with pytest.raises(BackendError, match="element type mismatch"):
        demoted(x, w)  # IREE checks the declared types: no silent cast
    (low,) = demoted(x.astype(np.float32), w.astype(np.float32))
    assert low.dtype == np.float32
    assert np.abs(low - want).max() > 1e-8 * np.abs(want).max()


def test_iree_refusals(tmp_path, capsys, monkeypatch):
    """One line and exit 2 before anything is exported or compiled: an R > 1 or non-CPU IREE
    render, an NAME.vmfb its manifest does not hold; exit 3 when IREE is not installed."""
    def fails(argv, code, text):
        assert cli.main(argv) == code, argv
        err = capsys.readouterr().err
        assert text in err and err.count("\n") == 1, err

    out = str(tmp_path / "out")
    fails(["render", RECIPE, "--target", "iree", "--replicas", "2", "--out", out], 2,
          "one device (--replicas 1)")
    fails(["render", RECIPE, "--target", "iree", "--platform", "cuda", "--out", out], 2,
          "--platform cpu")
    fails(["render", "resnet50in_accdp2x8drop", "--target", "iree", "--out", out], 2,
          "bench/iree_masks.py")
    fails(["tie", "--artifact", str(tmp_path / "none.vmfb")], 2, "cannot read")
    with pytest.raises(SystemExit) as e:
        cli.main(["tie", "--artifact", str(tmp_path / "x.mlir")])
    assert e.value.code == 2 and "NAME.jaxexport or NAME.vmfb" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "iree.compiler", None)  # as if not installed
    fails(["render", RECIPE, "--target", "iree", "--out", out], 3, "pip install 'twinstep[iree]'")


def test_a_vmfb_outside_its_manifest_is_refused(tmp_path, capsys):
    """A NAME.vmfb dropped beside an XLA render (its manifest holds no IREE build) or changed
    after its render: the sha256 check refuses it (exit 2) before IREE loads anything."""
    r = render.make(render.RenderConfig(RECIPE, 1, precision="f64", **SMALL))
    paths = render.write(r, str(tmp_path))
    vmfb = paths[".jaxexport"][:-len(".jaxexport")] + ".vmfb"
    with open(vmfb, "wb") as f:
        f.write(b"not IREE's")
    assert cli.main(["tie", "--artifact", vmfb]) == 2
    assert "sha256 differs" in capsys.readouterr().err
    manifest = json.loads(open(paths[".json"], "rb").read())
    assert "iree" not in manifest and reader.load(paths[".jaxexport"])  # the set itself loads


@pytest.mark.all
@pytest.mark.iree
def test_the_iree_render_ties_and_its_f32_demotion_does_not(tmp_path):
    """'render --target iree --precision f64' then 'tie --artifact NAME.vmfb': IREE's module of
    the whole step (EMA, LAMB, k = 2, weight-decay mask, clip, BCE) against the single-device
    Python step over 2 steps, every state tensor at the f64 bounds. The control: the same
    StableHLO compiled with IREE's default flags (f64 demoted to f32; arguments cast to f32 and
    results back) must fail the tie — f32 rounding is ~1e-7, the loosest bound ~1e-9."""
    out = tmp_path / "r"
    assert cli.main(["render", RECIPE, "--target", "iree", "--precision", "f64", "--res", "32",
                     "--classes", "10", "--out", str(out)]) == 0
    vmfb_path = str(out / f"{RECIPE}.vmfb")
    report = tmp_path / "tie.json"
    assert cli.main(["tie", "--artifact", vmfb_path, "--steps", "2",
                     "--json", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["ok"] and rep["artifact"] == vmfb_path and rep["steps"][1]["loss"]["ok"]
    vmfb, exported, manifest = reader.load_iree(vmfb_path)
    assert manifest["iree"]["flags"] == iree.flags("f64")
    shutil.rmtree(out)

    demoted = iree.load(iree.compile_mlir(
        exported.mlir_module(), "f32"))
    kept = sorted(exported.module_kept_var_idx)

    def call(args):
        low = [np.asarray(args[i]) for i in kept]
        low = [a.astype(np.float32) if a.dtype == np.float64 else a for a in low]
        return [jnp.asarray(o.astype(np.float64) if o.dtype == np.float32 else o)
                for o in demoted(*low)]

    cfg = tie.TieConfig(manifest["net"], 1, recipe=RECIPE, **SMALL)
    with settings.jax_settings(jax_enable_x64=True):
        bad = trajectory.run_steps_tie(cfg, steps=1,
                                 replica=reader._flat_step(manifest["inputs"], call))
    assert bad.status == "NOT tied", bad.verdict()


@pytest.mark.all
@pytest.mark.iree
def test_an_iree_render_with_drop_path_ties(tmp_path):
    """The masks (drop path, drawn from the step's key) at k = 1, on IREE, against the Python
    step's."""
    assert cli.main(["render", MASKED, "--target", "iree", "--precision", "f64", "--res", "32",
                     "--classes", "10", "--out", str(tmp_path)]) == 0
    assert cli.main(["tie", "--artifact", str(tmp_path / f"{MASKED}.vmfb"), "--steps", "2"]) == 0
