"""The op library's certification cases (`twinstep.checking.oracle` checks them): each op at
one shape as a `Case` — its product forward and hand-written VJP, with float64 inputs split into
batch tensors, masks and parameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from twinstep.collectives import Replicas
from twinstep.ops import activation, batchnorm, conv, dense, elementwise, loss, pool
from twinstep.ops.levers import Levers
from twinstep.ops.precision import F64


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at one shape.

    forward(replicas, batch, masks, params) -> (y, residuals);
    vjp(residuals, dy) -> (d batch, d params), tuples in the order of the inputs.
    """

    name: str
    forward: Callable
    vjp: Callable
    batch: tuple
    masks: tuple = ()
    params: tuple = ()
    per_example: bool = True  # output is batch-shaped (False: a scalar loss)



def normal(rng, shape, shift=0.0):
    return jnp.asarray(rng.standard_normal(shape) + shift, jnp.float64)


def conv_case(rng, n, h, *, c_in, c_out, k, stride, depthwise=False, path=None) -> Case:
    """``path`` None: the platform's (`Levers`)."""
    x = normal(rng, (n, h, h, c_in))
    levers = Levers().on()
    if depthwise:
        w = normal(rng, (c_in, 1, k, k))
        path = path or levers.depthwise_path

        def fwd(rep, b, m, p):
            return conv.depthwise_forward(b[0], p[0], stride, F64, path=path,
                                          crop_unread=levers.crop_unread)

        def vjp(res, dy):
            dx, dw = conv.depthwise_vjp(res, dy)
            return (dx,), (dw,)

        name = f"depthwise[{path}] k{k} s{stride}"
    else:
        w = normal(rng, (c_out, c_in, k, k)) / np.sqrt(c_in * k * k)
        path = path or levers.dense_path

        def fwd(rep, b, m, p):
            return conv.conv2d_forward(b[0], p[0], stride, F64, path=path,
                                       crop_unread=levers.crop_unread)

        def vjp(res, dy):
            dx, dw = conv.conv2d_vjp(res, dy)
            return (dx,), (dw,)

        name = f"conv2d[{path}] k{k} s{stride}"
    return Case(name, fwd, vjp, (x,), (), (w,))


def _bn_case_vjp(bn_vjp):
    """A BN VJP's (dx, d gamma, d beta) as a Case's (d batch, d params)."""
    def vjp(res, dy):
        dx, dg, db = bn_vjp(res, dy)
        return (dx,), (dg, db)

    return vjp


def bn_train_case(rng, n, h, c) -> Case:
    x = normal(rng, (n, h, h, c), 0.5)
    gamma, beta = normal(rng, (c,), 1.0), normal(rng, (c,))

    def fwd(rep, b, m, p):
        y, res, _ = batchnorm.bn_train_forward(b[0], p[0], p[1], rep,
                                               moments=Levers().on().bn_moments)
        return y, res

    return Case("batchnorm train", fwd, _bn_case_vjp(batchnorm.bn_train_vjp), (x,), (),
                (gamma, beta))


def bn_eval_case(rng, n, h, c) -> Case:
    x = normal(rng, (n, h, h, c))
    gamma, beta = normal(rng, (c,), 1.0), normal(rng, (c,))
    rm, rv = normal(rng, (c,)), jnp.asarray(rng.uniform(0.5, 2.0, c))

    def fwd(rep, b, m, p):
        return batchnorm.bn_eval_forward(b[0], p[0], p[1], rm, rv)

    return Case("batchnorm eval", fwd, _bn_case_vjp(batchnorm.bn_eval_vjp), (x,), (),
                (gamma, beta))


def relu_case(rng, n, h, c) -> Case:
    x = normal(rng, (n, h, h, c))
    return Case("relu", lambda rep, b, m, p: activation.relu_forward(b[0],
                                                                     Levers().on().relu_mask),
                lambda res, dy: ((activation.relu_vjp(res, dy),), ()), (x,))


def relu6_case(rng, n, h, c) -> Case:
    x = 4 * normal(rng, (n, h, h, c))  # some above 6 too
    return Case("relu6", lambda rep, b, m, p: activation.relu6_forward(b[0]),
                lambda res, dy: ((activation.relu6_vjp(res, dy),), ()), (x,))


def silu_case(rng, n, h, c) -> Case:
    x = 2 * normal(rng, (n, h, h, c))
    return Case("silu", lambda rep, b, m, p: activation.silu_forward(b[0]),
                lambda res, dy: ((activation.silu_vjp(res, dy),), ()), (x,))


def sigmoid_case(rng, n, c) -> Case:
    x = 2 * normal(rng, (n, c))  # squeeze-excite's gate acts on the pooled [N, C]
    return Case("sigmoid", lambda rep, b, m, p: activation.sigmoid_forward(b[0]),
                lambda res, dy: ((activation.sigmoid_vjp(res, dy),), ()), (x,))


def gate_case(rng, n, h, c) -> Case:
    x, g = normal(rng, (n, h, h, c)), jnp.asarray(rng.uniform(size=(n, c)))
    return Case("squeeze-excite gate", lambda rep, b, m, p: elementwise.gate_forward(*b),
                lambda res, dy: (elementwise.gate_vjp(res, dy), ()), (x, g))


