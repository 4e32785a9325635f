"""2-D convolution, dense and depthwise: forward and hand-written VJP side by side.

Activations are NHWC, weights OIHW (timm's shapes: dense [Co, Ci, k, k], depthwise [C, 1, k, k]).
Padding is symmetric, (k - 1) // 2 on each side (3 for the 7x7 stem), never XLA "SAME".

Output size: Ho = (H + 2p - k) // s + 1. When the stride does not tile the padded input exactly,
the last ``r = H + 2p - k - (Ho - 1) s`` padded rows are read by no window; both VJPs account for
them (their input gradient is zero), and the forward crops them from its high padding: the same
output, bitwise, on XLA, and the only form IREE's llvm-cpu backend compiles
(tests/test_iree.py::test_iree_conv_with_unread_padding). ``crop_unread=False`` pads p on both
sides instead, the form cuDNN takes as it is: a GPU's default, where the crop cost XLA:GPU a
padded copy (docs/precision.md#gpu-levers).

Each kind has two paths, equal up to summation order; which one a program takes is a lever
(`twinstep.ops.levers.Levers`: on XLA:CPU the form that runs fast there, elsewhere one XLA
convolution; bench/probes/ measures both), passed to every forward as ``path``.
- dense: ``conv`` (one XLA convolution per forward / input-VJP / weight-VJP) and ``matmul`` (the
  k^2 strided windows of the padded input interleaved, [rows, Ci k k], times the kernel as the
  [Co, Ci k k] matrix its OIHW layout already is; the input VJP scatters the windows' cotangents
  back). XLA:CPU runs its convolutions, the backward ones above all, several times slower than
  the same products as matrix multiplications.
- depthwise: ``grouped`` (one XLA convolution with ``feature_group_count = C``) and ``shift``
  (k^2 strided slices, multiply-adds); XLA:CPU runs the grouped form pathologically slowly.
  ``phased`` is ``grouped`` but for a strided convolution's input VJP: where ``grouped``
  correlates the zero-interleaved cotangent, s^2 times its size, with the whole kernel (XLA:GPU
  materialises that copy and never hands a grouped convolution to cuDNN's backward-data), it
  runs one stride-1 grouped convolution per stride phase, with the kernel taps that reach that
  phase, and interleaves the s^2 results: the same products, none with a zero.
  ``shift-one-pass`` is ``shift`` but for its weight VJP: where ``shift`` sums each tap's
  products over the outputs that read the input itself, k^2 reductions each reading x and dy,
  it reduces all k^2 taps' products (of the padded input's windows) at once, in one read of
  each; a GPU candidate (bench/probes/depthwise.py times every path on XLA:CPU).
The ``matmul`` and ``shift`` paths multiply-add conv-dtype operands in the base dtype and round
their results to the conv dtype once, at the end.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from twinstep.ops.precision import Precision, round_to
from twinstep.ops.windows import (
    interleave_phases,
    pad_hw,
    scatter_windows,
    unpadded_tap,
    window,
)


def conv_padding(k: int) -> int:
    """Symmetric padding of a k x k convolution: (k - 1) // 2."""
    return (k - 1) // 2


def conv_out_size(h: int, k: int, stride: int) -> int:
    return (h + 2 * conv_padding(k) - k) // stride + 1


def _unread(h: int, k: int, stride: int) -> int:
    """Padded rows at the high end that no window reads."""
    return h + 2 * conv_padding(k) - k - (conv_out_size(h, k, stride) - 1) * stride


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "w"],
                   meta_fields=["stride", "precision", "path"])
@dataclasses.dataclass(frozen=True)
class ConvRes:
    """Residuals of a convolution: its operands in the conv dtype."""

    x: jax.Array  # [N, H, W, Ci]
    w: jax.Array  # [Co, Ci, k, k] or [C, 1, k, k]
    stride: int
    precision: Precision
    path: str = "conv"  # dense: DENSE_PATHS; depthwise: DEPTHWISE_PATHS


def _conv(lhs, rhs, precision, dims, result_dtype=None, **kw):
    """One XLA convolution with conv-dtype operands and a conv-dtype-TYPED result."""
    cd, acc = precision.conv_dtype, precision.conv_accumulator
    if acc is None:
        return lax.conv_general_dilated(round_to(lhs, cd), round_to(rhs, cd),
                                        dimension_numbers=dims,
                                        preferred_element_type=result_dtype or cd,
                                        **kw).astype(precision.dtype)
    y = lax.conv_general_dilated(round_to(lhs, cd).astype(acc), round_to(rhs, cd).astype(acc),
                                 dimension_numbers=dims, preferred_element_type=acc, **kw)
    return round_to(y, result_dtype or cd).astype(precision.dtype)


