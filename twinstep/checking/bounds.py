"""How a tie measures the distance between two computations of one tensor, and how far apart
they may be (docs/tie.md#bounds is the rationale; this module is the arithmetic).

Errors are norm-relative, on the host in float64 (`rel`, `grad_err`). A tensor's bound is
max(FLOOR, SENSITIVITY_FACTOR x SENSITIVITY): FLOOR per precision (`FLOORS`), SENSITIVITY what
arithmetic alone moves the single device's own value by (`perturbation`, `nudged`, `moved_by`,
`closest`). A run within every bound is still only *inconclusive* when a noise-floor bound
exceeds INCONCLUSIVE_BOUND (`status`). bf16 conv weight gradients have an exact elementwise
bound instead (`bf16_bound`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from twinstep.errors import ExitStatus


class Floors(NamedTuple):
    params: float  # parameter gradients and state tensors
    stats: float  # BN statistics and the loss


# bf16 ties run f64 around identical bf16 conv operands (docs/tie.md#bf16), so everything but
# the conv weight gradients is held to the f64 floors
FLOORS = {"f64": Floors(1e-10, 1e-12), "f32": Floors(1e-4, 1e-4), "bf16": Floors(1e-10, 1e-12)}
F64_PARAM_BOUND, F64_STAT_BOUND = FLOORS["f64"]
PARAM_FLOOR = {"float64": FLOORS["f64"].params, "float32": FLOORS["f32"].params}  # by dtype
SENSITIVITY_FACTOR = 10
# A noise-floor bound above this makes a run inconclusive (docs/tie.md#inconclusive)
INCONCLUSIVE_BOUND = 1e-3
# the CLI's exit status per verdict
EXIT_CODES = {"tied": ExitStatus.SUCCESS, "NOT tied": ExitStatus.FAILED,
              "inconclusive": ExitStatus.INCONCLUSIVE}
PERTURBATION_F32 = 1e-6  # ~8 f32 ulps; other precisions perturb by the same number of ulps


def bound(floor: float, sensitivity: float) -> float:
    return max(floor, SENSITIVITY_FACTOR * sensitivity)


# ------------------------------------------------------------------------------ errors


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


# a BN's shift -> its spread, and how the spread's tensor gives its scale (`grad_err`)
BN_SHIFTS = {"bias": ("weight", np.abs), "running_mean": ("running_var", np.sqrt)}


def grad_err(name: str, ours, ref) -> float:
    """`rel` of ours[name] against ref[name], except for a BN's shift — its bias (or the bias's
    gradient), its running mean — below its dtype's PARAM_FLOOR on the scale of its BN's spread
    (gamma or gamma's gradient; the running variance's square root): there no relative
    comparison means anything, so both are compared against zero on that scale. Such a zero is
    usually structural — the BN's output reaches another BN through a linear map only
    (MobileNetV4's dw_start and pw_proj BNs), so its bias's exact gradient is 0, the next BN's
    batch mean is its bias's image, and any two computations return rounding noise."""
    a, b = ours[name], ref[name]
    scale = zero_scale(name, ref)
    if scale is not None:
        return float(max(np.linalg.norm(host(a)), np.linalg.norm(host(b))) / scale)
    return rel(a, b)


def zero_scale(name: str, ref) -> float | None:
    """The scale of its BN's spread that `grad_err` compares ref[name] against zero on, or None
    when ref[name] is not a BN's shift below PARAM_FLOOR on that scale, or that scale is 0 (a
    state that is exactly zero for the whole BN, as RMSProp's momentum after a step at lr 0:
    `rel` compares it absolutely)."""
    shift = name.rsplit(".", 1)[-1]
    if shift in BN_SHIFTS:
        spread, to_scale = BN_SHIFTS[shift]
        other = name[:-len(shift)] + spread
        if other in ref and np.ndim(ref[other]) == 1:
            scale = float(np.linalg.norm(to_scale(host(ref[other]))))
            dtype = np.dtype(getattr(ref[name], "dtype", np.float64)).name
            if scale > 0 and np.linalg.norm(host(ref[name])) <= PARAM_FLOOR.get(
                    dtype, PARAM_FLOOR["float64"]) * scale:
                return scale
    return None


# ------------------------------------------------------------------------- sensitivity


def perturbation(dtype) -> float:
    """1e-6 in f32 (about 8 ulps), the same number of ulps in f64 (~1.9e-15): a rounding-sized
    nudge, not a change of the data."""
    return PERTURBATION_F32 * float(jnp.finfo(dtype).eps / jnp.finfo(jnp.float32).eps)


def nudged(x, seed: int, count: int) -> list:
    """``count`` rounding-sized relative nudges of x: x (1 + PERTURBATION u_i), u_i standard
    normal drawn from key seed + i, i = 1..count."""
    return [x * (1 + perturbation(x.dtype) * jax.random.normal(jax.random.key(seed + i),
                                                                 x.shape, x.dtype))
            for i in range(1, count + 1)]


def moved_by(moved: list, ref, combine=max):
    """(per gradient, per BN site, the loss) how far the single-device runs ``moved`` are from
    ``ref``, relatively, combined over the runs by ``combine``."""
    def over(values):
        return float(combine(list(values)))

    grads = {n: over(grad_err(n, m.grads, ref.grads) for m in moved) for n in ref.grads}
    stats = {n: over(max(rel(m.stats[n].mean, ref.stats[n].mean),
                         rel(m.stats[n].var, ref.stats[n].var)) for m in moved)
             for n in ref.stats}
    return grads, stats, over(rel(m.loss, ref.loss) for m in moved)


def closest(runs: list, reordered: list) -> tuple:
    """f32's SENSITIVITY: per tensor, how far the single device moves when one of its batches is
    summed in reverse order — the freedom the replica program takes — the second least over the
    batches: not the least, which one unusually quiet batch sets too low (from random BN a run
    with no bug then read NOT tied), nor the median, which two batches whose reversal flips a
    ReLU set too high (docs/tie.md#f32)."""
    parts = [moved_by([m], r) for r, m in zip(runs, reordered, strict=True)]
    grads, stats = ({k: _second_least(p[j][k] for p in parts) for k in parts[0][j]}
                    for j in (0, 1))
    return grads, stats, _second_least(p[2] for p in parts)


def _second_least(values) -> float:
    return sorted(values)[1]


# ------------------------------------------------------------------------------ bf16


def bf16_bound(partials):
    """The bound (docs/tie.md#bf16) on a bf16 weight gradient, elementwise: |(1/R) sum_r
    rnd(S_r) - rnd(S)|, S = (1/R) sum_r S_r, from the replicas' unrounded partials S_r [R, ...]
    (for R a power of two this is (1/R)|sum_r rnd(S_r) - rnd(sum_r S_r)|), plus how far
    rnd() may move over where the single device's own f64 sum of the same terms lies: within
    1e-12 |S| of S, and — where the element is a cancellation to (nearly) zero, a structural
    zero, exactly 0 on one device and rounding noise on the replicas — within the f64 floor of
    a gradient, F64_PARAM_BOUND times the tensor's norm; plus 1e-12 |S| everywhere."""
    p = np.asarray(partials, np.float64)

    def rnd(v):  # as the programs round (ops.precision.round_to: through f32)
        return np.asarray(v, np.float64).astype(np.float32).astype(jnp.bfloat16).astype(np.float64)

    s = p.mean(0)
    error = np.abs(rnd(p).mean(0) - rnd(s))
    spread = 1e-12 * np.abs(s) + F64_PARAM_BOUND * np.linalg.norm(s)
    reach = np.maximum(np.abs(rnd(s + spread) - rnd(s)), np.abs(rnd(s - spread) - rnd(s)))
    return error + 1e-12 * np.abs(s) + reach


# --------------------------------------------------------------------------- verdicts


def status(within: bool, bounds) -> tuple[str, list]:
    """("tied" | "NOT tied" | "inconclusive", the loose rows): a run that fails a bound is NOT
    tied, however loose the others; one within every bound is tied only if no noise-floor bound
    ``bounds`` [(name, bound)] exceeds INCONCLUSIVE_BOUND."""
    loose = sorted(((b, n) for n, b in bounds if b > INCONCLUSIVE_BOUND), reverse=True)
    if not within:
        return "NOT tied", loose
    return ("inconclusive" if loose else "tied"), loose


def power_text(head: str, loose: list, bounds: list) -> str:
    """What the run could see: the loosest noise-floor bound; for an inconclusive run, how many
    are too loose and what to change."""
    if head != "inconclusive":
        name, b = max(bounds, key=lambda nb: nb[1])
        if b == min(b for _, b in bounds):  # all at one floor: no row to name
            return f"; every bound {b:.1e}"
        return f"; loosest bound {b:.1e} ({name})"
    b, name = loose[0]
    return (f"; {len(loose)} of {len(bounds)} bounds exceed {INCONCLUSIVE_BOUND:g} (loosest: "
            f"{name}, {b:.1e}), where a bug of that size would pass: tie in f64, or where "
            f"the single device is better conditioned (larger --res or --batch)")


class Verdict:
    """A report's status from its ``within`` and its noise-floor ``_bounds()``."""

    @property
    def status(self) -> str:
        """"tied", "NOT tied" or "inconclusive" (`status`)."""
        return status(self.within, self._bounds())[0]

    @property
    def ok(self) -> bool:
        return self.status == "tied"
