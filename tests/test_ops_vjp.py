"""Every op's hand-written VJP against jax.vjp (<= 1e-12) and central finite differences
(<= 1e-6), float64, on shapes drawn by hypothesis (derandomized: CI draws the same ones)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from twinstep.checking import cases, oracle
from twinstep.errors import UsageError
from twinstep.ops import conv, windows

batch = st.integers(1, 4)
channels = st.integers(1, 8)
spatial = st.integers(1, 9)
kernel = st.sampled_from([1, 3, 5, 7])
stride = st.sampled_from([1, 2])
seed = st.integers(0, 2**31 - 1)


def certify(case, seed):
    # A stream independent of the one that drew the inputs: a cotangent equal to the input
    # would lie in BN's near-null space span{1, xhat} and test cancellation, not the VJP.
    rng = np.random.default_rng([seed, 1])
    for check in (oracle.check_vjp(case, rng), oracle.check_fd(case, rng)):
        assert check.ok, check


@given(n=batch, h=spatial, ci=channels, co=channels, k=kernel, s=stride, seed=seed,
       path=st.sampled_from(["conv", "matmul"]))
def test_conv2d(n, h, ci, co, k, s, seed, path):
    certify(cases.conv_case(np.random.default_rng(seed), n, h, c_in=ci, c_out=co, k=k, stride=s,
                            path=path), seed)


@given(n=batch, h=spatial, c=channels, k=kernel, s=stride, seed=seed,
       path=st.sampled_from(conv.DEPTHWISE_PATHS))
def test_depthwise(n, h, c, k, s, seed, path):
    certify(cases.conv_case(np.random.default_rng(seed), n, h, c_in=c, c_out=c, k=k, stride=s,
                            depthwise=True, path=path), seed)


@settings(max_examples=30)
@given(k=st.sampled_from([1, 2, 3, 5]), s=st.sampled_from([1, 2, 3]), h=spatial, seed=seed)
def test_scatter_windows_is_the_sum_of_its_taps_scatters(k, s, h, seed):
    """The phase-by-phase transpose of all k x k windows equals, bit for bit, the tap-by-tap
    sum it replaces (the same products, added in the same order), k < s included."""
    p, rng = (k - 1) // 2, np.random.default_rng(seed)
    ho, wo = (h + 2 * p - k) // s + 1, (h + 1 + 2 * p - k) // s + 1
    assume(ho >= 1)
    taps = {(a, b): jnp.asarray(rng.standard_normal((2, ho, wo, 3)))
            for a in range(k) for b in range(k)}
    hp, wp = h + 2 * p, h + 1 + 2 * p

    @jax.jit  # one program an example: its eager ops compiled one by one took 3x as long
    def both(taps):
        return (sum(windows.scatter_window(t, a, b, hp, wp, s=s) for (a, b), t in taps.items()),
                windows.scatter_windows(lambda a, b: taps[a, b], k, hp, wp, s))

    tap_by_tap, by_phase = both(taps)
    np.testing.assert_array_equal(np.asarray(by_phase), np.asarray(tap_by_tap))


@given(n=st.integers(2, 4), h=spatial, c=channels, seed=seed)
def test_batchnorm_train(n, h, c, seed):
    assume(n * h * h >= 3)  # two rows are degenerate: see test_batchnorm_two_rows
    certify(cases.bn_train_case(np.random.default_rng(seed), n, h, c), seed)


@pytest.mark.parametrize("seed", range(4))
def test_batchnorm_two_rows(seed):
    """With m = N*H*W = 2 rows per channel the normalised output is +-1 up to eps: BN's input
    gradient is O(eps / var) of the terms that cancel in it, so its norm-relative error is
    amplified by ~var / eps (seen: 8e-12 at 1e-12). The claim that holds is on the scale of those
    terms, ||rstd * gamma * dy||: both VJPs agree to 1e-12 of it, and the gamma, beta nodes
    (no cancellation) to 1e-12 as usual."""
    rng = np.random.default_rng(seed)
    case = cases.bn_train_case(rng, 2, 1, 5)
    y, res = case.forward(oracle.SINGLE, case.batch, case.masks, case.params)
    dy = oracle._cotangent(rng, y)
    (dx,), (dg, db) = case.vjp(res, dy)
    _, pullback = jax.vjp(lambda b, p: case.forward(oracle.SINGLE, b, (), p)[0], case.batch,
                          case.params)
    (rdx,), (rdg, rdb) = pullback(dy)
    scale = float(jnp.linalg.norm(res.rstd * res.gamma * dy))
    assert float(jnp.linalg.norm(dx - rdx)) <= oracle.TOL_VJP * scale
    assert oracle.rel_err(dg, rdg) <= oracle.TOL_VJP and oracle.rel_err(db, rdb) <= oracle.TOL_VJP


@given(n=batch, h=spatial, c=channels, seed=seed)
def test_batchnorm_eval(n, h, c, seed):
    certify(cases.bn_eval_case(np.random.default_rng(seed), n, h, c), seed)


@settings(max_examples=66)  # eleven ops share the draws
@given(n=batch, h=spatial, c=channels, seed=seed,
       op=st.sampled_from(["relu", "maxpool", "gap", "add", "drop-path", "dropout", "relu6",
                           "silu", "sigmoid", "gate", "bias"]))
def test_elementwise_and_pooling(n, h, c, seed, op):
    rng = np.random.default_rng(seed)
    case = {"relu": lambda: cases.relu_case(rng, n, h, c),
            "relu6": lambda: cases.relu6_case(rng, n, h, c),
            "silu": lambda: cases.silu_case(rng, n, h, c),
            "sigmoid": lambda: cases.sigmoid_case(rng, n, c),
            "gate": lambda: cases.gate_case(rng, n, h, c),
            "bias": lambda: cases.bias_case(rng, n, h, c),
            "maxpool": lambda: cases.maxpool_case(rng, n, h, c),
            "gap": lambda: cases.gap_case(rng, n, h, c),
            "add": lambda: cases.add_case(rng, n, h, c),
            "drop-path": lambda: cases.mask_case(rng, n, h, c, per_example=True),
            "dropout": lambda: cases.mask_case(rng, n, h, c, per_example=False)}[op]()
    certify(case, seed)


@given(n=batch, d=channels, k=channels, seed=seed)
def test_dense(n, d, k, seed):
    certify(cases.dense_case(np.random.default_rng(seed), n, d, k), seed)


@given(n=batch, k=st.integers(2, 12), seed=seed, kind=st.sampled_from(["ce", "bce"]))
def test_losses(n, k, seed, kind):
    certify(cases.loss_case(np.random.default_rng(seed), n, k, kind), seed)


def test_the_checks_can_fail(rng):
    """A VJP that is wrong by a transposed kernel must fail both certifications."""
    case = cases.conv_case(rng, 2, 5, c_in=3, c_out=3, k=3, stride=1)
    wrong = cases.Case(case.name, case.forward,
                        lambda res, dy: ((case.vjp(res, dy)[0][0],),
                                         (case.vjp(res, dy)[1][0].transpose(1, 0, 2, 3),)),
                        case.batch, case.masks, case.params)
    assert not oracle.check_vjp(wrong, rng).ok
    assert not oracle.check_fd(wrong, rng).ok


@pytest.mark.parametrize("depthwise", [False, True])
def test_uncropped_padding_is_the_same_forward(depthwise):
    """A strided convolution padded p on both sides (`Setup.crop_unread` False, the GPU lever)
    gives the cropped forward's output bit for bit, f64 and bf16, where a padded row goes
    unread (H = 10 at k = 3, s = 2; H = 9 reads every row); its VJPs are the same functions of
    the same residuals. Control: the two programs differ in their padding exactly where a row
    goes unread, so the switch is not a no-op; and a net's program takes it."""
    from twinstep import program
    from twinstep.nets import get_net
    from twinstep.ops import conv
    from twinstep.ops.levers import Levers
    from twinstep.ops.precision import BF16, F64
    from twinstep.processes import settings

    rng = np.random.default_rng(0)
    forward = conv.depthwise_forward if depthwise else conv.conv2d_forward
    path = "grouped" if depthwise else "conv"
    for h, precision in ((9, F64), (10, F64), (10, BF16)):
        x = jnp.asarray(rng.standard_normal((2, h, h, 4)), precision.dtype)
        w = jnp.asarray(rng.standard_normal((4, 1 if depthwise else 4, 3, 3)), precision.dtype)

        def run(crop, x=x, w=w, precision=precision):
            return jax.jit(lambda x, w: forward(x, w, 2, precision, path=path,
                                                crop_unread=crop)[0])

        with settings.jax_settings(jax_enable_x64=precision is F64):
            assert np.array_equal(run(True)(x, w), run(False)(x, w))
            texts = [run(crop).lower(x, w).as_text() for crop in (True, False)]
        assert (texts[0] != texts[1]) == (h % 2 == 0)  # control: only an unread row differs
    net = get_net("mnv4")
    p, b = program.abstract_params(net, 10, jnp.float32)
    x = jax.ShapeDtypeStruct((1, 32, 32, 3), jnp.float32)
    levers = [Levers(depthwise_path="grouped", dense_path="conv", crop_unread=crop)
              for crop in (True, False)]
    texts = [program.eval_program(net, program.Setup(levers=lv)).lower(p, b, x).as_text()
             for lv in levers]
    assert texts[0] != texts[1]  # control: the switch reaches the net's convolutions


