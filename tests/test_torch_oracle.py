"""The op library against PyTorch (an independent implementation): forward and autograd
gradients in float64, the max-pool tie-break, BatchNorm's running statistics, and timm's
loss modules."""

import jax.numpy as jnp
import numpy as np
import pytest
from oracle_libs import F, timm, torch

from twinstep.checking import oracle
from twinstep.ops import activation, batchnorm, conv, elementwise, loss, pool
from twinstep.ops.precision import F64

TOL = 1e-12
pytestmark = pytest.mark.oracle


def nchw(a):
    return torch.tensor(np.asarray(a).transpose(0, 3, 1, 2), requires_grad=True)


def nhwc(t):
    return t.detach().numpy().transpose(0, 2, 3, 1)


def _ours(op, x, g, b, dy):
    """(y, the input cotangents) of twinstep's op ``op`` at NHWC x, gate g [N, C], bias b [C]."""
    x, g, b, dy = map(jnp.asarray, (x, g, b, dy))
    if op in ("relu6", "silu"):
        y, res = getattr(activation, f"{op}_forward")(x)
        return y, (getattr(activation, f"{op}_vjp")(res, dy),)
    if op == "sigmoid":
        y, s = activation.sigmoid_forward(x)
        return y, (activation.sigmoid_vjp(s, dy),)
    if op == "gate":
        y, res = elementwise.gate_forward(x, g)
        return y, elementwise.gate_vjp(res, dy)
    return elementwise.bias_forward(x, b), elementwise.bias_vjp(dy)


@pytest.mark.parametrize("op", ["relu6", "silu", "sigmoid", "gate", "bias"])
def test_the_mobile_nets_ops_match_torch(op, rng):
    """ReLU6 (F.relu6, whose gradient is 0 at both edges: x = 0 and 6 are in the draw), SiLU,
    the sigmoid, squeeze-excite's gate x * g[:, :, None, None] and a convolution's bias, each
    against torch autograd: forward and every input's gradient. Control: ReLU6's gradient taken
    as 1 at x = 6 (a mask x <= 6) differs from torch's there."""
    x = 4 * rng.standard_normal((2, 5, 5, 8))
    x[0, 0, 0, :2] = (0.0, 6.0)  # the edges, where a mask with <= differs
    g, b, dy = rng.uniform(size=(2, 8)), rng.standard_normal(8), rng.standard_normal(x.shape)
    y, grads = _ours(op, x, g, b, dy)
    tx = nchw(x)
    tg, tb = (torch.tensor(v, requires_grad=True) for v in (g, b))
    ty = {"relu6": lambda: F.relu6(tx), "silu": lambda: F.silu(tx),
          "sigmoid": lambda: torch.sigmoid(tx), "gate": lambda: tx * tg[:, :, None, None],
          "bias": lambda: tx + tb[None, :, None, None]}[op]()
    ty.backward(torch.tensor(dy.transpose(0, 3, 1, 2)))
    theirs = [nhwc(tx.grad), *([tg.grad.numpy()] if op == "gate" else []),
              *([tb.grad.numpy()] if op == "bias" else [])]
    assert oracle.rel_err(y, nhwc(ty)) < TOL
    assert len(grads) == len(theirs)
    for ours, ref in zip(grads, theirs, strict=True):
        assert oracle.rel_err(ours, ref) < TOL
    if op == "relu6":
        wrong = jnp.where((jnp.asarray(x) > 0) & (jnp.asarray(x) <= 6), jnp.asarray(dy), 0.0)
        assert oracle.rel_err(wrong, nhwc(tx.grad)) > 1e-3


@pytest.mark.parametrize("k,s", [(1, 1), (1, 2), (3, 1), (3, 2), (5, 2), (7, 2)])
@pytest.mark.parametrize("kind", [*conv.DENSE_PATHS, *conv.DEPTHWISE_PATHS])
def test_conv_matches_torch(k, s, kind, rng):
    c = 4
    dense = kind in conv.DENSE_PATHS
    x = rng.standard_normal((2, 9, 9, c))
    w = rng.standard_normal((c, c if dense else 1, k, k))
    dy = rng.standard_normal((2, conv.conv_out_size(9, k, s), conv.conv_out_size(9, k, s), c))
    if dense:
        y, res = conv.conv2d_forward(jnp.asarray(x), jnp.asarray(w), s, F64, path=kind,
                                     crop_unread=True)
        dx, dw = conv.conv2d_vjp(res, jnp.asarray(dy))
    else:
        y, res = conv.depthwise_forward(jnp.asarray(x), jnp.asarray(w), s, F64, path=kind,
                                        crop_unread=True)
        dx, dw = conv.depthwise_vjp(res, jnp.asarray(dy))
    tx, tw = nchw(x), torch.tensor(w, requires_grad=True)
    ty = F.conv2d(tx, tw, stride=s, padding=conv.conv_padding(k),
                  groups=1 if dense else c)
    ty.backward(torch.tensor(dy.transpose(0, 3, 1, 2)))
    assert oracle.rel_err(y, nhwc(ty)) < TOL
    assert oracle.rel_err(dx, nhwc(tx.grad)) < TOL
    assert oracle.rel_err(dw, tw.grad.numpy()) < TOL


def test_maxpool_matches_torch_on_random_input(rng):
    x = rng.standard_normal((2, 9, 8, 3))
    dy = rng.standard_normal((2, 5, 4, 3))
    y, res = pool.maxpool_forward(jnp.asarray(x))
    tx = nchw(x)
    ty = F.max_pool2d(tx, 3, 2, 1)
    ty.backward(torch.tensor(dy.transpose(0, 3, 1, 2)))
    assert oracle.rel_err(y, nhwc(ty)) == 0.0
    assert oracle.rel_err(pool.maxpool_vjp(res, jnp.asarray(dy)), nhwc(tx.grad)) < TOL