# ---------------------------------------------------------------------------------- dense conv


DENSE_PATHS = ("conv", "matmul")
DEPTHWISE_PATHS = ("shift", "grouped", "phased", "shift-one-pass")


def conv2d_forward(x, w, stride: int, precision: Precision, *, path: str, crop_unread: bool):
    """y [N, Ho, Wo, Co] = conv(x [N, H, W, Ci], w [Co, Ci, k, k]); returns (y, ConvRes).
    ``path``: `DENSE_PATHS`; ``crop_unread``: the ``conv`` path's padding (module docstring)."""
    if path == "conv":
        return _grouped_forward(x, w, stride=stride, precision=precision, groups=1,
                                crop_unread=crop_unread)
    if path != "matmul":
        raise ValueError(f"unknown dense conv path {path!r}; choose 'conv' or 'matmul'")
    xc, wc = round_to(x, precision.conv_dtype), round_to(w, precision.conv_dtype)
    cols = _windows(xc, w.shape[2], stride)
    co = w.shape[0]
    y = _dot(cols.reshape(-1, cols.shape[-1]), _kernel_matrix(wc), ((1,), (1,)), precision)
    return _round(y.reshape(*cols.shape[:3], co), precision), ConvRes(xc, wc, stride, precision,
                                                                         "matmul")


def conv2d_vjp(res: ConvRes, dy):
    """(dx [N, H, W, Ci], dw [Co, Ci, k, k]) for the cotangent dy [N, Ho, Wo, Co]."""
    if res.path == "conv":
        return _grouped_input_vjp(res, dy, groups=1), _grouped_weight_vjp(res, dy, groups=1)
    x, w, s, precision = res.x, res.w, res.stride, res.precision
    co, ci, k, _ = w.shape
    p = conv_padding(k)
    n, h, wd, _ = x.shape
    ho, wo = dy.shape[1:3]
    dyc = round_to(dy, precision.conv_dtype).reshape(-1, co)
    # dx: each window's cotangent [rows, Ci k k] scattered back onto the positions it read
    dcols = _dot(dyc, _kernel_matrix(w), ((1,), (0,)), precision).reshape(n, ho, wo, ci, k * k)
    dxp = scatter_windows(lambda a, b: dcols[..., a * k + b], k, h + 2 * p, wd + 2 * p, s)
    dx = dxp[:, p:p + h, p:p + wd, :]
    cols = _windows(x, k, s)
    dw = _dot(dyc, cols.reshape(-1, ci * k * k), ((0,), (0,)), precision).reshape(co, ci, k, k)
    return _round(dx, precision), (_round(dw, precision) if precision.round_weight_grads else dw)


def _windows(x, k: int, stride: int):
    """[N, Ho, Wo, Ci k k]: the k x k windows of the padded x [N, H, W, Ci], tap (a, b) minor —
    the order of an OIHW kernel's flattened [Ci, k, k], so that neither the kernel matrix nor
    the weight gradient is ever transposed (each transpose a strided copy of every k x k
    weight, on every replica, each step: bench/history/2026-12-03.md)."""
    xp = pad_hw(x, conv_padding(k))
    ho, wo = conv_out_size(x.shape[1], k, stride), conv_out_size(x.shape[2], k, stride)
    taps = [window(xp, a, b, ho, wo, s=stride) for a in range(k) for b in range(k)]
    return taps[0] if k == 1 else jnp.stack(taps, axis=-1).reshape(*taps[0].shape[:3], -1)


def _kernel_matrix(w):
    """w [Co, Ci, k, k] as [Co, Ci k k], in the order of `_windows` (a reshape, no copy)."""
    return w.reshape(w.shape[0], -1)


def _dot(lhs, rhs, contract, precision: Precision):
    """A matrix product of conv-dtype operands accumulated in the base dtype (float64 under the
    tie's bf16, as `Precision.conv_accumulator` does for the convolutions)."""
    acc = precision.conv_accumulator or precision.dtype
    if precision.conv_accumulator is not None:
        lhs, rhs = lhs.astype(acc), rhs.astype(acc)
    return lax.dot_general(lhs, rhs, (contract, ((), ())), preferred_element_type=acc)