@pytest.mark.parametrize("k", [3, 5])
def test_phased_depthwise_input_vjp_reads_no_dilated_cotangent(k):
    """The phased path's strided input VJP (twinstep.ops.conv) is the grouped path's up to
    summation order (f64, 1e-15, the phases' sizes with and without an unread row; the VJP
    itself is certified with every path in test_depthwise) and convolves the cotangent
    undilated, in s^2 = 4 stride-1 convolutions. Control: the grouped path's one convolution
    dilates it; and at stride 1 the two paths are one program."""
    from twinstep.ops import conv
    from twinstep.ops.precision import F64
    from twinstep.processes import settings

    rng = np.random.default_rng(k)
    with settings.jax_settings(jax_enable_x64=True):
        for h, s in ((9, 2), (10, 2), (9, 1)):
            x = jnp.asarray(rng.standard_normal((2, h, h, 3)))
            w = jnp.asarray(rng.standard_normal((3, 1, k, k)))
            dy = jnp.asarray(rng.standard_normal((2, conv.conv_out_size(h, k, s),
                                                  conv.conv_out_size(h, k, s), 3)))
            res = {path: conv.depthwise_forward(x, w, s, F64, path=path, crop_unread=True)[1]
                   for path in ("grouped", "phased")}
            dx = jax.jit(lambda res, dy: conv.depthwise_vjp(res, dy)[0])
            np.testing.assert_allclose(dx(res["phased"], dy), dx(res["grouped"], dy),
                                       rtol=0, atol=1e-15 * float(jnp.max(jnp.abs(dy))) * k * k)
            texts = {path: dx.lower(r, dy).as_text() for path, r in res.items()}
            if s == 1:
                assert texts["phased"] == texts["grouped"]
                continue
            assert "lhs_dilate = [2, 2]" in texts["grouped"]  # control
            assert "lhs_dilate = [2, 2]" not in texts["phased"]
            assert texts["phased"].count("stablehlo.convolution") == 4


