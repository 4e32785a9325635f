"""Renders (twinstep.rendering.render): the exported whole train step and what its manifest claims.

The StableHLO checks read the text the render was serialized from. On this CPU-only machine
bf16 is checked in the StableHLO, where the policy is visible: XLA:CPU upcasts bf16
convolutions to f32 when it compiles (docs/platform.md), so only a GPU's optimized HLO can show the
compiled convolutions stay bf16 — bench/gpu/bf16_hlo.py checks that on a GPU machine.
"""

import hashlib
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twinstep import cli, dp, optim, step
from twinstep.checking import bounds, inputs, tie, trajectory
from twinstep.collectives import GRAD_BUCKET_BYTES, MICRO_STEP_SITES, SITES, grad_buckets
from twinstep.errors import ExitStatus, RenderError
from twinstep.nets import get_net
from twinstep.recipes import parse
from twinstep.rendering import manifest, reader, render, stablehlo
from twinstep.training.checkpoint import load_state

# the example: AdamW, N = 2 per replica, on R = 4 at 32², K = 10 — on ResNet-18, the
# smallest net: what the tests of its render hold is the render's (a net's own: BNS, TENSORS)
EXAMPLE = "resnet18in_adamdp2"
BNS = {"resnet18": 20, "resnet50": 53, "mnv4": 77}
TENSORS = {"resnet18": 62, "resnet50": 161, "mnv4": 233}
# 25 MiB buckets of the f32 gradients of 10 classes (collectives.grad_buckets)
BUCKETS = {"resnet50": 4, "mnv4": 2}
SMALL = {"res": 32, "classes": 10}
# the tests that read the example's render run on one pytest worker, which renders it once
ON_EXAMPLE = pytest.mark.xdist_group("example_f64")


@pytest.fixture(scope="module")
def example_f64(tmp_path_factory):
    """The example rendered in f64 for R = 4 and written out."""
    out = tmp_path_factory.mktemp("renders")
    r = render.make(render.RenderConfig(EXAMPLE, 4, precision="f64", **SMALL))
    return r, render.write(r, str(out))


@ON_EXAMPLE
@pytest.mark.slow
def test_rendering_twice_is_byte_identical(example_f64, tmp_path):
    first, paths = example_f64
    again = render.make(first.config)
    assert again.mlir == first.mlir and again.serialized == first.serialized
    again_paths = render.write(again, str(tmp_path))
    for suffix in render.SUFFIXES:
        with open(paths[suffix], "rb") as a, open(again_paths[suffix], "rb") as b:
            assert a.read() == b.read(), suffix
    # no file paths in the locations: the text depends on the program, not on the checkout
    assert "test_render.py" not in first.mlir and "twinstep/" not in first.mlir


@pytest.mark.slow
def test_one_replica_render_is_the_single_device_render():
    cfg = render.RenderConfig(EXAMPLE, 1, **SMALL)
    one = render.make(cfg)
    single = render.export_step(cfg, single=True).exported
    assert stablehlo.collectives(one.mlir) == []
    assert one.manifest["collectives"]["in_text"] == 0
    assert one.mlir == single.mlir_module()
    assert one.exported.nr_devices == 1
    assert all(i["spec"] == [] for i in one.manifest["inputs"])  # nothing sharded


