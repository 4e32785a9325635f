"""Strided windows of a padded NHWC tensor and their transpose — shared by the matmul-path and
shift-path convolutions and the max-pool backward."""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
from jax import lax


def pad_hw(x, p: int, value=0.0):
    """Pad H and W by p on both sides (symmetric)."""
    return jnp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)), constant_values=value) if p else x


def window(xp, a: int, b: int, ho: int, wo: int, *, s: int):
    """xp[:, a + s*i, b + s*j, :] for i < ho, j < wo: one tap of a k x k window, stride s."""
    n, _, _, c = xp.shape
    return lax.slice(xp, (0, a, b, 0), (n, a + (ho - 1) * s + 1, b + (wo - 1) * s + 1, c),
                     (1, s, s, 1))


def _unpadded_outputs(h: int, ho: int, a: int, p: int, s: int) -> tuple[int, int]:
    """(i0, i1): the outputs i < ho whose tap a reads a row of the input itself, not its
    padding — padded row a + s i is input row a + s i - p, inside [0, h) for i0 <= i < i1
    (i1 <= i0: none)."""
    return max(0, -(-(p - a) // s)), min(ho, (h - 1 + p - a) // s + 1)


def unpadded_tap(x, dy, a: int, b: int, *, p: int, s: int):
    """(dy [N, i1-i0, j1-j0, C], x's values that tap (a, b) multiplies them with, same shape),
    or None when the tap reads only padding: `window` of the p-padded x [N, H, W, C] for the
    outputs dy [N, Ho, Wo, C] with the padding's zero products left out. Two plain slices, where
    slicing the padded x formed each window in a slow loop over the pad's bounds, with x's
    producer (BN, activation) recomputed in it (bench/history/2026-12-03.md)."""
    n, h, w, c = x.shape
    i0, i1 = _unpadded_outputs(h, dy.shape[1], a, p, s)
    j0, j1 = _unpadded_outputs(w, dy.shape[2], b, p, s)
    if i1 <= i0 or j1 <= j0:
        return None
    r0, c0 = s * i0 + a - p, s * j0 + b - p
    xs = lax.slice(x, (0, r0, c0, 0), (n, r0 + s * (i1 - i0 - 1) + 1, c0 + s * (j1 - j0 - 1) + 1,
                                       c), (1, s, s, 1))
    return dy[:, i0:i1, j0:j1, :], xs


def scatter_window(v, a: int, b: int, hp: int, wp: int, *, s: int):
    """The transpose of `window`: v [N, ho, wo, C] placed at rows a + s*i, cols b + s*j of an
    hp x wp grid, zeros elsewhere."""
    ho, wo = v.shape[1:3]
    hi_h, hi_w = hp - a - (ho - 1) * s - 1, wp - b - (wo - 1) * s - 1
    return lax.pad(v, jnp.zeros((), v.dtype),
                   ((0, 0, 0), (a, hi_h, s - 1), (b, hi_w, s - 1), (0, 0, 0)))


def scatter_windows(tap, k: int, hp: int, wp: int, s: int):
    """The sum over the k x k taps (a, b) of ``scatter_window(tap(a, b), a, b, hp, wp, s=s)``:
    [N, hp, wp, C] from the callable tap(a, b) -> [N, ho, wo, C], one stride phase at a time.

    Padded row y = py + s i is read only by the taps a = py + s u (u = 0, 1, ...), as their row
    i - u, so each of the s^2 phases is a stride-1 sum of shifted taps, and each position adds
    its taps in the same order as the sum of scatters does. Scattering tap by tap evaluates all
    k^2 taps at every padded position, s^2 times as many as there are products
    (bench/history/2026-12-03.md)."""
    mh, mw = -(-hp // s), -(-wp // s)  # rows / columns of a phase
    phases = []
    for py in range(s):
        for px in range(s):
            ku, kv = len(range(py, k, s)), len(range(px, k, s))
            terms = []
            for u in range(ku):
                for v in range(kv):
                    t = tap(py + s * u, px + s * v)  # at rows u..u+ho-1 of the phase, cut at mh
                    ho, wo = t.shape[1:3]
                    terms.append(lax.pad(t, jnp.zeros((), t.dtype), (
                        (0, 0, 0), (u, mh - ho - u, 0), (v, mw - wo - v, 0), (0, 0, 0))))
            phases.append(functools.reduce(operator.add, terms) if terms else None)
    return interleave_phases(phases, s, hp, wp)


def interleave_phases(phases: list, s: int, hp: int, wp: int):
    """[N, hp, wp, C] whose row py + s i, column px + s j is ``phases[py s + px]`` [N, mh, mw, C]
    at (i, j), mh = ceil(hp / s), mw = ceil(wp / s); a phase None (no tap reaches it) is zeros."""
    like = next(ph for ph in phases if ph is not None)
    phases = [jnp.zeros_like(like) if ph is None else ph for ph in phases]  # k < s: no tap
    n, mh, mw, c = like.shape
    # [N, mh, s (py), mw, s (px), C] -> [N, mh s, mw s, C], cropped to the padded grid
    grid = jnp.stack(phases, axis=3).reshape(n, mh, mw, s, s, c).transpose(0, 1, 3, 2, 4, 5)
    return grid.reshape(n, mh * s, mw * s, c)[:, :hp, :wp]