def test_one_pass_depthwise_weight_vjp_reduces_once():
    """The shift-one-pass path's weight VJP (twinstep.ops.conv) is the shift path's up to
    summation order (f64, 1e-13 of its largest element) and is one reduction of all k^2 taps'
    products. Control: the shift path's takes k^2 = 25."""
    from twinstep.ops.precision import F64
    from twinstep.processes import settings

    rng = np.random.default_rng(0)
    with settings.jax_settings(jax_enable_x64=True):
        x = jnp.asarray(rng.standard_normal((2, 9, 9, 3)))
        w = jnp.asarray(rng.standard_normal((3, 1, 5, 5)))
        dy = jnp.asarray(rng.standard_normal((2, 5, 5, 3)))
        res = {path: conv.depthwise_forward(x, w, 2, F64, path=path, crop_unread=True)[1]
               for path in ("shift", "shift-one-pass")}
        dw = jax.jit(lambda res, dy: conv.depthwise_vjp(res, dy)[1])
        want = dw(res["shift"], dy)
        np.testing.assert_allclose(dw(res["shift-one-pass"], dy), want, rtol=0,
                                   atol=1e-13 * float(jnp.max(jnp.abs(want))))
        reductions = {path: dw.lower(r, dy).as_text().count("stablehlo.reduce")
                      for path, r in res.items()}
    assert reductions == {"shift": 25, "shift-one-pass": 1}


