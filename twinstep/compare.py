"""How two computations of one tensor are compared: on the host in float64, norm-relative."""

from __future__ import annotations

import jax
import numpy as np


def host(x) -> np.ndarray:
    """``x`` as a float64 NumPy array. A jax.Array whose first shard is the whole array (a
    replicated state) is read through that shard: np.asarray on the array itself can keep its
    host copy cached for the array's lifetime — a whole R-replica state twinned on the host."""
    if isinstance(x, jax.Array) and len(x.addressable_shards) > 1:
        first = x.addressable_shards[0].data
        if first.shape == x.shape:
            x = first
    return np.asarray(x, np.float64)


def rel(a, b) -> float:
    """||a - b|| / ||b|| (absolute when b = 0)."""
    a, b = host(a), host(b)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


# The smallest norm-relative difference a tie can resolve in each dtype (parameter gradients):
# f64 sums of 1e5-1e7 terms agree to ~1e-13; f32's ~1e3 ulps cover its reorderings.
FLOORS = {"float64": 1e-10, "float32": 1e-4}


def grad_err(name: str, ours, ref) -> float:
    """`rel` of ours[name] against ref[name], except for a BN bias whose gradient is below its
    dtype's FLOOR on the scale of its BN's gamma gradient: there no relative comparison means
    anything, so both are compared against zero on that scale. Such a zero is usually
    structural — the BN's output reaches another BN through a linear map only (MobileNetV4's
    dw_start BNs), so its exact gradient is 0 and any two computations return rounding noise."""
    a, b = ours[name], ref[name]
    gamma = name[:-len("bias")] + "weight"
    if name.endswith(".bias") and gamma in ref and np.ndim(ref[gamma]) == 1:
        scale = float(np.linalg.norm(host(ref[gamma])))
        floor = FLOORS.get(np.dtype(getattr(b, "dtype", np.float64)).name, FLOORS["float64"])
        if np.linalg.norm(host(b)) <= floor * scale:
            return float(max(np.linalg.norm(host(a)), np.linalg.norm(host(b))) / scale)
    return rel(a, b)