@ON_EXAMPLE
@pytest.mark.slow
def test_a_four_replica_render_needs_one_device(example_f64, tmp_path):
    """Lowered from an abstract mesh: a process with ONE device (and x64 off) renders the R = 4
    f64 step, and its three files are, byte for byte, the ones rendered here with 8 devices."""
    code = ("import jax\n"
            "assert jax.device_count() == 1, jax.devices()\n"
            "from twinstep.rendering import render\n"
            f"r = render.make(render.RenderConfig({EXAMPLE!r}, 4, precision='f64', res=32, "
            "classes=10))\n"
            "assert r.exported.nr_devices == 4\n"
            f"render.write(r, {str(tmp_path)!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    for suffix, path in example_f64[1].items():
        with open(path, "rb") as a, open(tmp_path / os.path.basename(path), "rb") as b:
            assert a.read() == b.read(), suffix


@pytest.mark.parametrize("name", ["resnet50in160_lambaccdp4x128wxclipbcebf16",
                                  "mnv4in_emaaccdp8x128wxdowd005bf16"])
@pytest.mark.slow
def test_collectives_match_the_design_and_stay_f32(name):
    r = render.make(render.RenderConfig(name, 4, **SMALL))
    net, k = r.recipe.net, r.recipe.accum
    c = r.manifest["collectives"]
    bns, buckets = BNS[net], BUCKETS[net]
    assert c["spec_reference"] == 2 * bns + buckets  # 110 / 156
    want = {"bn_forward": bns, "bn_backward": bns, "grad": buckets, "loss": 1}
    assert {s: v["count"] for s, v in c["by_site"].items()} == want
    # the manifest's count is the text's: every collective, found by its quoted generic form —
    # the forward moments gathered, everything else all-reduced
    gathers, reduces = (r.mlir.count(f'"stablehlo.{k}"') for k in ("all_gather", "all_reduce"))
    assert c["in_text"] == gathers + reduces == c["spec_reference"] + 1
    assert {k: v["count"] for k, v in c["by_kind"].items()} == {
        "all_gather": bns, "all_reduce": bns + buckets + 1} == {"all_gather": gathers,
                                                                 "all_reduce": reduces}
    # the BN sites and the loss in the scan's body, each micro-step; the gradient buckets after it
    ops = stablehlo.collectives(r.mlir)
    assert {o["site"] for o in ops if o["in_loop"]} == set(MICRO_STEP_SITES)
    assert {o["site"] for o in ops if not o["in_loop"]} == {"grad"}
    assert c["per_micro_step"] == 2 * bns + 1
    assert c["per_optimizer_step"]["count"] == k * (2 * bns + 1) + buckets
    # a bf16 render: every collective carries f32, never bf16
    assert [v["dtypes"] for v in c["by_kind"].values()] == [["f32"]] * 2
    # payload: each parameter-gradient element once per optimizer step, in f32
    scalars = r.manifest["parameters"]["scalars"]
    assert c["by_site"]["grad"]["payload_bytes"] == 4 * scalars
    bn_and_loss = sum(v["payload_bytes"] for s, v in c["by_site"].items() if s != "grad")
    assert c["per_optimizer_step"]["payload_bytes"] == k * bn_and_loss + 4 * scalars


def test_gradient_buckets_hold_each_element_once():
    """The gradient buckets (no network): consecutive same-dtype leaves up to the cap, a larger
    leaf alone, a dtype change starts a bucket; and the bucketed mean over 2 replicas is each
    leaf's own mean, where the `sum` control is not."""
    cap = GRAD_BUCKET_BYTES // 4
    leaves = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in [
        ((cap // 2,), jnp.float32), ((cap // 2,), jnp.float32), ((1,), jnp.float32),
        ((cap + 1,), jnp.float32), ((3,), jnp.float64), ((2,), jnp.float32)]]
    assert grad_buckets(leaves) == [[0, 1], [2], [3], [4], [5]]
    dp.ensure_devices(2)
    rng = np.random.default_rng(0)
    grads = {"a": rng.standard_normal((2, 3, 4)), "b": rng.standard_normal((2, 5)),
             "c": rng.standard_normal((2,))}
    for control in ("none", "sum"):
        mean = dp.replica_map(dp.replicas(2, control).grad_mean, 2, (dp.BATCH,), dp.BATCH)(grads)
        close = [np.allclose(mean[n], np.broadcast_to(g.mean(0, keepdims=True), g.shape),
                             rtol=1e-12) for n, g in grads.items()]
        assert close == [control == "none"] * len(grads), control


@ON_EXAMPLE
@pytest.mark.slow
def test_f64_renders_reduce_in_f64(example_f64):
    c = example_f64[0].manifest["collectives"]
    assert [v["dtypes"] for v in c["by_kind"].values()] == [["f64"]] * 2


@pytest.mark.slow
def test_the_counter_sees_missing_collectives():
    """The counter is not blind: in the gradient step of the tie (the same sync sites), the
    unsynced control has only the gradients' and the loss's all-reduces. The whole step refuses
    that control (each replica would keep its own running statistics)."""
    net = get_net("resnet50")
    start = inputs.setup(tie.TieConfig(net="resnet50", replicas=4), net)
    buckets = len(grad_buckets(jax.tree.leaves(start[0])))
    assert buckets == 10  # f64: twice the bytes of f32's 4
    for control, want in (("none", 2 * 53 + buckets + 1), ("unsynced", buckets + 1)):
        cfg = tie.TieConfig(net="resnet50", replicas=4, control=control)
        params, buffers, x, t = inputs.setup(cfg, net)
        program = tie.replica_program(net, cfg, inputs.tie_precision("f64"))
        text = program.lower(params, buffers, x, t).as_text(debug_info=True)
        ops = stablehlo.collectives(text)
        assert len(ops) == want, control
        assert {o["site"] for o in ops} == ({"grad", "loss"} if control == "unsynced"
                                            else set(SITES))
    with pytest.raises(RenderError, match="running statistics"):
        render.make(render.RenderConfig(EXAMPLE, 4, control="unsynced", **SMALL))


def test_the_collective_reader_sees_bf16_and_sites():
    """Hand-written collectives under a site's scope — an all-reduce of a bf16 tensor, an
    all-gather of bf16 moments: the reader reports each one's kind, dtype and site, so a bf16
    collective in a render could not pass unseen."""
    text = "\n".join([
        '%3 = "stablehlo.all_reduce"(%2) <{replica_groups = dense<[[0, 1]]> : tensor<1x2xi64>}>'
        ' ({',
        '^bb0(%a: tensor<bf16> loc("x"), %b: tensor<bf16> loc("x")):',
        "  %4 = stablehlo.add %a, %b : tensor<bf16> loc(#loc3)",
        "  stablehlo.return %4 : tensor<bf16> loc(#loc3)",
        "}) : (tensor<7x3xbf16>) -> tensor<7x3xbf16> loc(#loc3)",
        '%5 = "stablehlo.all_gather"(%4) <{all_gather_dim = 0 : i64, replica_groups = dense<[[0,'
        ' 1]]> : tensor<1x2xi64>}> : (tensor<1x2x8xbf16>) -> tensor<2x2x8xbf16> loc(#loc4)',
        '#loc3 = loc("while/body/closed_call/bn_backward/psum_invariant")',
        '#loc4 = loc("bn_forward/all_gather_invariant"(#loc3))'])
    assert stablehlo.collectives(text) == [
        {"kind": "all_reduce", "site": "bn_backward", "in_loop": False,
         "operands": [((7, 3), "bf16")], "bytes": 42},
        {"kind": "all_gather", "site": "bn_forward", "in_loop": False,
         "operands": [((1, 2, 8), "bf16")], "bytes": 32}]
    assert set(SITES) == {"bn_forward", "bn_backward", "grad", "loss"}


# lines of the optimized HLO an H200 compiled for resnet50in_adamdp8bf16 at 64² (XLA of JAX
# 0.11.2; bench/RESULTS.md#gpu), cut short: operands are printed by name only
GPU_HLO = """\
  %loop_pad_fusion = bf16[8,69,69,3]{3,2,1,0} fusion(%args_592_.3), kind=kLoop
  %loop_transpose_fusion.14 = bf16[64,7,7,3]{3,2,1,0} fusion(%args_3_.3), kind=kLoop
  %get-tuple-element.3199 = bf16[8,16,16,64]{3,2,1,0} get-tuple-element(%fusion.7), index=0
  %bitcast.3819.0 = bf16[64,1,1,64]{3,2,1,0} bitcast(%wrapped_convert.1)
  %cudnn-conv.101 = (bf16[8,32,32,64]{3,2,1,0}, u8[0]{0}) custom-call(%loop_pad_fusion, \
%loop_transpose_fusion.14), window={size=7x7 stride=2x2}, custom_call_target="__cudnn$convForward"
  %cudnn-conv.102 = (bf16[8,16,16,64]{3,2,1,0}, u8[0]{0}) custom-call(%get-tuple-element.3199, \
%bitcast.3819.0), window={size=1x1}, custom_call_target="__cudnn$convForward"
"""


def test_the_gpu_hlo_reader_reads_operands_by_name():
    """bench/gpu/bf16_hlo.py on a GPU's optimized HLO: operand dtypes come from the
    instructions that define them. Controls: one operand defined as f32, or a convolution
    fewer than the StableHLO has, fails the check."""
    from bench.gpu import bf16_hlo

    ok, counts, accounted = bf16_hlo.check(GPU_HLO, 2)
    assert ok and accounted == 2
    assert counts == {("__cudnn$convForward", "bf16/bf16", "bf16"): 2}
    upcast = GPU_HLO.replace("%bitcast.3819.0 = bf16[", "%bitcast.3819.0 = f32[")
    assert bf16_hlo.check(upcast, 2)[:2] == (
        False, {("__cudnn$convForward", "bf16/bf16", "bf16"): 1,
                ("__cudnn$convForward", "bf16/f32", "bf16"): 1})
    assert not bf16_hlo.check(GPU_HLO, 3)[0]  # a convolution the reader did not find


def test_useful_macs_leave_out_the_zeros_a_strided_input_gradient_dilates():
    """A stride-2 convolution and its VJP: the useful count is three times the forward's (the
    forward, the input and the weight gradients cost the same), the plain count more — the
    input gradient, a convolution over the cotangent dilated by 2, counts 4x its taps."""
    import jax.numpy as jnp

    x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 6))

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)),
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def step(x, w):
        y, vjp = jax.vjp(conv, x, w)
        return vjp(y)

    forward = stablehlo.macs(jax.jit(conv).lower(x, w).as_text())
    text = jax.jit(step).lower(x, w).as_text()
    assert forward == 2 * 4 * 4 * 3 * 3 * 4 * 6
    assert stablehlo.macs(text, useful=True) == 3 * forward
    assert stablehlo.macs(text) == 6 * forward  # control: the dilated zeros counted