# Dense convolutions are emitted in the one form XLA:CPU hands to its fast (Eigen) kernel:
# NHWC input, HWIO kernel, NHWC output, the operands transposed explicitly. XLA canonicalizes
# other forms itself in a program's entry computation, but not inside a while loop — the
# accumulation scan's body — where they ran as generic loops, 3x slower
# (bench/probes/RESULTS.md#scan_body).
CANONICAL = ("NHWC", "HWIO", "NHWC")


def _grouped_forward(x, w, *, stride: int, precision: Precision, groups: int,
                     crop_unread: bool):
    p = conv_padding(w.shape[2])
    cd = precision.conv_dtype
    xc, wc = round_to(x, cd), round_to(w, cd)
    if groups == 1:
        rhs, dims = jnp.transpose(wc, (2, 3, 1, 0)), CANONICAL
    else:
        rhs, dims = wc, ("NHWC", "OIHW", "NHWC")
    pads = [(p, p - (_unread(x.shape[d], w.shape[2], stride) if crop_unread else 0))
            for d in (1, 2)]
    y = _conv(xc, rhs, precision, dims, window_strides=(stride, stride), padding=pads,
              feature_group_count=groups)
    path = "conv" if groups == 1 else "grouped"
    return y, ConvRes(xc, wc, stride, precision, path)


def _grouped_input_vjp(res: ConvRes, dy, groups):
    """dx: the stride-dilated cotangent correlated with the spatially flipped kernel."""
    x, w, s = res.x, res.w, res.stride
    k = w.shape[2]
    p = conv_padding(k)
    pads = [(k - 1 - p, k - 1 - p + _unread(x.shape[d], k, s)) for d in (1, 2)]
    flipped = jnp.flip(w, (2, 3))
    if groups == 1:  # the kernel's O (dim 0) is contracted, I (dim 1) produced: [k, k, Co, Ci]
        rhs, dims = jnp.transpose(flipped, (2, 3, 0, 1)), CANONICAL
    else:  # depthwise: [C, 1, k, k] is its own transpose under feature_group_count = C
        rhs, dims = flipped, ("NHWC", "OIHW", "NHWC")
    return _conv(dy, rhs, res.precision, dims, window_strides=(1, 1), padding=pads,
                 lhs_dilation=(s, s), feature_group_count=groups)


def _grouped_weight_vjp(res: ConvRes, dy, groups):
    """dw[o, i, a, b] = sum_{n,h,w} dy[n, h, w, o] * x_pad[n, h s + a, w s + b, i].

    A convolution of x (batch <-> feature swapped) with dy as the kernel, dilated by the stride;
    for depthwise the channels ride in ``batch_group_count``.
    """
    x, w, s = res.x, res.w, res.stride
    k = w.shape[2]
    p = conv_padding(k)
    pads = [(p, p - _unread(x.shape[d], k, s)) for d in (1, 2)]  # high side may crop (< 0)
    if groups == 1:  # canonical: x as [Ci, H, W, N] with dy [Ho, Wo, N, Co] as the kernel
        dw = _conv(jnp.transpose(x, (3, 1, 2, 0)), jnp.transpose(dy, (1, 2, 0, 3)),
                   res.precision, CANONICAL, res.precision.weight_grad_dtype,
                   window_strides=(1, 1), padding=pads, rhs_dilation=(s, s))
        return jnp.transpose(dw, (3, 0, 1, 2))  # [Ci, k, k, Co] -> [Co, Ci, k, k]
    return _conv(x, dy, res.precision, ("CHWN", "IHWO", "CNHW"),
                 res.precision.weight_grad_dtype, window_strides=(1, 1), padding=pads,
                 rhs_dilation=(s, s), batch_group_count=groups)


# ------------------------------------------------------------------------------ depthwise conv


def depthwise_forward(x, w, stride: int, precision: Precision, *, path: str, crop_unread: bool):
    """y [N, Ho, Wo, C] = depthwise conv(x [N, H, W, C], w [C, 1, k, k]); returns (y, ConvRes).
    ``path``: `DEPTHWISE_PATHS`; ``crop_unread``: the ``grouped`` path's padding (module
    docstring)."""
    if path in ("grouped", "phased"):
        y, res = _grouped_forward(x, w, stride=stride, precision=precision, groups=x.shape[-1],
                                  crop_unread=crop_unread)
        return y, dataclasses.replace(res, path=path)
    if path not in ("shift", "shift-one-pass"):
        raise ValueError(f"unknown depthwise path {path!r}; choose from "
                         f"{', '.join(DEPTHWISE_PATHS)}")
    cd = precision.conv_dtype
    xc, wc = round_to(x, cd), round_to(w, cd)
    k = w.shape[2]
    xp = pad_hw(xc, conv_padding(k))
    ho, wo = conv_out_size(x.shape[1], k, stride), conv_out_size(x.shape[2], k, stride)
    acc = precision.dtype  # bf16 operands multiply-add in the base dtype, as a conv does
    y = sum(window(xp, a, b, ho, wo, s=stride).astype(acc) * wc[:, 0, a, b].astype(acc)
            for a in range(k) for b in range(k))
    return _round(y, precision), ConvRes(xc, wc, stride, precision, path)


