"""The device loader's work on the devices (`--loader device`, `twinstep.data.device`): the
crop's resize and RandAugment, as JAX, from the host's plan. Each op reproduces Pillow's
arithmetic (the reference, `twinstep.data.transforms` and `twinstep.data.augment`): the resize
bit for bit (Pillow's 22-bit fixed-point separable filter, in int32), the lookup-table ops and
equalize bit for bit (integers), the rest in float32 where Pillow computes in float64 or lets
its compiler round — docs/training.md#device-loader states each op's measured difference.

Every random choice arrives drawn (the plan, `twinstep.data.device.Layout`); nothing here
draws, so a batch stays a pure function of (seed, step). All functions take a batch of rows
and are written for any leading size n.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PRECISION_BITS = 22  # Pillow's resample: coefficients in 32 - 8 - 2 bits of fixed point
# a RandAugment layer's kind (`twinstep.data.device.layer_plan` writes them)
NONE, LUT, AUTOCONTRAST, EQUALIZE, AFFINE, BLEND = range(6)
# a blend's degenerate image (Pillow's ImageEnhance): grey (Color), the mean grey (Contrast),
# black (Brightness), smoothed (Sharpness)
GREY, MEAN, BLACK, SMOOTH = range(4)
SMOOTH_KERNEL = (1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0, 1.0)  # ImageFilter.SMOOTH, / 13


def _resample_axis(img, start, coef, axis: int):
    """One pass of Pillow's separable resample along ``axis`` (1: rows, 2: columns) of img
    [n, A, B, 3] int32: output i is sum_k coef[n, i, k] img[.., start[n, i] + k, ..],
    rounded and clipped to 8 bits as Pillow's clip8. start [n, O] int32, coef [n, O, K]."""
    shape = [img.shape[0], 1, 1, 1]
    shape[axis] = start.shape[1]
    acc = jnp.int32(1 << (PRECISION_BITS - 1))
    for k in range(coef.shape[2]):
        idx = jnp.clip(start + k, 0, img.shape[axis] - 1).reshape(shape)
        acc = acc + coef[:, :, k].reshape(shape) * jnp.take_along_axis(img, idx, axis=axis)
    return jnp.clip(acc >> PRECISION_BITS, 0, 255)


def resize(canvas, xstart, xcoef, ystart, ycoef):
    """canvas [n, H, W, 3] uint8 (each row's crop at the top left) -> [n, S, S, 3] uint8:
    Pillow's resize of each crop, horizontal pass first, both passes rounded to 8 bits.
    The tables ([n, S] starts, [n, S, K] int32 coefficients) are Pillow's, computed on the host
    (`twinstep.data.device.resize_table`); a flip is the horizontal table reversed."""
    x = _resample_axis(canvas.astype(jnp.int32), xstart, xcoef, 2)
    return _resample_axis(x, ystart, ycoef, 1).astype(jnp.uint8)


def _unfused(x):
    """x, rounded on its own: XLA may not fuse the product it is into an FMA with what
    follows (Pillow rounds each operation)."""
    return jax.lax.optimization_barrier(x)


def _histogram(x):
    """x [n, S, S, 3] int32 -> [n, 3, 256] int32 counts per channel."""
    n = x.shape[0]
    flat = (x + 256 * jnp.arange(3)).reshape(n, -1)
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], flat.shape)
    return jnp.zeros((n, 768), jnp.int32).at[rows, flat].add(1).reshape(n, 3, 256)


def _autocontrast_lut(hist):
    """ImageOps.autocontrast(cutoff=0) per channel: the lowest and highest present levels
    stretched to 0..255 (identity when they meet), int(i * scale + offset) clipped."""
    present = hist > 0
    lo = jnp.argmax(present, axis=-1)[..., None]
    hi = 255 - jnp.argmax(present[..., ::-1], axis=-1)[..., None]
    i = jnp.arange(256)
    with jax.enable_x64(True):  # Pillow's float64, each product rounded before the sum
        scale = 255.0 / jnp.maximum(hi - lo, 1).astype(jnp.float64)
        v = _unfused(i.astype(jnp.float64) * scale) + _unfused(-lo.astype(jnp.float64) * scale)
        v = jnp.clip(jnp.trunc(v), 0, 255).astype(jnp.int32)
    return jnp.where(hi <= lo, i, v)