def test_the_profile_sorts_gpu_kernels_by_what_they_compute():
    """bench/gpu/kernel_profile.py's categories of XLA:GPU's op and cuDNN's kernel names, each
    category reached; controls: a name of none is "other", a cuDNN kernel that XLA made a
    fusion is a convolution."""
    from bench.gpu import kernel_profile

    named = {("cudnn-conv-bw-input.12", "sm90_xmma_dgrad_implicit_gemm"): "conv backward-input",
             ("cudnn-conv-bw-filter.3", "sm90_xmma_wgrad"): "conv backward-filter",
             ("cudnn-conv-bias-activation.2", "sm90_xmma_fprop"): "conv forward",
             ("custom-call.4", "sm90_xmma_dgrad_nhwc"): "conv backward-input",
             ("cublas-gemm.1", "sm90_xmma_gemm_bf16"): "gemm",
             ("all-reduce-start.2", "ncclDevKernel_AllReduce"): "collectives",
             ("copy.7", "copy_7"): "copies and pads", ("pad.3", "pad_3"): "copies and pads",
             ("loop_fusion.9", "loop_fusion_9"): "XLA fusions",
             ("input_reduce_fusion.1", "input_reduce_fusion_1"): "XLA fusions",
             ("rng-bit-generator.1", "rng"): "other",  # control: none of them
             ("fusion.2", "sm90_xmma_fprop"): "conv forward"}  # control: the kernel's name
    assert {k: kernel_profile.category(*k) for k in named} == named
    assert {c for c, _ in kernel_profile.CATEGORIES} <= set(named.values())
    events = [("cudnn-conv.1", "fprop", 3e6), ("cudnn-conv.2", "fprop", 1e6),
              ("loop_fusion.1", "loop_fusion_1", 4e6)]
    summary = kernel_profile.summarise(events, steps=2, top=1)
    assert summary["categories"]["conv forward"] == {"ms_per_step": 2.0, "share": 0.5}
    assert summary["top"] == [{"kernel": "fprop", "op": "cudnn-conv", "category": "conv forward",
                               "count_per_step": 1.0, "ms_per_step": 2.0}]