def bias_case(rng, n, h, c) -> Case:
    x, b = normal(rng, (n, h, h, c)), normal(rng, (c,))
    return Case("bias", lambda rep, bt, m, p: (elementwise.bias_forward(bt[0], p[0]), None),
                lambda res, dy: ((elementwise.bias_vjp(dy)[0],), (elementwise.bias_vjp(dy)[1],)),
                (x,), (), (b,))


def maxpool_case(rng, n, h, c) -> Case:
    x = normal(rng, (n, h, h, c))
    return Case("maxpool 3x3/2", lambda rep, b, m, p: pool.maxpool_forward(b[0]),
                lambda res, dy: ((pool.maxpool_vjp(res, dy),), ()), (x,))


def gap_case(rng, n, h, c) -> Case:
    x = normal(rng, (n, h, h, c))
    return Case("global avg pool", lambda rep, b, m, p: pool.gap_forward(b[0]),
                lambda res, dy: ((pool.gap_vjp(res, dy),), ()), (x,))


def dense_case(rng, n, d, k) -> Case:
    x = normal(rng, (n, d))
    w, b = normal(rng, (k, d)) / np.sqrt(d), normal(rng, (k,))

    def vjp(res, dy):
        dx, dw, db = dense.dense_vjp(res, dy)
        return (dx,), (dw, db)

    return Case("dense", lambda rep, bt, m, p: dense.dense_forward(bt[0], p[0], p[1]), vjp,
                (x,), (), (w, b))


def add_case(rng, n, h, c) -> Case:
    a, b = normal(rng, (n, h, h, c)), normal(rng, (n, h, h, c))
    return Case("residual add", lambda rep, bt, m, p: (elementwise.add_forward(*bt), None),
                lambda res, dy: (elementwise.add_vjp(dy), ()), (a, b))


def mask_case(rng, n, h, c, *, per_example: bool, rate=0.3) -> Case:
    x = normal(rng, (n, h, h, c))
    shape = (n,) if per_example else x.shape
    mask = jnp.asarray((rng.uniform(size=shape) >= rate) / (1 - rate), jnp.float64)
    name = "drop-path mask" if per_example else "dropout mask"
    return Case(name, lambda rep, b, m, p: elementwise.mask_forward(b[0], m[0]),
                lambda res, dy: ((elementwise.mask_vjp(res, dy),), ()), (x,), (mask,))


def soft_targets(rng, n, k):
    """Soft target rows [n, k] summing to 1 (a mixup of two one-hot labels)."""
    lam = rng.uniform(0.3, 1.0, (n, 1))
    a, b = np.eye(k)[rng.integers(0, k, n)], np.eye(k)[rng.integers(0, k, n)]
    return jnp.asarray(lam * a + (1 - lam) * b)


def loss_case(rng, n, k, kind: str) -> Case:
    z = normal(rng, (n, k)) * 2.0
    t = soft_targets(rng, n, k)
    if kind == "bce":
        t = loss.bce_targets(t, smoothing=0.1)

    def fwd(rep, b, m, p):
        value, dlogits = loss_case_fn(kind)(b[0], m[0], rep)
        return value, dlogits

    return Case(f"loss {kind}", fwd, lambda dz, dy: ((dz * dy,), ()), (z,), (t,),
                per_example=False)


def loss_case_fn(kind: str):
    """(logits, targets, replicas) -> (loss, dlogits) with the divisor a replica uses
    (`Replicas.loss_rows`: its own batch, or under a control another)."""

    def f(z, t, rep: Replicas):
        div = loss.loss_divisor(kind, rep.loss_rows(z.shape[0]), z.shape[-1])
        return loss.value_and_cotangent(kind, z, t, div)

    return f


def all_cases(rng, n=2, h=5, c=3):
    """Every op at one small shape (the certification summary)."""
    cases = [conv_case(rng, n, h, c_in=c, c_out=4, k=k, stride=s, path=path)
             for path in conv.DENSE_PATHS for k in (1, 3, 5, 7) for s in (1, 2)]
    cases += [conv_case(rng, n, h, c_in=c, c_out=c, k=k, stride=s, depthwise=True, path=path)
              for path in conv.DEPTHWISE_PATHS for k in (3, 5) for s in (1, 2)]
    cases += [bn_train_case(rng, n, h, c), bn_eval_case(rng, n, h, c), relu_case(rng, n, h, c),
              maxpool_case(rng, n, h, c), gap_case(rng, n, h, c), dense_case(rng, n, 6, 4),
              add_case(rng, n, h, c), mask_case(rng, n, h, c, per_example=True),
              mask_case(rng, n, h, c, per_example=False), loss_case(rng, n, 5, "ce"),
              loss_case(rng, n, 5, "bce")]
    cases += [relu6_case(rng, n, h, c), silu_case(rng, n, h, c), sigmoid_case(rng, n, c),
              gate_case(rng, n, h, c), bias_case(rng, n, h, c)]
    return cases
