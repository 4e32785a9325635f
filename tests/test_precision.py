"""The bf16 policy (docs/precision.md), read off the StableHLO: every convolution — forward,
input-VJP, weight-VJP, dense and grouped depthwise — has bf16 operands AND a bf16-typed result; the
matmul dense path multiplies bf16 operands and rounds its results to bf16; f32 and f64 policies
have no bf16 at all. (XLA:CPU upcasts bf16 convolutions when it compiles, so the
compiled CPU HLO cannot show the policy; the StableHLO is where it is checked here.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from twinstep.errors import UsageError
from twinstep.ops import conv
from twinstep.ops.precision import BF16, F32, F64, get_precision

CONV_OP = re.compile(r"stablehlo\.convolution.*?:\s*\((.*?)\)\s*->\s*(\S+)")
DOT_OP = re.compile(r"stablehlo\.dot_general.*?:\s*\((.*?)\)\s*->\s*(\S+)")


def signatures(fn, *args, op=CONV_OP):
    """[(operand types, result type)] of every convolution (or ``op``) in fn's StableHLO."""
    text = jax.jit(fn).lower(*args).as_text()
    return [(ops, res) for ops, res in op.findall(text)]


def conv_and_vjps(x, w, stride, precision, depthwise, path=None):
    """(y, dx, dw); path: the depthwise or dense path (default: grouped / conv)."""
    if depthwise:
        y, res = conv.depthwise_forward(x, w, stride, precision, path=path or "grouped",
                                        crop_unread=True)
        return (y, *conv.depthwise_vjp(res, jnp.ones_like(y)))
    y, res = conv.conv2d_forward(x, w, stride, precision, path=path or "conv", crop_unread=True)
    return (y, *conv.conv2d_vjp(res, jnp.ones_like(y)))