@pytest.mark.parametrize("net,name", [("resnet50", "resnet50in_adamdp2bf16"),
                                      ("mnv4", "mnv4in_adamdp2bf16")])
@pytest.mark.slow
def test_bf16_renders_have_bf16_convolutions(net, name):
    """Forward, input-gradient and weight-gradient convolutions all take bf16 operands and give
    a bf16-TYPED result, in the StableHLO (on CPU; see the module docstring for the GPU)."""
    r = render.make(render.RenderConfig(name, 2, **SMALL))
    convs = stablehlo.convolutions(r.mlir)
    assert convs and all(d == "bf16" for c in convs for _, d in c["operands"] + [c["result"]])
    dense = sum(len(s) == 4 and s[1] > 1 for s in get_net(net).param_shapes(10).values())
    # ResNet-50: 53 forward, 52 input gradients (none for the image), 53 weight gradients;
    # MNv4 on CPU: the dense convs (depthwise runs as shifted multiply-adds there)
    assert len(convs) == 3 * dense - 1
    assert r.manifest["convolutions"] == {"count": len(convs), "dtypes": ["bf16"]}
    f32 = render.make(render.RenderConfig(name.replace("bf16", ""), 2, **SMALL))
    assert f32.manifest["convolutions"]["dtypes"] == ["f32"]  # the check tells them apart
    # rendered as the CLI renders them, x64 or not: no f64 anywhere in the program
    assert "f64" not in r.mlir and "f64" not in f32.mlir
    # master weights, optimizer state, data and outputs stay f32 in both (under x64 too)
    for m in (r.manifest, f32.manifest):
        floats = {i["dtype"] for i in m["inputs"] + m["outputs"] if "int" not in i["dtype"]}
        assert floats == {"float32"}, floats


@pytest.mark.slow
def test_bf16_renders_for_gpu_lower_depthwise_as_bf16_convolutions():
    r = render.make(render.RenderConfig("mnv4in_adamdp2bf16", 2, platform="cuda", **SMALL))
    shapes = get_net("mnv4").param_shapes(10).values()
    dense = sum(len(s) == 4 and s[1] > 1 for s in shapes)
    depthwise = sum(len(s) == 4 and s[1] == 1 for s in shapes)
    assert r.manifest["platform"] == "cuda" and r.manifest["depthwise_path"] == "grouped"
    assert r.manifest["convolutions"] == {"count": 3 * (dense + depthwise) - 1,
                                          "dtypes": ["bf16"]}


@ON_EXAMPLE
@pytest.mark.slow
def test_manifest_describes_the_signature(example_f64):
    r, paths = example_f64
    with open(paths[".json"]) as f:
        m = json.load(f)
    assert tuple(m) == manifest.KEYS
    assert (m["net"], m["replicas"], m["batch"], m["global_batch"], m["accum"]) == (
        "resnet18", 4, 2, 8, 1)
    # timm's 11,689,512 less 990 classes of fc's 512 weights and bias
    assert m["parameters"] == {"tensors": 62, "scalars": 11_689_512 - 990 * 513}
    names = [i["name"] for i in m["inputs"]]
    assert names[-3:] == ["xs", "ts", "key"] and [o["name"] for o in m["outputs"]][-2:] == [
        "loss", "lr"]
    assert sum(n.startswith("params/") for n in names) == 62
    assert m["inputs"][-3]["shape"] == [1, 8, 32, 32, 3] and m["inputs"][-3]["spec"] == [None, "r"]
    for name, suffix in ((f"{EXAMPLE}.mlir", ".mlir"), (f"{EXAMPLE}.jaxexport", ".jaxexport")):
        with open(paths[suffix], "rb") as f:
            blob = f.read()
        assert m["files"][name] == {"bytes": len(blob),
                                    "sha256": hashlib.sha256(blob).hexdigest()}