def _equalize_lut(hist):
    """ImageOps.equalize per channel, in integers as Pillow computes it."""
    i = jnp.arange(256)
    last = jnp.take_along_axis(hist, (255 - jnp.argmax((hist > 0)[..., ::-1], -1))[..., None],
                               axis=-1)
    step = (hist.sum(-1, keepdims=True) - last) // 255
    before = jnp.cumsum(hist, -1) - hist
    lut = (step // 2 + before) // jnp.maximum(step, 1)
    keep = ((hist > 0).sum(-1, keepdims=True) <= 1) | (step == 0)
    return jnp.where(keep, i, jnp.clip(lut, 0, 255))


def _apply_lut(x, lut):
    """x [n, S, S, 3] int32 through lut [n, 3, 256] per channel."""
    n = x.shape[0]
    flat = (x + 256 * jnp.arange(3)).reshape(n, -1)
    return jnp.take_along_axis(lut.reshape(n, 768), flat, axis=1).reshape(x.shape)


def _affine(x, coeffs, bicubic, fill):
    """Image.transform(AFFINE, coeffs, BILINEAR or BICUBIC, fillcolor=fill) of x [n, S, S, 3]
    int32: output (x, y) samples the input at (a x' + b y' + c, d x' + e y' + f), x' = x + 0.5;
    outside the input it is ``fill``. coeffs [n, 6] float64 bits ([n, 6, 2] int32), bicubic
    [n] bool, fill [n, 3]. In float64 as Pillow, each product rounded on its own."""
    n, h, w, _ = x.shape
    with jax.enable_x64(True):
        c = jax.lax.bitcast_convert_type(coeffs, jnp.float64)
        c = [c[:, j, None, None] for j in range(6)]
        yy, xx = jnp.meshgrid(jnp.arange(h, dtype=jnp.float64) + 0.5,
                              jnp.arange(w, dtype=jnp.float64) + 0.5, indexing="ij")
        xin = _unfused(c[0] * xx) + _unfused(c[1] * yy) + c[2]
        yin = _unfused(c[3] * xx) + _unfused(c[4] * yy) + c[5]
        inside = (xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)
        xs, ys = xin - 0.5, yin - 0.5
        x0, y0 = jnp.floor(xs), jnp.floor(ys)
        dx, dy = (xs - x0)[..., None], (ys - y0)[..., None]
        x0, y0 = x0.astype(jnp.int32), y0.astype(jnp.int32)
        flat = x.reshape(n, h * w, 3).astype(jnp.float64)

        def tap(i, j):  # pixel (row y0 + i, column x0 + j), edges repeated, [n, h, w, 3]
            idx = jnp.clip(y0 + i, 0, h - 1) * w + jnp.clip(x0 + j, 0, w - 1)
            return jnp.take_along_axis(flat, idx.reshape(n, -1, 1), axis=1).reshape(n, h, w, 3)

        def linear(a, b, d):  # Pillow's BILINEAR macro
            return a + _unfused((b - a) * d)

        bil = linear(linear(tap(0, 0), tap(0, 1), dx), linear(tap(1, 0), tap(1, 1), dx), dy)

        def cubic(v1, v2, v3, v4, d):  # Pillow's BICUBIC macro (a = -1)
            p2, p3, p4 = -v1 + v3, 2 * (v1 - v2) + v3 - v4, -v1 + v2 - v3 + v4
            return v2 + _unfused(d * (p2 + _unfused(d * (p3 + _unfused(d * p4)))))

        rows = [cubic(*(tap(i, j) for j in (-1, 0, 1, 2)), dx) for i in (-1, 0, 1, 2)]
        bic = jnp.clip(cubic(*rows, dy), 0, 255)
        v = jnp.trunc(jnp.where(bicubic[:, None, None, None], bic, bil)).astype(jnp.int32)
    return jnp.where(inside[..., None], v, fill[:, None, None, :])


def _grey(x):
    """Pillow's RGB -> L (ITU-R 601-2 luma in 16-bit fixed point), [n, S, S, 1]."""
    r, g, b = x[..., 0:1], x[..., 1:2], x[..., 2:3]
    return (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16


def _smooth(x):
    """ImageFilter.SMOOTH of x [n, S, S, 3] int32 in float32, summed in Pillow's order; the
    edge rows and columns kept."""
    h = x.shape[1]

    def row(dy, k3):  # one row of the kernel across the interior columns
        r = x[:, 1 + dy:h - 1 + dy]
        return (_product(r[:, :, :-2], k3[0]) + _product(r[:, :, 1:-1], k3[1])
                + _product(r[:, :, 2:], k3[2]))

    k = [float(np.float32(v / 13.0)) for v in SMOOTH_KERNEL]
    s = jnp.float32(0.5) + row(1, k[0:3])
    s = s + row(0, k[3:6])
    s = s + row(-1, k[6:9])
    inner = jnp.trunc(jnp.clip(s, 0, 255)).astype(jnp.int32)
    return x.at[:, 1:-1, 1:-1].set(inner)


def _product(pixels, factor):
    """pixels (int32) x factor (float32) rounded to float32 on its own, as Pillow's C rounds
    it: exact in float64 (8 bits times 24), then rounded once — a float32 product XLA would
    fuse with the sum that follows into one FMA, a rounding fewer."""
    with jax.enable_x64(True):
        return (jnp.asarray(factor, jnp.float32).astype(jnp.float64)
                * pixels.astype(jnp.float64)).astype(jnp.float32)


def _blend(x, degenerate, factor):
    """Image.blend(degenerate, x, factor): d + factor (x - d) in float32, clipped, truncated."""
    t = degenerate.astype(jnp.float32) + _product(x - degenerate,
                                                  factor[:, None, None, None])
    return jnp.trunc(jnp.clip(t, 0, 255)).astype(jnp.int32)


def rand_augment_layer(x, *, kind, lut, coeffs, bicubic, fill, degenerate, factor):
    """One RandAugment layer on x [n, S, S, 3] int32, each row's op as drawn on the host: kind
    [n] (`NONE` ... `BLEND`), lut [n, 3, 256] (the table of a `LUT` op), coeffs [n, 6] f32,
    bicubic [n] bool, fill [n, 3] (an `AFFINE` op's), degenerate [n] (`GREY` ... `SMOOTH`) and
    factor [n] f32 (a `BLEND` op's); coeffs are float64 bits, [n, 6, 2] int32. Every kind is
    computed for every row and one kept: the devices do in one pass what the host would do
    image by image."""
    hist = _histogram(x)
    table = jnp.where((kind == AUTOCONTRAST)[:, None, None], _autocontrast_lut(hist),
                      jnp.where((kind == EQUALIZE)[:, None, None], _equalize_lut(hist), lut))
    mapped = _apply_lut(x, table)
    moved = _affine(x, coeffs, bicubic, fill)
    grey = _grey(x)
    n_px = x.shape[1] * x.shape[2]
    mean = (2 * grey.reshape(x.shape[0], -1).sum(-1) + n_px) // (2 * n_px)  # int(mean + 0.5)
    options = jnp.stack([jnp.broadcast_to(grey, x.shape),
                         jnp.broadcast_to(mean[:, None, None, None], x.shape),
                         jnp.zeros_like(x), _smooth(x)])
    blended = _blend(x, jnp.take_along_axis(options, degenerate[None, :, None, None, None],
                                            axis=0)[0], factor)
    pick = kind[:, None, None, None]
    return jnp.where(pick == AFFINE, moved, jnp.where(pick == BLEND, blended,
                                                      jnp.where(pick == NONE, x, mapped)))


def crops(canvas, plan, layout):
    """The device loader's crops: canvas [n, H, W, 3] uint8 and plan [n, P] int32
    (`twinstep.data.device.Layout`) -> uint8 [n, S, S, 3], resized, flipped, augmented."""
    parts = layout.unpack(plan)
    x = resize(canvas, *parts["resize"]).astype(jnp.int32)
    for layer in parts["layers"]:
        # a layer no row draws is skipped; and a conditional's operand is materialised, where
        # XLA would otherwise fuse the stage before into each of the affine's 16 gathers
        x = jax.lax.cond(jnp.any(layer["kind"] != NONE), _layer, lambda x, _: x, x, layer)
    return x.astype(jnp.uint8)


def _layer(x, layer):
    return rand_augment_layer(x, **layer).astype(x.dtype)


def _bits(a):
    """int32 [...] holding float32 bit patterns -> float32."""
    return jax.lax.bitcast_convert_type(a, jnp.float32)