def test_a_gpu_takes_its_levers_and_every_other_platform_the_others():
    """Levers left None take the platform's (docs/precision.md#gpu-levers): a GPU's (jax's gpu,
    jax.export's cuda and rocm) run the conv paths cuDNN takes, pad both sides and take
    one-pass BN moments, this CPU's its fast conv paths, crop and take two-pass; `twinstep tie
    --gpu-levers` builds a GPU's, ``--depthwise-path`` overrides its path; one-pass moments
    equal two-pass in f64 to rounding, and an unknown value is refused in one line. Control:
    the two moments' programs differ, so the lever is not a no-op."""
    from twinstep import program
    from twinstep.checking import tie
    from twinstep.ops import batchnorm
    from twinstep.ops.levers import Levers
    from twinstep.ops.precision import BF16

    gpu, cpu = Levers.of("gpu"), Levers.of("cpu")
    assert all(Levers.of(p) == gpu for p in ("cuda", "rocm")) and Levers().on() == cpu
    assert (gpu.crop_unread, gpu.bn_moments, gpu.dense_path) == (False, "one-pass", "conv")
    assert (cpu.crop_unread, cpu.bn_moments, cpu.dense_path) == (True, "two-pass", "matmul")
    assert program.Setup().context().levers == cpu
    assert program.Setup(levers=Levers(bn_moments="one-pass")).context().levers == \
        dataclasses.replace(cpu, bn_moments="one-pass")
    for on_gpu, want in ((True, gpu), (False, cpu)):
        cfg = tie.TieConfig(levers=Levers.chosen(gpu=on_gpu))  # `twinstep tie --gpu-levers`
        for ctx in (cfg.setup(BF16).context(), cfg.setup(BF16).single().context()):
            assert ctx.levers == want
        cfg = tie.TieConfig(levers=Levers.chosen(gpu=on_gpu, depthwise_path="phased"))
        assert cfg.setup(BF16).context().levers == dataclasses.replace(want,
                                                                       depthwise_path="phased")
    with pytest.raises(UsageError, match="unknown depthwise_path 'dilated'; choose from shift"):
        Levers(depthwise_path="dilated")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 3, 3, 5)) * 3 + 2)
    two, one = (jax.jit(lambda x, m=m: batchnorm.bn_forward_site(x, moments=m)) for m in
                batchnorm.MOMENTS)
    np.testing.assert_allclose(one(x).var, two(x).var, rtol=1e-13)
    np.testing.assert_array_equal(one(x).mean, two(x).mean)
    assert one.lower(x).as_text() != two.lower(x).as_text()  # control
    with pytest.raises(ValueError, match="unknown BN moments"):
        batchnorm.bn_forward_site(x, moments="three-pass")