def _example_inputs(seed=3):
    """A trained-looking state (BN randomised), one batch, a key: the tie's own set-up."""
    recipe = parse(EXAMPLE)
    cfg = tie.TieConfig(net=recipe.net, replicas=4, batch=2, res=32, classes=10, loss="ce",
                        precision="f64", seed=seed)
    net = get_net(recipe.net)
    params, buffers, _, _ = inputs.setup(cfg, net)
    opt = optim.for_recipe(recipe, params)
    # every counter (step, Adam's, the schedule's) at 5: past lr(0) = 0, so parameters move
    state = jax.tree.map(lambda a: jnp.full_like(a, 5) if a.dtype == jnp.int32 else a,
                         step.init_state(recipe, params, buffers, opt))
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.standard_normal((1, 8, 32, 32, 3)))
    ts = jnp.asarray(np.eye(10)[rng.integers(0, 10, (1, 8))])
    return cfg, net, recipe, opt, state, xs, ts, jax.random.key(seed)


@ON_EXAMPLE
@pytest.mark.slow
def test_a_fresh_process_runs_the_render_without_model_code(example_f64, tmp_path):
    """twinstep/rendering/runner.py, in a process that imports no twinstep module, runs one step of
    the deserialized render; its state is this process's run of the render, which
    `test_tie_render_ties_the_render` ties to the single-device Python step."""
    _, paths = example_f64
    _, _, _, _, state, xs, ts, key = _example_inputs()
    names = step.state_names(state)
    arrays = dict(zip(names, map(np.asarray, jax.tree.leaves(state)), strict=True))
    np.savez(tmp_path / "in.npz", xs=np.asarray(xs), ts=np.asarray(ts),
             key=np.asarray(jax.random.key_data(key)), **arrays)
    # both sides at -O0 (`dp.FAST_COMPILE`, the runner's --fast-compile): the step runs 3 times
    run = reader.step(*reader.load(paths[".jaxexport"]), fast_compile=True)
    ref, metrics = run(state, xs, ts, key)
    ref = jax.tree.map(bounds.host, ref)  # one host copy, not the R = 4 replicated state
    script = os.path.join(os.path.dirname(render.__file__), "runner.py")
    code = ("import runpy, sys\n"
            f"sys.argv = ['runner.py', {paths['.jaxexport']!r}, '--inputs', "
            f"{str(tmp_path / 'in.npz')!r}, '--outputs', {str(tmp_path / 'out.npz')!r}, "
            "'--fast-compile']\n"
            "try:\n"
            f"    runpy.run_path({script!r}, run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    assert e.code in (0, None), e.code\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'twinstep')\n"
            "assert not loaded, loaded\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    assert sorted(out) == sorted(names + ["loss", "lr"])
    # Not bit for bit (the two processes' runs differ in the last bits, e.g. bn1.bias), so held
    # to the whole-step tie's bound: max(1e-10, 10 x what a rounding-sized input nudge moves
    # the step by).
    u = jax.random.normal(jax.random.key(1), xs.shape, xs.dtype)
    nudged, _ = run(state, xs * (1 + bounds.perturbation(xs.dtype) * u), ts, key)
    nudged = jax.tree.map(bounds.host, nudged)
    ours = jax.tree.unflatten(jax.tree.structure(state), [out[n] for n in names])
    rows = trajectory.compare_states(ours, ref, (nudged,), bounds.F64_PARAM_BOUND)
    assert len(rows) == len(names) and all(r["ok"] for r in rows), [
        r for r in rows if not r["ok"]][:3]
    assert bounds.rel(out["loss"], metrics["loss"]) <= 1e-13
    assert int(out["step"]) == 6
    for name in ("params/fc.weight", "params/conv1.weight", "params/layer4.1.bn2.weight"):
        assert not np.array_equal(out[name], arrays[name]), name  # it stepped


def test_the_runner_compiles_fast_as_twinstep_does():
    from twinstep.rendering import runner
    assert runner.FAST_COMPILE == dp.FAST_COMPILE


def runner_statuses_wrong(source: str) -> list[str]:
    """How twinstep/rendering/runner.py (``source``, its text) departs from
    `twinstep.errors.ExitStatus`: it imports no twinstep, so it repeats the statuses it uses by
    name, and each must be the member of that name; every ``return`` of a status and every exit
    must give one of those names, never a bare number."""
    import ast

    tree = ast.parse(source)
    named, wrong = {}, []
    for node in tree.body:  # the module's SUCCESS, USAGE, ... = 0, 2, ...
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target, value = node.targets[0], node.value
        pairs = (zip(target.elts, value.elts, strict=False)
                 if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                 else [(target, value)])
        for t, v in pairs:
            if isinstance(t, ast.Name) and t.id in ExitStatus.__members__:
                named[t.id] = v.value if isinstance(v, ast.Constant) else None
    for name, value in named.items():
        if value != ExitStatus[name]:
            wrong.append(f"{name} = {value!r}, ExitStatus.{name} is {ExitStatus[name]:d}")
    for node in ast.walk(tree):
        given = (node.value if isinstance(node, ast.Return) else
                 node.args[0] if isinstance(node, ast.Call) and node.args
                 and ast.unparse(node.func) in ("sys.exit", "os._exit", "exit") else None)
        if isinstance(given, ast.Constant) and type(given.value) is int:  # not a bool
            wrong.append(f"line {node.lineno}: status {given.value}, not a name")
        elif isinstance(given, ast.Name) and given.id.isupper() and given.id not in named:
            wrong.append(f"line {node.lineno}: {given.id}, not one of the statuses it names")
    return wrong


def test_the_runner_exits_with_twinsteps_statuses(capsys):
    """runner.py's exit statuses are `ExitStatus`'s, by name and number; argparse's own errors
    exit with its USAGE too."""
    from twinstep.rendering import runner

    assert not runner_statuses_wrong(open(runner.__file__).read())
    assert {"SUCCESS", "USAGE", "INTERNAL", "INTERRUPTED"} <= set(vars(runner))
    with pytest.raises(SystemExit) as e:
        runner.main(["--no-such-flag"])
    assert e.value.code == runner.USAGE == ExitStatus.USAGE


def test_a_runner_status_other_than_twinsteps_fails_here():
    """The control: a changed number, two swapped, and a bare number in a return are caught."""
    from twinstep.rendering import runner

    source = open(runner.__file__).read()
    line = "SUCCESS, USAGE, INTERNAL, INTERRUPTED = 0, 2, 3, 130"
    assert line in source and "return INTERNAL" in source
    for old, new in ((line, line.replace("3, 130", "4, 130")),
                     (line, line.replace("2, 3", "3, 2")),
                     ("return INTERNAL", "return 3"),
                     ("return USAGE", "return 2")):
        assert runner_statuses_wrong(source.replace(old, new)), new


@ON_EXAMPLE
@pytest.mark.slow
def test_tie_render_ties_the_render(example_f64, tmp_path):
    """`twinstep tie --render`: the deserialized program against the single-device Python step,
    every state tensor after each of two steps. Its negative control, a render of the
    wrong-divisor bug tied the same way and NOT tied, runs across two processes
    (`tests/test_hosts.py`, `test_a_render_ties_across_processes_and_a_broken_one_fails_there`):
    the same comparison, reached through the launcher."""
    _, paths = example_f64
    report = tmp_path / "tie.json"
    assert cli.main(["tie", "--render", paths[".jaxexport"], "--steps", "2",
                     "--json", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["ok"] and rep["render"] == paths[".jaxexport"]
    # params (which move from the second step: lr(0) = 0), buffers, Adam's mu and nu, counts
    assert len(rep["steps"][1]["rows"]) == 229 and rep["steps"][1]["loss"]["ok"]


@ON_EXAMPLE
@pytest.mark.slow
def test_cli_render_usage_errors(tmp_path, example_f64, capsys):
    def fails(argv, text):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and text in capsys.readouterr().err, argv

    fails(["render", "--out", str(tmp_path)], "give a recipe NAME or --all")
    fails(["render", EXAMPLE, "--all", "--out", str(tmp_path)], "give a recipe NAME or --all")
    assert cli.main(["render", "resnet50in_adamdpx2", "--out", str(tmp_path)]) == 2
    assert "twinstep render:" in capsys.readouterr().err
    assert cli.main(["render", EXAMPLE, "--res", "48", "--out", str(tmp_path)]) == 2
    assert "multiple of 32" in capsys.readouterr().err
    fails(["tie", "resnet50", "--render", "x.jaxexport"], "drop net")
    fails(["tie", "--render", "x.jaxexport", "--replicas", "4"], "drop replicas")
    fails(["tie", "--render", "x.mlir"], "NAME.jaxexport")
    fails(["tie"], "the net is required")
    # an f32 render is not tied (the tie is exact in f64), and a tampered one is refused
    r = render.make(render.RenderConfig(EXAMPLE, 2, **SMALL))
    f32 = render.write(r, str(tmp_path / "f32"))
    assert cli.main(["tie", "--render", f32[".jaxexport"]]) == 2
    assert "--precision f64" in capsys.readouterr().err
    with open(f32[".jaxexport"], "ab") as f:
        f.write(b"\0")
    assert cli.main(["tie", "--render", f32[".jaxexport"]]) == 2
    assert "sha256" in capsys.readouterr().err
    (tmp_path / "file").write_text("")  # --out is a file: a clean error, nothing left behind
    assert cli.main(["render", EXAMPLE, "--out", str(tmp_path / "file"), "--res", "32"]) == 2
    assert "twinstep render:" in capsys.readouterr().err
    assert not list(tmp_path.glob("**/.twinstep-*"))


REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def committed_manifests() -> dict:
    """{name: manifest} of renders/, one per `render --all` name."""
    manifests = {}
    for name in render.all_names():
        with open(os.path.join(REPOSITORY, "renders", name + ".json")) as f:
            manifests[name] = json.load(f)
    return manifests


@pytest.mark.slow
def test_committed_manifests_are_current():
    """renders/ holds `render --all --replicas 4` manifests (the .mlir and .jaxexport are not
    committed): one per name, and each still describes what the code renders — signature,
    collectives, convolutions — checked here for the smallest of each net."""
    manifests = committed_manifests()
    for name in ("resnet50in_momdp64", "mnv4in_adamdp64"):
        m = manifests[name]
        fresh = render.make(render.RenderConfig(name, m["replicas"], res=m["res"],
                                                  classes=m["classes"], precision=m["precision"],
                                                  platform=m["platform"])).manifest
        for key in manifest.KEYS:
            if key not in ("versions", "files"):
                assert json.loads(json.dumps(fresh[key])) == m[key], (name, key)
    assert {m["replicas"] for m in manifests.values()} == {4}
    assert dp.AXIS == manifests["resnet50in_momdp64"]["mesh"]["axis"]


def test_the_manifest_table_of_docs_renders_matches_the_committed_manifests():
    """docs/renders.md's table of the committed manifests has one row per name, with each
    manifest's collective counts (in the text, the reference, per optimizer step with its MiB
    per replica) and its convolutions."""
    with open(os.path.join(REPOSITORY, "docs", "renders.md")) as f:
        text = f.read()
    for name, m in committed_manifests().items():
        c, per_step = m["collectives"], m["collectives"]["per_optimizer_step"]
        rows = [line for line in text.splitlines() if line.startswith(f"| `{name}` |")]
        assert len(rows) == 1, name
        assert f"| {c['in_text']} ({c['spec_reference']}) |" in rows[0], name
        mib = per_step["payload_bytes"] / 2**20
        assert f"| {per_step['count']}, {mib:.1f} MiB |" in rows[0], name
        convs = m["convolutions"]
        assert rows[0].endswith(f"| {convs['count']} {' '.join(convs['dtypes'])} |"), name


@ON_EXAMPLE
@pytest.mark.slow
def test_a_render_is_trusted_only_whole(example_f64, tmp_path):
    """Each way a render can be other than what its manifest says is refused at load, before
    anything runs, in one line: a field against the name, the .mlir's hash, a missing file, a
    corrupt program whose hash was made to match, a program for other devices; and
    twinstep/rendering/runner.py refuses the same sets (exit 2, one line)."""
    _, paths = example_f64
    script = os.path.join(os.path.dirname(render.__file__), "runner.py")

    def copy(edit_manifest=None, edit_files=None):
        folder = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        out = {s: str(folder / os.path.basename(p)) for s, p in paths.items()}
        blobs = {s: open(p, "rb").read() for s, p in paths.items()}
        if edit_files:
            edit_files(blobs)
        m = json.loads(blobs[".json"])
        for s in (".mlir", ".jaxexport"):  # hashes of what is there, unless the edit says not
            if blobs[s] is not None:
                m["files"][os.path.basename(out[s])]["sha256"] = hashlib.sha256(
                    blobs[s]).hexdigest()
        if edit_manifest:
            edit_manifest(m, blobs)
        blobs[".json"] = json.dumps(m).encode()
        for s, blob in blobs.items():
            if blob is not None:
                open(out[s], "wb").write(blob)
        return out[".jaxexport"]

    def stale_mlir(m, blobs):
        m["files"][os.path.basename(paths[".mlir"])]["sha256"] = "0" * 64

    cases = [
        (copy(lambda m, b: m.update(batch=3)), "contradicts its name"),
        (copy(lambda m, b: m.update(replicas="4")), "expected an int"),
        (copy(lambda m, b: m.pop("inputs")), "no 'inputs'"),
        (copy(stale_mlir), ".mlir: sha256 differs"),
        (copy(edit_files=lambda b: b.update({".mlir": None})), "cannot read"),
        (copy(edit_files=lambda b: b.update({".jaxexport": b"\0" * 64})), "deserialized"),
        (copy(lambda m, b: m.update(replicas=2, global_batch=4)), "runs on 4 devices"),
    ]
    for path, says in cases:
        with pytest.raises(RenderError, match=re.escape(says)):
            reader.load(path)
    assert reader.load(copy())  # the control: an untouched copy loads
    for path, _ in cases[3:6]:  # the runner needs no twinstep and refuses alike
        p = subprocess.run([sys.executable, script, path, "--inputs", "x.npz", "--outputs",
                            str(tmp_path / "o.npz")], capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert not (tmp_path / "o.npz").exists()


@ON_EXAMPLE
@pytest.mark.slow
@pytest.mark.all
def test_training_with_the_render_takes_the_python_steps(example_f64, tmp_path, monkeypatch):
    """`twinstep train --render`: two steps of the render's deserialized program on the
    digits end where two steps of the Python step do (the same recipe and schedule as
    rendered), every parameter within the tie's f64 floor (`_adam_param_errors`)."""
    from twinstep import api, recipes
    from twinstep.training import loop

    _, paths = example_f64
    common = {"replicas": 4, "batch": 2, "res": 32, "precision": "f64", "steps": 2,
              "eval_every": 2, "ckpt_every": 2}
    api.train(EXAMPLE, str(tmp_path / "render"), render=paths[".jaxexport"], **common)
    monkeypatch.setattr(loop.TrainConfig, "parsed_recipe",
                        lambda self: recipes.parse(self.recipe))  # the render's schedule
    api.train(EXAMPLE, str(tmp_path / "python"), **common)
    a, b = (load_state(tmp_path / d) for d in ("render", "python"))
    schedule = optim.recipe_schedule(parse(EXAMPLE))
    lr_sum = sum(float(schedule(t)) for t in range(2))
    errors = _adam_param_errors(a, b, lr_sum)
    assert len(errors) == 62 and max(errors.values()) <= 1e-10, max(errors.items(),
                                                                      key=lambda kv: kv[1])
    assert int(a["step"]) == 2
    # controls: a third step of the Python run moves the parameters far beyond that floor; so
    # does moving the noise elements of the tensor that has most (beside real ones) by lr each,
    # the size of a real element's step (Adam's normalised update is about 1)
    monkeypatch.setitem(common, "steps", 3)
    api.train(EXAMPLE, str(tmp_path / "python3"), **common)
    c = load_state(tmp_path / "python3")
    assert max(_adam_param_errors(c, b, lr_sum).values()) > 1e-6
    mu = _first_moments(b)
    name = max((k for k in mu if 0 < np.sum(_noise(mu[k])) < mu[k].size),
               key=lambda k: np.sum(_noise(mu[k])))
    moved = {**a, "params": {**a["params"], name: a["params"][name] + lr_sum * _noise(mu[name])}}
    seen = _adam_param_errors(moved, b, lr_sum)[name]
    print(f"render vs Python: worst {max(errors.values()):.1e}; {name}'s "
          f"{np.sum(_noise(mu[name]))} noise elements moved by lr: {seen:.1e}")
    assert np.sum(_noise(mu[name])) > 0 and seen > 1e-6


def _first_moments(state: dict) -> dict:
    """Adam's first moments (optax's mu) of a checkpoint."""
    return next(s for s in state["opt_state"] if isinstance(s, dict) and "mu" in s)["mu"]


def _noise(mu: np.ndarray) -> np.ndarray:
    """Where a first moment is rounding noise: elements at most the f64 floor times its norm."""
    return np.abs(mu) <= bounds.F64_PARAM_BOUND * np.linalg.norm(mu)


def _adam_param_errors(ours: dict, ref: dict, lr_sum: float) -> dict:
    """{parameter: error} of two checkpoints after AdamW steps (lr summing to ``lr_sum``):
    `bounds.grad_err`, but over the elements whose first moment in ``ref`` is rounding noise
    (`_noise`: ResNet's layer3 bn3 biases, where the residual's ReLU passes every row) apart.
    Adam divides that noise by sqrt(nu) + eps ~ eps, so they move by lr x noise / eps and two
    computations put them 1e-7 apart relative to the tensor (docs/tie.md#structural-zeros);
    they are held to the floor on the scale an element with the tensor's whole moment would
    move by, lr_sum x ||mu|| / eps."""
    mu, eps = _first_moments(ref), optim.EPS["adamw"]
    errors = {}
    for k, b in ref["params"].items():
        a, noise = ours["params"][k], _noise(mu[k])
        if not noise.any() or not np.any(mu[k]):
            errors[k] = bounds.grad_err(k, ours["params"], ref["params"])
            continue
        real = {**ref["params"], k: b[~noise]}
        errors[k] = bounds.grad_err(k, {k: a[~noise]}, real) if (~noise).any() else 0.0
        scale = lr_sum * np.linalg.norm(mu[k]) / eps
        errors[k] = max(errors[k], float(np.linalg.norm(a[noise] - b[noise]) / scale))
    return errors