@pytest.mark.parametrize("pattern", ["constant", "two-level", "integers"])
def test_maxpool_ties_go_to_the_first_maximum(pattern, rng):
    """Windows with several equal maxima: the whole cotangent goes to the first (row-major),
    exactly as PyTorch's CPU kernel routes it."""
    shape = (2, 7, 7, 2)
    x = {"constant": np.ones(shape),
         "two-level": (rng.uniform(size=shape) > 0.5).astype(np.float64),
         "integers": rng.integers(0, 3, shape).astype(np.float64)}[pattern]
    y, res = pool.maxpool_forward(jnp.asarray(x))
    dy = rng.integers(-8, 9, y.shape).astype(np.float64)  # exact sums: routing compared exactly
    dx = pool.maxpool_vjp(res, jnp.asarray(dy))
    tx = nchw(x)
    F.max_pool2d(tx, 3, 2, 1).backward(torch.tensor(dy.transpose(0, 3, 1, 2)))
    np.testing.assert_array_equal(np.asarray(dx), nhwc(tx.grad))
    # And against the convention written out: first maximum in the window, row-major.
    ref = np.zeros_like(x)
    for n, i, j, c in np.ndindex(*y.shape):
        win = [(a, b) for a in range(2 * i - 1, 2 * i + 2) for b in range(2 * j - 1, 2 * j + 2)
               if 0 <= a < 7 and 0 <= b < 7]
        a, b = max(win, key=lambda ab: (x[n, ab[0], ab[1], c], -win.index(ab)))
        ref[n, a, b, c] += dy[n, i, j, c]
    np.testing.assert_array_equal(np.asarray(dx), ref)


def test_batchnorm_train_matches_torch(rng):
    x = rng.standard_normal((4, 5, 5, 3)) * 2 + 1
    g, b = rng.standard_normal(3), rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    dy = rng.standard_normal(x.shape)
    y, res, stats = batchnorm.bn_train_forward(jnp.asarray(x), jnp.asarray(g), jnp.asarray(b),
                                               moments="two-pass")
    dx, dg, db = batchnorm.bn_train_vjp(res, jnp.asarray(dy))
    new_rm, new_rv = batchnorm.bn_running_update(jnp.asarray(rm), jnp.asarray(rv), stats)

    tx = nchw(x)
    tg, tb = torch.tensor(g, requires_grad=True), torch.tensor(b, requires_grad=True)
    trm, trv = torch.tensor(rm), torch.tensor(rv)
    ty = F.batch_norm(tx, trm, trv, tg, tb, training=True, momentum=0.1, eps=1e-5)
    ty.backward(torch.tensor(dy.transpose(0, 3, 1, 2)))
    assert oracle.rel_err(y, nhwc(ty)) < TOL
    assert oracle.rel_err(dx, nhwc(tx.grad)) < 1e-10
    assert oracle.rel_err(dg, tg.grad.numpy()) < TOL
    assert oracle.rel_err(db, tb.grad.numpy()) < TOL
    assert oracle.rel_err(new_rm, trm.numpy()) < TOL
    assert oracle.rel_err(new_rv, trv.numpy()) < TOL  # unbiased variance in the buffer


def test_batchnorm_eval_matches_torch(rng):
    x = rng.standard_normal((2, 4, 4, 3))
    g, b = rng.standard_normal(3), rng.standard_normal(3)
    rm, rv = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    y, _ = batchnorm.bn_eval_forward(*(jnp.asarray(a) for a in (x, g, b, rm, rv)))
    ty = F.batch_norm(nchw(x), torch.tensor(rm), torch.tensor(rv), torch.tensor(g),
                      torch.tensor(b), training=False, eps=1e-5)
    assert oracle.rel_err(y, nhwc(ty)) < TOL


@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_smoothed_ce_matches_timm(alpha, rng):
    z = rng.standard_normal((6, 10)) * 3
    labels = rng.integers(0, 10, 6)
    value, dz = loss.smoothed_ce(jnp.asarray(z), jnp.asarray(np.eye(10)[labels]), alpha)
    tz = torch.tensor(z, requires_grad=True)
    crit = timm.loss.LabelSmoothingCrossEntropy(alpha) if alpha else torch.nn.CrossEntropyLoss()
    tl = crit(tz, torch.tensor(labels))
    tl.backward()
    assert abs(float(value) - tl.item()) < TOL * abs(tl.item())
    assert oracle.rel_err(dz, tz.grad.numpy()) < TOL


@pytest.mark.parametrize("smoothing,thresh", [(0.0, None), (0.1, None), (0.1, 0.2), (0.0, 0.2)])
def test_bce_matches_timm(smoothing, thresh, rng):
    z = rng.standard_normal((6, 10)) * 3
    labels = rng.integers(0, 10, 6)
    t = loss.bce_targets(jnp.asarray(np.eye(10)[labels]), smoothing, thresh)
    value, dz = loss.bce(jnp.asarray(z), t)
    tz = torch.tensor(z, requires_grad=True)
    crit = timm.loss.BinaryCrossEntropy(smoothing=smoothing, target_threshold=thresh)
    tl = crit(tz, torch.tensor(labels))
    tl.backward()
    assert abs(float(value) - tl.item()) < TOL * abs(tl.item())
    assert oracle.rel_err(dz, tz.grad.numpy()) < TOL


def test_bce_is_stable_for_large_logits():
    z = jnp.asarray([[800.0, -800.0, 0.0]])
    value, dz = loss.bce(z, jnp.asarray([[1.0, 0.0, 0.5]]))
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(dz)))
