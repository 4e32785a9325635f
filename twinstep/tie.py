"""The tie (SPEC §1): the R-replica step against the single-device step at R·N, parameter by
parameter, BN site by BN site.

Both programs are `twinstep.step.grad_step`: once jitted on the whole batch with no replicas,
once inside ``jax.shard_map`` on R devices with every sync site live. The same parameters (BN
gamma, beta and running statistics randomised), the same global batch — its replica shards
shifted by different constants so that Chan's correction term is O(1) — and the same soft
targets go into both.

Bounds, per tensor: max(FLOOR, 10 x SENSITIVITY), FLOOR being 1e-10 for parameters and 1e-12
for BN statistics in f64, 1e-4 in f32; SENSITIVITY is what arithmetic alone moves the
single-device value by (`noise_floor`). In f64 the floors decide almost everywhere; SENSITIVITY
takes over only where the network is ill-conditioned (ResNet-50 at 32² with R N = 4: layer4's
BNs reduce 4 rows, and reversing the batch moves the single device's own layer4.2.bn3 variance
by 1.8e-12). bf16 — both programs run the bf16 policy's rounding points (every conv operand
and result) with f64 around them and inside the conv accumulators (`tie_precision`): then
every conv sees the same bf16 operands in both programs, everything but the conv weight
gradients is held to the f64 bounds, and each conv weight gradient is checked elementwise
against SPEC §5's boundary |(1/R) sum_r rnd(S_r) - rnd(S)| from the replicas' unrounded partial
sums S_r (`bf16_bound`). With f32 there instead, reduction-order noise flips bf16 roundings and
the net amplifies them to O(1) (measured: ResNet-50's single-device bf16 gradients move ~100%
when the batch is reversed), which would hide the boundary. R must be a power of two for the
boundary to be the only difference: a replica's loss cotangent is R times the single device's,
and rnd(R y) = R rnd(y) only then.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import dp, step
from twinstep.collectives import SINGLE
from twinstep.nets import layers
from twinstep.ops import loss as losses
from twinstep.ops.precision import Precision, get_precision

F64_PARAM_BOUND = 1e-10
F64_STAT_BOUND = 1e-12
F32_FLOOR = 1e-4
# (parameters, BN statistics); bf16 ties run f64 around identical bf16 conv operands
# (`tie_precision`), so everything but the conv weight gradients is held to the f64 bounds
FLOORS = {"f64": (F64_PARAM_BOUND, F64_STAT_BOUND), "f32": (F32_FLOOR, F32_FLOOR),
          "bf16": (F64_PARAM_BOUND, F64_STAT_BOUND)}
SENSITIVITY_FACTOR = 10
STEPS = 3  # whole-step ties: the default number of optimizer steps
PERTURBATION_F32 = 1e-6  # ~8 f32 ulps; other precisions perturb by the same number of ulps


@dataclasses.dataclass(frozen=True)
class TieConfig:
    net: str = "resnet50"
    replicas: int = 4
    batch: int = 2  # per replica
    res: int = 32
    classes: int = 10
    loss: str = "ce"
    precision: str = "f64"
    seed: int = 0
    shift: bool = True
    control: str = "none"
    fast_compile: bool = False  # dp.FAST_COMPILE: same numerics, compile-dominated runs faster
    recipe: str | None = None  # whole-step ties (`run_steps_tie`): the recipe's name


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
    a, b = host(a), host(b)
    d = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (d if d > 0 else 1.0))


def grad_err(name: str, ours: dict, ref: dict) -> float:
    """Norm-relative, except for a structural zero — a BN bias whose output reaches another BN
    through a linear map only (MobileNetV4's dw_start BNs): its exact gradient is 0 and any two
    computations return rounding noise, so it is compared against zero on the scale of its BN's
    gamma gradient."""
    a, b = ours[name], ref[name]
    gamma = name[:-len("bias")] + "weight"
    if name.endswith(".bias") and gamma in ref and np.ndim(ref[gamma]) == 1:
        scale = float(np.linalg.norm(host(ref[gamma])))
        if np.linalg.norm(host(b)) <= 1e-10 * scale:
            return float(max(np.linalg.norm(host(a)), np.linalg.norm(host(b))) / scale)
    return rel(a, b)


def tie_precision(name: str) -> Precision:
    """The policy both programs run under. bf16 keeps its rounding points (every conv operand and
    result) with f64 around them: with f32 there, reduction-order noise flips bf16 roundings and
    the net amplifies the flips far above SPEC §5's boundary (see twinstep.ops.precision)."""
    return Precision("bf16", base="f64") if name == "bf16" else get_precision(name)


def setup(cfg: TieConfig, net):
    """Parameters (BN randomised), buffers, the global batch [R N, S, S, 3] and its targets."""
    prec = tie_precision(cfg.precision)
    key = jax.random.key(cfg.seed)
    shapes = net.param_shapes(cfg.classes)
    params = layers.init_params(key, shapes, dtype=prec.dtype)
    params, buffers = layers.randomize_bn(jax.random.fold_in(key, 1), params,
                                          layers.init_buffers(shapes, prec.dtype))
    rng = np.random.default_rng(cfg.seed)
    n = cfg.replicas * cfg.batch
    x = jnp.asarray(rng.standard_normal((n, cfg.res, cfg.res, 3)), prec.dtype)
    if cfg.shift:
        x = dp.shift_shards(x, cfg.replicas, 1.0)
    lam = rng.uniform(0.3, 1.0, (n, 1))  # soft (mixup) targets: both cotangents are affine in t
    a, b = (np.eye(cfg.classes)[rng.integers(0, cfg.classes, n)] for _ in range(2))
    t = jnp.asarray(lam * a + (1 - lam) * b, prec.dtype)
    if cfg.loss == "bce":
        t = losses.bce_targets(t, smoothing=0.1)
    return params, buffers, x, t


def single_program(net, cfg: TieConfig, prec: Precision):
    return _single_program(net, cfg.loss, prec, cfg.fast_compile)


@functools.lru_cache(maxsize=16)
def _single_program(net, loss: str, prec: Precision, fast_compile: bool):
    ctx = layers.Ctx(SINGLE, prec)
    return dp.jit(lambda p, b, x, t: step.grad_step(net, p, b, x, t, ctx, loss), fast_compile)


def _stacked(tree):
    return jax.tree.map(lambda a: a[None], tree)


def replica_program(net, cfg: TieConfig, prec: Precision, collective: bool = True):
    """The replica step; per-replica outputs (statistics, buffers, and without the collective the
    gradients) come back stacked along a leading replica axis, to check they agree."""
    return _replica_program(net, cfg.replicas, cfg.control, cfg.loss, prec, collective,
                            cfg.fast_compile)


@functools.lru_cache(maxsize=16)
def _replica_program(net, replicas: int, control: str, loss: str, prec: Precision,
                     collective: bool, fast_compile: bool):
    rep = dp.replicas(replicas, control)
    ctx = layers.Ctx(rep, prec)

    def fn(p, b, x, t):
        out = step.grad_step(net, p, b, x, t, ctx, loss, collective=collective)
        grads = out.grads if collective else _stacked(out.grads)
        return out._replace(grads=grads, stats=_stacked(out.stats), buffers=_stacked(out.buffers))

    r, s = dp.REPLICATED, dp.BATCH
    return dp.replica_map(fn, replicas, (r, r, s, s),
                          step.StepOut(r, r if collective else s, s, s, s), fast_compile)


def bf16_bound(partials, single):
    """SPEC §5's bound on a bf16 weight gradient, elementwise: |(1/R) sum_r rnd(S_r) - rnd(S)|,
    S = (1/R) sum_r S_r, from the replicas' unrounded partials S_r [R, ...] (for R a power of
    two this is (1/R)|sum_r rnd(S_r) - rnd(sum_r S_r)|) — plus the slack of two f64 sums of the
    same terms in other orders: 1e-12 |S| everywhere, and one bf16 step where S lies within
    1e-12 of a bf16 rounding boundary (there the single device's own S may round the other
    way)."""
    p = np.asarray(partials, np.float64)

    def rnd(v):  # as the programs round (ops.precision.round_to: through f32)
        return np.asarray(v, np.float64).astype(np.float32).astype(jnp.bfloat16).astype(np.float64)

    s = p.mean(0)
    bound = np.abs(rnd(p).mean(0) - rnd(s))
    boundary = rnd(s * (1 + 1e-12)) != rnd(s * (1 - 1e-12))
    step = np.abs(rnd(s * (1 + 2.0 ** -7)) - rnd(s))  # one bf16 step at |S|
    return bound + 1e-12 * np.abs(s) + np.where(boundary, step, 0.0)


def perturbation(dtype) -> float:
    """1e-6 in f32 (about 8 ulps), the same number of ulps in f64 (~1.9e-15): a rounding-sized
    nudge, not a change of the data."""
    return PERTURBATION_F32 * float(jnp.finfo(dtype).eps / jnp.finfo(jnp.float32).eps)


def noise_floor(single, params, buffers, x, t, ref, seed):
    """SENSITIVITY of each gradient, BN statistic and the loss of the single-device step: the
    larger of its relative change under (a) a rounding-sized relative perturbation of the input
    and (b) the same batch in reverse order — the same mathematics summed in other orders,
    which is exactly the freedom the replica program takes (measured at 32², N = 2, R = 4 in
    f32: (b) reaches 1e-2 in layer4, ten times (a)). Returns ({param: s}, {bn: s}, loss s)."""
    u = jax.random.normal(jax.random.key(seed + 1), x.shape, x.dtype)
    moved = [single(params, buffers, x * (1 + perturbation(x.dtype) * u), t),
             single(params, buffers, x[::-1], t[::-1])]
    grads = {n: max(grad_err(n, m.grads, ref.grads) for m in moved) for n in params}
    stats = {n: max(max(rel(m.stats[n].mean, ref.stats[n].mean),
                        rel(m.stats[n].var, ref.stats[n].var)) for m in moved) for n in ref.stats}
    return grads, stats, max(rel(m.loss, ref.loss) for m in moved)


@dataclasses.dataclass
class TieReport:
    config: TieConfig
    parameters: list  # dicts: name, shape, rel_err, abs_err, bound, ok (+ sensitivity)
    bn_sites: list  # dicts: name, mean_rel_err, var_rel_err, ok
    loss: dict
    logits_rel_err: float
    buffers_rel_err: float
    replicas_agree: bool

    @property
    def ok(self) -> bool:
        return (all(p["ok"] for p in self.parameters) and all(b["ok"] for b in self.bn_sites)
                and self.loss["ok"] and self.replicas_agree)

    @property
    def worst(self) -> dict:
        return max(self.parameters, key=lambda p: p["rel_err"])

    def verdict(self) -> str:
        n_ok = sum(p["ok"] for p in self.parameters)
        b_ok = sum(b["ok"] for b in self.bn_sites)
        w = self.worst
        head = "tied" if self.ok else "NOT tied"
        text = (f"{head}: {n_ok}/{len(self.parameters)} parameters, {b_ok}/{len(self.bn_sites)} "
                f"BN sites; worst rel err {w['rel_err']:.1e} ({w['name']})")
        if not self.ok:
            bad = [p["name"] for p in self.parameters if not p["ok"]][:3]
            bad += [b["name"] for b in self.bn_sites if not b["ok"]][:max(0, 3 - len(bad))]
            text += "; first failing: " + ", ".join(bad) if bad else ""
            if not self.replicas_agree:
                text += "; replicas disagree on BN statistics / running buffers"
        return text

    def to_json(self) -> dict:
        return {"verdict": self.verdict(), "ok": self.ok, "config": dataclasses.asdict(self.config),
                "parameters": self.parameters, "bn_sites": self.bn_sites, "loss": self.loss,
                "logits_rel_err": self.logits_rel_err, "buffers_rel_err": self.buffers_rel_err,
                "replicas_agree": self.replicas_agree}


def run_tie(cfg: TieConfig, net=None) -> TieReport:
    from twinstep.nets import get_net

    net = net or get_net(cfg.net)
    prec = tie_precision(cfg.precision)
    params, buffers, x, t = setup(cfg, net)
    single = single_program(net, cfg, prec)
    ref = single(params, buffers, x, t)
    rep = replica_program(net, cfg, prec)(params, buffers, x, t)

    sensitivity, stat_sens, loss_sens = noise_floor(single, params, buffers, x, t, ref, cfg.seed)
    param_floor, stat_floor = FLOORS[prec.name]
    partials = None
    if prec.name == "bf16":
        probe = dataclasses.replace(prec, round_weight_grads=False)
        partials = replica_program(net, cfg, probe, collective=False)(params, buffers, x, t).grads

    def bound(floor, s):
        return max(floor, SENSITIVITY_FACTOR * s)

    parameters = []
    for name, shape in net.param_shapes(cfg.classes).items():
        a, b = host(rep.grads[name]), host(ref.grads[name])
        row = {"name": name, "shape": list(shape), "rel_err": grad_err(name, rep.grads, ref.grads),
               "abs_err": float(np.max(np.abs(a - b))), "sensitivity": sensitivity[name]}
        if prec.name == "bf16" and len(shape) == 4:
            elementwise = bf16_bound(partials[name], b)
            row["bound"] = float(np.linalg.norm(elementwise) / max(np.linalg.norm(b), 1e-300))
            row["bound_kind"] = "bf16 partial-sum rounding (elementwise)"
            row["ok"] = bool(np.all(np.abs(a - b) <= elementwise))
        else:
            row["bound"] = bound(param_floor, sensitivity[name])
            row["ok"] = row["rel_err"] <= row["bound"]
        parameters.append(row)

    bn_sites = []
    for name, s in ref.stats.items():
        r_stats = rep.stats[name]
        m, v = rel(r_stats.mean[0], s.mean), rel(r_stats.var[0], s.var)
        b_site = bound(stat_floor, stat_sens[name])
        bn_sites.append({"name": name, "mean_rel_err": m, "var_rel_err": v, "bound": b_site,
                         "sensitivity": stat_sens[name], "ok": max(m, v) <= b_site})

    agree = all(bool(np.all(a == a[:1]))  # on the host: eager jnp compiles a program per shape
                for a in map(np.asarray, jax.tree.leaves((rep.stats, rep.buffers))))
    loss_err = abs(float(rep.loss) - float(ref.loss)) / abs(float(ref.loss))
    loss_bound = bound(stat_floor, loss_sens)
    buffers_err = max(rel(rep.buffers[k][0], ref.buffers[k]) for k in ref.buffers)
    return TieReport(cfg, parameters, bn_sites,
                     {"replica": float(rep.loss), "single": float(ref.loss), "rel_err": loss_err,
                      "bound": loss_bound, "ok": loss_err <= loss_bound},
                     rel(rep.logits, ref.logits), buffers_err, agree)


def print_report(report: TieReport, show_all: bool = False, seconds: float | None = None,
                 console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = report.config
    console.print(f"[bold]{c.net}[/]: R = {c.replicas} replicas x N = {c.batch} vs one device at "
                  f"{c.replicas * c.batch}; {c.res}², K = {c.classes}, loss {c.loss}, "
                  f"{c.precision}, shift {'on' if c.shift else 'off'}, control {c.control}")
    rows = sorted(report.parameters, key=lambda p: -p["rel_err"] / max(p["bound"], 1e-300))
    shown = report.parameters if show_all else rows[:10]
    table = Table(title="parameter gradients: mean over replicas vs single device" +
                  ("" if show_all else f" (worst 10 of {len(rows)}; --all for every row)"))
    has_sens = any("sensitivity" in p for p in shown)
    table.add_column("parameter", no_wrap=True)
    table.add_column("shape")
    for col in ("rel err", "max abs", "bound") + (("sensitivity",) if has_sens else ()) + ("",):
        table.add_column(col, justify="right")
    for p in shown:
        sens = (f"{p['sensitivity']:.1e}" if "sensitivity" in p else "-",) if has_sens else ()
        table.add_row(p["name"], "x".join(map(str, p["shape"])), f"{p['rel_err']:.1e}",
                      f"{p['abs_err']:.1e}", f"{p['bound']:.1e}", *sens,
                      "[green]ok[/]" if p["ok"] else "[red]FAIL[/]")
    console.print(table)

    sites = sorted(report.bn_sites, key=lambda b: -max(b["mean_rel_err"], b["var_rel_err"]))
    bn = Table(title="forward half: BN sites' global statistics" +
               ("" if show_all else f" (worst 5 of {len(sites)})"))
    bn.add_column("BN site", no_wrap=True)
    for col in ("mean rel err", "var rel err", "bound", ""):
        bn.add_column(col, justify="right")
    for b in sites if show_all else sites[:5]:
        bn.add_row(b["name"], f"{b['mean_rel_err']:.1e}", f"{b['var_rel_err']:.1e}",
                   f"{b['bound']:.1e}", "[green]ok[/]" if b["ok"] else "[red]FAIL[/]")
    console.print(bn)
    lo = report.loss
    console.print(f"loss: replicas {lo['replica']:.12g}, single {lo['single']:.12g} "
                  f"(rel err {lo['rel_err']:.1e}); logits rel err {report.logits_rel_err:.1e}; "
                  f"running statistics rel err {report.buffers_rel_err:.1e}; replicas "
                  f"{'agree' if report.replicas_agree else '[red]DISAGREE[/]'} on statistics "
                  f"and buffers")
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    colour = "green" if report.ok else "red"
    console.print(f"[{colour}]{report.verdict()}[/]{took}")


# ------------------------------------------------------------------ the tie over whole steps


def _named_leaves(tree, prefix: str) -> dict:
    """{group: {leaf name: array}}: the leaves of a state tree grouped by their parent, so that a
    dict of per-parameter arrays (params, Adam's mu and nu, momentum traces, EMA) stays one
    group keyed by timm names, and `grad_err`'s structural-zero rule applies inside it."""
    groups: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [prefix] + step.path_parts(path)
        if len(parts) == 1:  # a bare leaf (the step counter): its own group
            parts = [prefix, prefix]
        groups.setdefault("/".join(parts[:-1]), {})[parts[-1]] = leaf
    return groups


class _Sqrt(collections.abc.Mapping):
    """A group of leaves read as their square roots, one leaf at a time (a whole group's roots
    held together would be another copy of the state's largest tensors)."""

    def __init__(self, leaves: dict):
        self.leaves = leaves

    def __getitem__(self, name):
        return np.sqrt(host(self.leaves[name]))

    def __iter__(self):
        return iter(self.leaves)

    def __len__(self):
        return len(self.leaves)


def compare_states(ours, ref, moved: tuple, floor: float) -> list:
    """One row per state tensor (params, buffers, optimizer state, EMA, step counter), bound
    max(floor, 10 x SENSITIVITY): SENSITIVITY is how far the single device's own trajectories
    ``moved`` (nudged inputs; reordered batches) move from ``ref`` — a trained state inherits
    the conditioning of every step before it, and Adam-type updates divide each element by its
    own magnitude, so a tiny gradient element's rounding becomes an O(lr) parameter change."""
    if jax.tree.structure(ours) != jax.tree.structure(ref):
        raise ValueError("the replica and single-device states differ in structure")
    rows = []
    for field in ours._fields:
        a_groups, b_groups = (_named_leaves(getattr(st, field), field) for st in (ours, ref))
        m_groups = [_named_leaves(getattr(st, field), field) for st in moved]
        for group, b in b_groups.items():
            a, ms = a_groups[group], [m[group] for m in m_groups]
            if group.endswith("/nu"):  # squared gradients: compare on the gradients' scale
                a, b, *ms = (_Sqrt(d) for d in (a, b, *ms))
            for name in b:
                err = grad_err(name, a, b)
                sens = max(grad_err(name, m, b) for m in ms)
                bound = max(floor, SENSITIVITY_FACTOR * sens)
                rows.append({"name": f"{group}/{name}", "shape": list(np.shape(b[name])),
                             "rel_err": err, "sensitivity": sens, "bound": bound,
                             "ok": err <= bound})
    return rows


@dataclasses.dataclass
class StepsReport:
    config: TieConfig
    steps: list  # per step: {"step", "rows": [...], "loss": {...}}

    @property
    def ok(self) -> bool:
        return all(r["ok"] for s in self.steps for r in s["rows"]) and all(
            s["loss"]["ok"] for s in self.steps)

    def verdict(self) -> str:
        rows = [(r, s["step"]) for s in self.steps for r in s["rows"]]
        worst, at = max(rows, key=lambda rs: rs[0]["rel_err"])
        last = self.steps[-1]["rows"]
        head = "tied" if self.ok else "NOT tied"
        text = (f"{head} over {len(self.steps)} steps: {sum(r['ok'] for r in last)}/{len(last)} "
                f"state tensors after the last; worst rel err {worst['rel_err']:.1e} "
                f"({worst['name']}, step {at})")
        if not self.ok:
            bad = [f"{r['name']} (step {s})" for r, s in rows if not r["ok"]][:3]
            text += "; first failing: " + ", ".join(bad)
        return text

    def to_json(self) -> dict:
        return {"verdict": self.verdict(), "ok": self.ok, "config": dataclasses.asdict(self.config),
                "steps": self.steps}


def train_programs(net, recipe, cfg: TieConfig, prec: Precision, opt):
    """(single-device, replica) jitted `step.train_step` of the recipe; each donates the state
    it steps."""
    single_ctx = layers.Ctx(SINGLE, prec)
    rep_ctx = layers.Ctx(dp.replicas(cfg.replicas, cfg.control), prec)

    def single(state, xs, ts, key, row_order):
        return step.train_step(net, recipe, opt, state, xs, ts, key, single_ctx, row_order)

    def replica(state, xs, ts, key):
        return step.train_step(net, recipe, opt, state, xs, ts, key, rep_ctx)

    r, s = dp.REPLICATED, dp.MICRO_BATCH
    return (dp.jit(single, cfg.fast_compile, donate=(0,)),
            dp.replica_map(replica, cfg.replicas, (r, s, s, r), (r, r), cfg.fast_compile,
                           donate=(0,)))


def run_steps_tie(cfg: TieConfig, recipe, steps: int, net=None, replica=None) -> StepsReport:
    """S whole training steps of ``recipe`` (k micro-steps each) on R replicas of N and on one
    device at R N, from the same state and the same global batches and keys; every state tensor
    compared after every step (f64: max(1e-10, 10 x SENSITIVITY) norm-relative per tensor, see
    `compare_states`). ``replica``: the R-replica step to tie, (state, xs [k, R N, ...], ts, key)
    -> (state, metrics) — by default the Python step; `twinstep.render.artifact_step` ties a
    render's deserialized artifact instead. Every program may donate the state it steps: the
    four trajectories start from copies."""
    from twinstep.nets import get_net

    net = net or get_net(cfg.net)
    if cfg.precision != "f64":
        raise ValueError("whole-step ties run in f64 (bf16's boundary: tie --precision bf16)")
    prec = tie_precision(cfg.precision)
    params, buffers, _, _ = setup(cfg, net)
    opt = step.make_optimizer(recipe, params)
    state = step.init_state(recipe, params, buffers, opt)
    single, python_replica = train_programs(net, recipe, cfg, prec, opt)
    replica = replica or python_replica
    rng = np.random.default_rng(cfg.seed + 1)
    n, k = cfg.replicas * cfg.batch, recipe.accum
    ref, (nudged, reordered, ours) = state, jax.device_put((state,) * 3, may_alias=False)
    ours = dp.replicate(ours, cfg.replicas)
    del state, params, buffers  # each trajectory holds only its latest state
    order, reverse = np.arange(n), np.arange(n)[::-1]
    report = StepsReport(cfg, [])
    for s in range(steps):
        xs = rng.standard_normal((k, n, cfg.res, cfg.res, 3))
        if cfg.shift:
            xs = np.stack([dp.shift_shards(x, cfg.replicas, 1.0) for x in xs])
        lam = rng.uniform(0.3, 1.0, (k, n, 1))
        a, b = (np.eye(cfg.classes)[rng.integers(0, cfg.classes, (k, n))] for _ in range(2))
        xs, ts = jnp.asarray(xs, prec.dtype), jnp.asarray(lam * a + (1 - lam) * b, prec.dtype)
        key = jax.random.fold_in(jax.random.key(cfg.seed), s)
        u = jax.random.normal(jax.random.fold_in(key, 1), xs.shape, xs.dtype)
        ref, ref_m = single(ref, xs, ts, key, order)
        # the noise floor: the single device's own trajectory under a rounding-sized input nudge
        # and with every batch reversed (its masks reordered alike) — the same mathematics
        nudged, nudged_m = single(nudged, xs * (1 + perturbation(xs.dtype) * u), ts, key, order)
        reordered, reordered_m = single(reordered, xs[:, ::-1], ts[:, ::-1], key, reverse)
        ours, our_m = replica(ours, xs, ts, key)

        def loss_rel(m, ref_m=ref_m):
            return abs(float(m["loss"]) - float(ref_m["loss"])) / abs(float(ref_m["loss"]))

        loss_bound = max(F64_STAT_BOUND, SENSITIVITY_FACTOR * max(loss_rel(nudged_m),
                                                                  loss_rel(reordered_m)))
        report.steps.append({
            "step": s + 1, "rows": compare_states(ours, ref, (nudged, reordered),
                                                  F64_PARAM_BOUND),
            "loss": {"replica": float(our_m["loss"]), "single": float(ref_m["loss"]),
                     "rel_err": loss_rel(our_m), "bound": loss_bound,
                     "ok": loss_rel(our_m) <= loss_bound}})
    return report


def print_steps_report(report: StepsReport, show_all: bool = False, seconds=None, console=None):
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = report.config
    console.print(f"[bold]{c.net}[/] recipe {c.recipe}: R = {c.replicas} x N = {c.batch} vs one "
                  f"device at {c.replicas * c.batch}; {c.res}², K = {c.classes}, {c.precision}, "
                  f"control {c.control}")
    for s in report.steps:
        rows = sorted(s["rows"], key=lambda r: -r["rel_err"])
        table = Table(title=f"after step {s['step']}: state tensors" +
                      ("" if show_all else f" (worst 5 of {len(rows)})"))
        for col, j in (("tensor", "left"), ("shape", "left"), ("rel err", "right"),
                       ("bound", "right"), ("sensitivity", "right"), ("", "right")):
            table.add_column(col, justify=j, no_wrap=col == "tensor")
        for r in rows if show_all else rows[:5]:
            table.add_row(r["name"], "x".join(map(str, r["shape"])), f"{r['rel_err']:.1e}",
                          f"{r['bound']:.1e}", f"{r['sensitivity']:.1e}",
                          "[green]ok[/]" if r["ok"] else "[red]FAIL[/]")
        console.print(table)
        lo = s["loss"]
        console.print(f"loss: replicas {lo['replica']:.12g}, single {lo['single']:.12g} "
                      f"(rel err {lo['rel_err']:.1e})")
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    console.print(f"[{'green' if report.ok else 'red'}]{report.verdict()}[/]{took}")