def depthwise_vjp(res: ConvRes, dy):
    """(dx [N, H, W, C], dw [C, 1, k, k]) for the cotangent dy [N, Ho, Wo, C]."""
    if res.path in ("grouped", "phased"):
        groups = res.x.shape[-1]
        phased = res.path == "phased" and res.stride > 1
        dx = _phased_input_vjp(res, dy) if phased else _grouped_input_vjp(res, dy, groups)
        return dx, _grouped_weight_vjp(res, dy, groups)
    x, w, s, precision = res.x, res.w, res.stride, res.precision
    k, p = w.shape[2], conv_padding(w.shape[2])
    n, h, wd, c = x.shape
    acc = precision.dtype  # as in `depthwise_forward`
    dyc = round_to(dy, precision.conv_dtype).astype(acc)
    # dx: each tap's dy * w[tap] back onto the positions it read
    wa = w.astype(acc)
    dxp = scatter_windows(lambda a, b: dyc * wa[:, 0, a, b], k, h + 2 * p, wd + 2 * p, s)
    dx = dxp[:, p:p + h, p:p + wd, :]
    xa = x.astype(acc)
    if res.path == "shift-one-pass":  # dw: all k^2 taps' products in one reduction
        xp = pad_hw(xa, p)
        ho, wo = dy.shape[1:3]
        cols = jnp.stack([window(xp, a, b, ho, wo, s=s) for a in range(k) for b in range(k)], -1)
        dw = jnp.sum(cols * dyc[..., None], axis=(0, 1, 2)).reshape(c, 1, k, k)
    else:  # dw: each tap's products over the outputs that read x itself (padding adds zeros)
        taps = [unpadded_tap(xa, dyc, a, b, p=p, s=s) for a in range(k) for b in range(k)]
        dw = jnp.stack([jnp.zeros((c,), acc) if t is None else
                        jnp.sum(t[0] * t[1], axis=(0, 1, 2)) for t in taps],
                       axis=-1).reshape(c, 1, k, k)
    return _round(dx, precision), (_round(dw, precision) if precision.round_weight_grads else dw)


def _phased_input_vjp(res: ConvRes, dy):
    """dx of a strided depthwise convolution, one stride phase at a time: padded row py + s i
    takes dy[i - u] w[py + s u] over u (`scatter_windows`' arithmetic), a stride-1 correlation
    of dy with the flipped taps w[:, :, py::s, px::s]. Phase (qy, qx) of dx, its rows qy + s j,
    is padded row p + qy + s j: phase py = (p + qy) mod s from its row (p + qy) // s on, so
    no padded row is computed and cropped."""
    x, w, s = res.x, res.w, res.stride
    n, h, wd, c = x.shape
    p = conv_padding(w.shape[2])
    ho, wo = dy.shape[1:3]
    mh, mw = -(-h // s), -(-wd // s)  # rows / columns of a phase of dx

    def pads(q, size, m, taps):  # a phase's rows start at padded-phase row (p + q) // s
        low = taps - 1 - (p + q) // s
        return low, m + taps - 1 - size - low

    phases = []
    for qy in range(s):
        for qx in range(s):
            taps = jnp.flip(w[:, :, (p + qy) % s::s, (p + qx) % s::s], (2, 3))  # [C, 1, ku, kv]
            ku, kv = taps.shape[2:]
            phases.append(None if ku * kv == 0 else _conv(
                dy, taps, res.precision, ("NHWC", "OIHW", "NHWC"), window_strides=(1, 1),
                padding=[pads(qy, ho, mh, ku), pads(qx, wo, mw, kv)], feature_group_count=c))
    return interleave_phases(phases, s, h, wd)


def _round(y, precision: Precision):
    """Round to the conv result type, then back: the shift path's bf16-typed result."""
    return round_to(y, precision.conv_dtype).astype(precision.dtype)
