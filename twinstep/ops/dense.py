"""The classifier: y = x W^T + b with timm's shapes (``fc.weight`` [K, D], ``fc.bias`` [K])."""

from __future__ import annotations


def dense_forward(x, w, b):
    """x [N, D] -> (y [N, K], residual (x, w))."""
    return x @ w.T + b, (x, w)


def dense_vjp(res, dy):
    """(dx [N, D], dW [K, D], db [K]) for dy [N, K]."""
    x, w = res
    return dy @ w, dy.T @ x, dy.sum(axis=0)