@pytest.mark.parametrize("depthwise", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_bf16_convolutions_are_bf16_typed(depthwise, stride):
    x = jnp.ones((2, 8, 8, 4), jnp.float32)
    w = jnp.ones((4, 1 if depthwise else 4, 3, 3), jnp.float32)
    sigs = signatures(lambda x, w: conv_and_vjps(x, w, stride, BF16, depthwise), x, w)
    assert len(sigs) == 3  # forward, input-VJP, weight-VJP
    for operands, result in sigs:
        assert operands.count("bf16") == 2, operands
        assert "xbf16>" in result, result
    outs = conv_and_vjps(x, w, stride, BF16, depthwise)
    assert all(o.dtype == jnp.float32 for o in outs)  # converted back to f32


def test_bf16_matmul_path_multiplies_bf16_operands():
    """The matmul path's three products (forward, input-VJP, weight-VJP) take bf16 operands; its
    results are rounded to bf16 at the end (test_bf16_results_are_rounded_and_close)."""
    x = jnp.ones((2, 8, 8, 4), jnp.float32)
    w = jnp.ones((4, 4, 3, 3), jnp.float32)
    sigs = signatures(lambda x, w: conv_and_vjps(x, w, 2, BF16, False, "matmul"), x, w,
                      op=DOT_OP)
    assert len(sigs) == 3
    assert all(operands.count("bf16") == 2 for operands, _ in sigs), sigs


@pytest.mark.parametrize("precision", [F32, F64])
@pytest.mark.parametrize("path", conv.DENSE_PATHS)
def test_f32_f64_have_no_bf16(precision, path):
    x = jnp.ones((2, 8, 8, 4), precision.dtype)
    w = jnp.ones((4, 4, 3, 3), precision.dtype)
    text = jax.jit(lambda x, w: conv_and_vjps(x, w, 2, precision, False, path)
                   ).lower(x, w).as_text()
    assert "bf16" not in text


@pytest.mark.parametrize("depthwise,path", [(False, "conv"), (False, "matmul"),
                                            (True, "grouped"), (True, "shift")])
def test_bf16_results_are_rounded_and_close(depthwise, path, rng):
    """bf16 results are exactly bf16-representable and within bf16 resolution of f32."""
    x = jnp.asarray(rng.standard_normal((2, 7, 7, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 1 if depthwise else 4, 3, 3)), jnp.float32)
    lo = conv_and_vjps(x, w, 2, BF16, depthwise, path)
    hi = conv_and_vjps(x, w, 2, F32, depthwise, path)
    for a, b in zip(lo, hi, strict=True):
        np.testing.assert_array_equal(a, a.astype(jnp.bfloat16).astype(jnp.float32))
        err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert 0 < err < 2e-2  # bf16 has 8 significant bits; 0 would mean f32 ran


def test_unknown_precision_is_rejected():
    with pytest.raises(ValueError, match="unknown precision"):
        get_precision("fp8")


def _bn_inputs(net_name: str) -> list:
    """Every BN input [N, H, W, C] of a float64 forward (random-bn state, 4 rows of 32²)."""
    from twinstep import program
    from twinstep.checking import inputs, tie
    from twinstep.nets import get_net
    from twinstep.ops import batchnorm

    net = get_net(net_name)
    cfg = tie.TieConfig(net=net_name, replicas=1, batch=4, precision="f64")
    params, buffers, x, _ = inputs.setup(cfg, net)
    ctx = program.Setup(precision="f64").context()
    def bn_xs(p, b, x):
        tape = net.forward(p, b, x, ctx)[1]
        is_bn = lambda a: isinstance(a, batchnorm.BNRes)  # noqa: E731
        return [r.x for r in jax.tree.leaves(tape, is_leaf=is_bn) if is_bn(r)]

    return jax.jit(bn_xs)(params, buffers, x)


@pytest.mark.slow
@pytest.mark.parametrize("net_name", ["resnet50", "mnv4"])
def test_one_pass_moments_in_f32_round_far_below_bf16(net_name):
    """The GPU's one-pass BN moments (docs/precision.md#gpu-levers) in float32 on every BN input
    of a net: the variance's relative error against float64 two-pass stays under 2^-10, so the
    BN output's (half of it, through rstd) under an eighth of bf16's unit roundoff 2^-8, which
    the convolution feeding the BN already carries. Seen: ResNet-50 2.3e-4 (its inputs' channel
    means reach 44 standard deviations), MobileNetV4 2.9e-5; two-pass 2.1e-6, 4.5e-7. Control:
    the same inputs with each channel's mean moved to 300 standard deviations, where
    E[x^2] - E[x]^2 cancels, must break the bound (seen: 3.8e-2, 4.1e-2)."""
    from twinstep.ops.batchnorm import _shard_moments

    def worst(xs):
        errs = []
        for x in xs:
            truth = _shard_moments(x)[1]
            one = _shard_moments(x.astype(jnp.float32), "one-pass")[1]
            errs.append(float(jnp.max(jnp.abs(one - truth) / truth)))
        return max(errs)

    xs = _bn_inputs(net_name)
    assert len(xs) == {"resnet50": 53, "mnv4": 77}[net_name]
    assert worst(xs) < 2.0**-10
    shifted = [x + 300 * jnp.sqrt(_shard_moments(x)[1]) for x in xs]
    assert worst(shifted) > 2.0**-10


def test_bf16_storage_rounds_between_ops_and_reaches_both_nets(rng, grad_program_text):
    """``store="bf16"`` (docs/precision.md#bf16-storage): `precision.stored` rounds to bf16
    and keeps the dtype, once (idempotent), and is the identity without it; only bf16 may
    store in bf16 (`Levers.check`, for a program's `Setup` and a tie's config alike).
    Control: in each net's gradient step it adds bf16 rounding points between ops (the
    forward's outputs, the residual adds, the cotangent sums), so the switch is not a no-op, and
    each is a bf16 array behind an optimization barrier — what makes XLA:GPU hold it in bf16
    (bench/gpu/twin.py measures the bytes; tests/test_gpu_twin.py fails without the barrier)."""
    from twinstep import program
    from twinstep.checking import tie
    from twinstep.ops.levers import Levers
    from twinstep.ops.precision import stored

    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    y = stored(x, "bf16")
    assert y.dtype == jnp.float32 and np.array_equal(y, x.astype(jnp.bfloat16).astype(y.dtype))
    assert not np.array_equal(y, x) and np.array_equal(stored(y, "bf16"), y)
    assert stored(x, "dtype") is x
    for name in ("f32", "f64"):
        with pytest.raises(ValueError, match="only bf16 stores activations in bf16"):
            program.Setup(precision=name, levers=Levers(store="bf16"))
        with pytest.raises(UsageError, match="only bf16 stores activations in bf16"):
            tie.TieConfig(precision=name, levers=Levers(store="bf16"))
    to_bf16 = re.compile(r"stablehlo\.convert.*-> tensor<[^>]*bf16>")
    held = re.compile(r"stablehlo\.optimization_barrier %\S+ : tensor<[^>]*bf16>")
    for net_name in ("resnet50", "mnv4"):
        texts = [grad_program_text(net_name, program.Setup(precision="bf16",
                                                           levers=Levers(store=s)))
                 for s in ("dtype", "bf16")]
        counts = [len(to_bf16.findall(text)) for text in texts]
        assert counts[1] > counts[0] > 0, (net_name, counts)
        barriers = [len(held.findall(text)) for text in texts]
        assert barriers[0] == 0 and barriers[1] >= counts[1] - counts[0], (net_name, barriers)