def test_a_lever_is_one_field_that_flags_summaries_and_sweeps_are_made_from(monkeypatch):
    """`twinstep tie`'s lever flags (`twinstep.cli.options.levers`), its summary line and the
    lease's A/B list are generated from `Levers`' fields: one flag per field with its choices,
    the summary as each field says it, one A/B entry per candidate value. Control: a lever
    added as one field — no other line — gets its flag, its summary and its A/B entry, and an
    unknown value of it is refused."""
    import argparse

    from twinstep.cli import options
    from twinstep.ops import levers as levers_module
    from twinstep.ops.levers import Levers, lever

    def flags():
        p = argparse.ArgumentParser()
        options.levers(p, "both programs")
        return {a.option_strings[0]: a.choices for a in p._actions if a.option_strings}

    got = flags()
    assert list(got) == ["-h", "--gpu-levers", *("--" + f.name.replace("_", "-")
                                                 for f in dataclasses.fields(Levers))]
    assert got["--relu-mask"] == ("bool", "bits")
    assert Levers.chosen(gpu=True, store="bf16").describe() == "a GPU's levers, stored in bf16"
    assert Levers(relu_mask="bits").describe() == "ReLU masks as bits"
    assert levers_module.candidates()["relu_mask=bits"] == {"relu_mask": "bits"}

    new = dataclasses.make_dataclass(  # the control: one lever more, one field
        "Levers", [("tile", "str | None", lever(cpu="8", gpu="16", choices=("8", "16"),
                                                 says="tiles of {}", candidates=("16",),
                                                 help="a made-up lever"))],
        bases=(Levers,), frozen=True, kw_only=True)
    monkeypatch.setattr(levers_module, "Levers", new)
    assert flags()["--tile"] == ("8", "16")
    assert levers_module.candidates()["tile=16"] == {"tile": "16"}
    assert new(tile="16").describe() == "tiles of 16"
    assert new.chosen(gpu=True).tile == "16" and new.chosen(gpu=True).describe() == "a GPU's levers"
    args = {"gpu_levers": None, "tile": "16"}
    assert options.chosen_levers(args) == new(tile="16") and args == {}
    with pytest.raises(UsageError, match="unknown tile '4'"):
        new(tile="4")


def test_relu_masks_as_bits_are_the_same_masks_in_an_eighth_of_the_bytes(grad_program_text):
    """``relu_mask="bits"`` (docs/precision.md#relu-masks-as-bits): ReLU's packed mask gives the
    same output and the same VJP, exactly, as its bool mask, in an eighth of the bytes; a
    channel count that is no multiple of 8 keeps bools; both nets' programs keep their masks
    packed (uint8 in the StableHLO) only when asked; an unknown kind is refused. Controls:
    the same bits read in the opposite order give another VJP (random masks: about half the
    elements differ), and the bool programs hold no uint8."""
    import re

    from twinstep import program
    from twinstep.ops import activation
    from twinstep.ops.levers import Levers

    rng = np.random.default_rng(0)
    x, dy = (jnp.asarray(rng.standard_normal((2, 5, 5, 24))) for _ in range(2))
    (y, bools), (y_bits, bits) = (activation.relu_forward(x, m) for m in ("bool", "bits"))
    np.testing.assert_array_equal(y_bits, y)
    np.testing.assert_array_equal(activation.relu_vjp(bits, dy), activation.relu_vjp(bools, dy))
    assert bits.dtype == jnp.uint8 and bits.nbytes * 8 == bools.nbytes
    assert activation.relu_forward(x[..., :12], "bits")[1].dtype == jnp.bool_
    flipped = (bits[..., None] >> (7 - jnp.arange(8, dtype=jnp.uint8))) & 1  # the control
    wrong = jnp.where(flipped.astype(bool).reshape(dy.shape), dy, 0)
    assert float(jnp.mean(wrong != activation.relu_vjp(bools, dy))) > 0.25
    u8 = re.compile(r"tensor<[0-9x]*xui8>")
    for net_name in ("resnet50", "mnv4"):
        found = [len(u8.findall(grad_program_text(
            net_name, program.Setup(levers=Levers(relu_mask=m))))) for m in (None, "bits")]
        assert found[0] == 0 < found[1], (net_name, found)
    with pytest.raises(UsageError, match="unknown relu_mask 'nibbles'; choose from bool, bits"):
        Levers(relu_mask="nibbles")
