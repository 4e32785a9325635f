"""The tie (docs/tie.md): the R-replica step against the single-device step at R·N, parameter by
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
by 1.8e-12). f32 — both programs also run on F32_NUDGES rounding-sized nudges of the batch
(`_batches`); a gradient's error is that of the closest pair on one batch, SENSITIVITY the
second least over the batches of how far its single device moves when a batch is reversed
(`closest`): a ReLU whose input lies within rounding of zero may flip in either program and is
not read as a bug (docs/tie.md#f32).
bf16 — both programs run the bf16 policy's rounding points (every conv operand
and result) with f64 around them and inside the conv accumulators (`tie_precision`): then
every conv sees the same bf16 operands in both programs, everything but the conv weight
gradients is held to the f64 bounds, and each conv weight gradient is checked elementwise
against the bf16 boundary (docs/tie.md) |(1/R) sum_r rnd(S_r) - rnd(S)| from the replicas'
unrounded partial sums S_r (`bf16_bound`); why f64 around bf16 and not f32: see
`twinstep.ops.precision`. R must be a power of two for the boundary to be the only
difference: a replica's loss cotangent is R times the single device's, and rnd(R y) = R rnd(y)
only then.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from twinstep import dp, hosts, program, recipes, runtime, step, synthetic
from twinstep.collectives import CONTROLS, GRADIENT_ONLY_CONTROLS, MASK_CONTROLS
from twinstep.compare import grad_err, host, rel
from twinstep.errors import UsageError
from twinstep.nets import NETS, get_net, layers
from twinstep.ops import loss as losses
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import Precision, get_precision

F64_PARAM_BOUND = 1e-10
F64_STAT_BOUND = 1e-12
F32_FLOOR = 1e-4
# (parameters, BN statistics); bf16 ties run f64 around identical bf16 conv operands
# (`tie_precision`), so everything but the conv weight gradients is held to the f64 bounds
FLOORS = {"f64": (F64_PARAM_BOUND, F64_STAT_BOUND), "f32": (F32_FLOOR, F32_FLOOR),
          "bf16": (F64_PARAM_BOUND, F64_STAT_BOUND)}
SENSITIVITY_FACTOR = 10
# A noise-floor bound above this makes a run inconclusive: where the single device cannot tell
# its own value from 1e-3 of it, a bug of ~1% passes with only a factor 10 to spare
# (docs/tie.md#inconclusive). bf16's elementwise partial-sum bounds are exact, not noise floors.
INCONCLUSIVE_BOUND = 1e-3
EXIT_CODES = {"tied": 0, "NOT tied": 1, "inconclusive": 4}  # the CLI's exit status per verdict


def _status(within: bool, bounds) -> tuple[str, list]:
    """("tied" | "NOT tied" | "inconclusive", the loose rows): a run that fails a bound is NOT
    tied, however loose the others; one within every bound is tied only if no noise-floor bound
    ``bounds`` [(name, bound)] exceeds INCONCLUSIVE_BOUND."""
    loose = sorted(((b, n) for n, b in bounds if b > INCONCLUSIVE_BOUND), reverse=True)
    if not within:
        return "NOT tied", loose
    return ("inconclusive" if loose else "tied"), loose


def _power_text(head: str, loose: list, bounds: list) -> str:
    """What the run could see: the loosest noise-floor bound; for an inconclusive run, how many
    are too loose and what to change."""
    if head != "inconclusive":
        name, bound = max(bounds, key=lambda nb: nb[1])
        return f"; loosest bound {bound:.1e} ({name})"
    bound, name = loose[0]
    return (f"; {len(loose)} of {len(bounds)} bounds exceed {INCONCLUSIVE_BOUND:g} (loosest: "
            f"{name}, {bound:.1e}), where a bug of that size would pass: tie in f64, or where "
            f"the single device is better conditioned (larger --res or --batch)")


STEPS = 3  # whole-step ties: the default number of optimizer steps
PERTURBATION_F32 = 1e-6  # ~8 f32 ulps; other precisions perturb by the same number of ulps
F32_NUDGES = 3  # f32 runs both programs on the batch and on this many nudges of it (`_batches`)


# The parameters a tie starts from: "random-bn" (every BN's gamma, beta and running statistics
# drawn far from the identity: a swapped or mis-wired layer cannot hide) or "near-init" (timm's
# initialisation, nudged: as well conditioned as a network starting to train — f32's default,
# where `random-bn` makes the single device's own f32 gradients move by O(1) under a reordering).
STATES = ("random-bn", "near-init")
# Per precision, what an unset --batch and --state mean. f32's default is where both nets' every
# bound is at most INCONCLUSIVE_BOUND (docs/tie.md#f32): R = 4, N = 4 rows per replica, so that
# no BN reduces fewer than 16 rows, near-init.
PRECISION_DEFAULTS = {"f64": {"batch": 2, "state": "random-bn"},
                      "bf16": {"batch": 2, "state": "random-bn"},
                      "f32": {"batch": 4, "state": "near-init"}}


@dataclasses.dataclass(frozen=True)
class TieConfig:
    """What the tie runs; checks itself on construction (UsageError, one line, before any
    compile). ``batch`` and ``loss`` left None take the recipe's (else 2 and ce)."""

    net: str = "resnet50"
    replicas: int = 4
    batch: int | None = None  # per replica
    res: int = 32
    classes: int = 10
    loss: str | None = None
    precision: str = "f64"
    seed: int = 0
    shift: bool = True
    control: str = "none"
    fast_compile: bool = False  # dp.FAST_COMPILE: same numerics, compile-dominated runs faster
    recipe: str | None = None  # whole-step ties (`run_steps_tie`): the recipe's name
    state: str | None = None  # STATES; None: PRECISION_DEFAULTS's

    def __post_init__(self):
        if self.net not in NETS:
            raise UsageError(f"unknown net {self.net!r}; choose from {sorted(NETS)}")
        for field in ("replicas", "batch", "res"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise UsageError(f"--{field} must be >= 1, got {getattr(self, field)}")
        if self.classes < 2:
            raise UsageError(f"--classes must be >= 2, got {self.classes}")
        if not 0 <= self.seed < 2**31:
            raise UsageError(f"--seed must be >= 0 and < 2^31, got {self.seed}")
        multiple = get_net(self.net).INPUT_MULTIPLE
        if self.res % multiple:
            raise UsageError(f"--res must be a multiple of {multiple} for {self.net}, "
                             f"got {self.res}")
        for field, allowed in (("loss", losses.KINDS), ("precision", PRECISIONS),
                               ("control", tuple(CONTROLS)), ("state", STATES)):
            if getattr(self, field) not in (None, *allowed):
                raise UsageError(f"unknown --{field} {getattr(self, field)!r}; choose from "
                                 f"{', '.join(allowed)}")
        if self.precision == "bf16" and self.replicas & (self.replicas - 1):
            raise UsageError("a bf16 tie needs --replicas a power of two: a replica's loss "
                             "cotangent is R times the single device's, and bf16 rounding "
                             "commutes with that scale only for R = 2^k")
        if self.control != "none" and self.replicas < 2:
            raise UsageError(f"--control {self.control} breaks a collective and R = 1 has none: "
                             f"a control that cannot fire is not a pass; use --replicas >= 2")
        recipe = self.recipe and self.parsed_recipe()
        if recipe is None and self.control in MASK_CONTROLS:
            raise UsageError(f"--control {self.control} needs --recipe with drop-path or "
                             f"dropout")
        if recipe is not None:
            _check_steps_config(self, recipe)
        defaults = PRECISION_DEFAULTS[self.precision]
        object.__setattr__(self, "batch",
                           self.batch or (recipe.batch if recipe else defaults["batch"]))
        object.__setattr__(self, "loss", self.loss or (recipe.loss if recipe else "ce"))
        object.__setattr__(self, "state", self.state or defaults["state"])

    def parsed_recipe(self) -> recipes.Recipe:
        try:
            return recipes.parse(self.recipe)
        except recipes.RecipeError as e:
            raise UsageError(str(e)) from None


def _check_steps_config(cfg: TieConfig, recipe) -> None:
    """What whole-step ties of ``recipe`` cannot do (UsageError, one line)."""
    try:
        step.check_recipe(get_net(cfg.net), recipe)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if cfg.precision != "f64":
        raise UsageError("whole-step ties (--recipe) run in f64; bf16's boundary is checked by "
                         "'twinstep tie NET --precision bf16'")
    if cfg.loss is not None and cfg.loss != recipe.loss:
        raise UsageError(f"--loss {cfg.loss} contradicts the recipe's {recipe.loss}")
    if cfg.control in GRADIENT_ONLY_CONTROLS:
        raise UsageError(f"--control {cfg.control} leaves each replica its own running "
                         f"statistics, which whole steps cannot carry; tie it without --recipe")
    if cfg.control in MASK_CONTROLS and not (recipe.drop or recipe.dropout):
        raise UsageError(f"--control {cfg.control} needs a recipe with drop-path or dropout")


def tie_precision(name: str) -> Precision:
    """The policy both programs run under: bf16 keeps its rounding points with f64 around them
    (why: `twinstep.ops.precision`)."""
    return Precision("bf16", base="f64") if name == "bf16" else get_precision(name)


def setup(cfg: TieConfig, net):
    """Parameters (BN randomised), buffers, the global batch [R N, S, S, 3] and its targets."""
    prec = tie_precision(cfg.precision)
    key = jax.random.key(cfg.seed)
    shapes = net.param_shapes(cfg.classes)
    params = layers.init_params(key, shapes, dtype=prec.dtype)
    buffers = layers.init_buffers(shapes, prec.dtype)
    if cfg.state == "near-init":
        params = layers.near_init_bn(jax.random.fold_in(key, 1), params, net.branch_end_bns())
    else:
        params, buffers = layers.randomize_bn(jax.random.fold_in(key, 1), params, buffers)
    rng = np.random.default_rng(cfg.seed)
    x, t = synthetic.batch(rng, (cfg.replicas * cfg.batch,), cfg.res, cfg.classes, cfg.replicas,
                           cfg.shift, prec.dtype)
    if cfg.loss == "bce":
        t = losses.bce_targets(t, smoothing=0.1)
    return params, buffers, x, t


def _nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def memory_floor(cfg: TieConfig, net, prec: Precision) -> int:
    """A lower bound on the bytes a tie holds at once, from shapes alone (nothing runs): the
    activations the single-device step saves for its backward at R N rows (its tape, by
    jax.eval_shape) and four parameter-sized trees (parameters, buffers, two gradients)."""
    params, buffers = program.abstract_params(net, cfg.classes, prec.dtype)
    x = jax.ShapeDtypeStruct((cfg.replicas * cfg.batch, cfg.res, cfg.res, 3), prec.dtype)
    ctx = program.context(1, prec)

    def saved(p, b, x):  # the tape's arrays (it also holds names)
        return [a for a in jax.tree.leaves(net.forward(p, b, x, ctx)[1]) if hasattr(a, "dtype")]

    return _nbytes(jax.eval_shape(saved, params, buffers, x)) + 4 * _nbytes(params)


MEMORY_ADVICE = "lower --replicas, --batch or --res"


def single_program(net, cfg: TieConfig, prec: Precision):
    """The single-device gradient step at the global batch R N."""
    return _grad_program(net, 1, cfg.loss, prec, "none", True, False, cfg.fast_compile)


def replica_program(net, cfg: TieConfig, prec: Precision, collective: bool = True):
    """The replica step; per-replica outputs (statistics, buffers, and without the collective the
    gradients) come back stacked along a leading replica axis, to check they agree."""
    return _grad_program(net, cfg.replicas, cfg.loss, prec, cfg.control, collective, True,
                         cfg.fast_compile)


# Ties ask for the same programs again (other seeds, shifts, the tests): one compile each.
_grad_program = functools.lru_cache(maxsize=16)(program.grad_program)


def bf16_bound(partials, single):
    """The bound (docs/tie.md) on a bf16 weight gradient, elementwise: |(1/R) sum_r rnd(S_r) -
    rnd(S)|, S = (1/R) sum_r S_r, from the replicas' unrounded partials S_r [R, ...] (for R a power
    of two this is (1/R)|sum_r rnd(S_r) - rnd(sum_r S_r)|) — plus the slack of two f64 sums of the
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


def noise_floor(single, params, buffers, x, t, ref, seed):
    """SENSITIVITY of each gradient, BN statistic and the loss of the single-device step: the
    larger of its relative change under (a) a rounding-sized relative perturbation of the input
    and (b) the same batch in reverse order — the same mathematics summed in other orders,
    which is exactly the freedom the replica program takes ((b) is usually the larger: bench/
    RESULTS.md, "measurements behind the design"). Returns ({param: s}, {bn: s}, loss s)."""
    moved = [single(params, buffers, nudged(x, seed, 1)[0], t),
             single(params, buffers, x[::-1], t[::-1])]
    return moved_by(moved, ref)


class _Verdict:
    """A report's status from its ``within`` and its noise-floor ``_bounds()``."""

    @property
    def status(self) -> str:
        """"tied", "NOT tied" or "inconclusive" (`_status`)."""
        return _status(self.within, self._bounds())[0]

    @property
    def ok(self) -> bool:
        return self.status == "tied"


@dataclasses.dataclass
class TieReport(_Verdict):
    config: TieConfig
    parameters: list  # dicts: name, shape, rel_err, abs_err, bound, ok (+ sensitivity)
    bn_sites: list  # dicts: name, mean_rel_err, var_rel_err, ok
    loss: dict
    logits_rel_err: float
    buffers_rel_err: float
    replicas_agree: bool

    @property
    def within(self) -> bool:
        """Every tensor within its bound and the replicas in agreement."""
        return (all(p["ok"] for p in self.parameters) and all(b["ok"] for b in self.bn_sites)
                and self.loss["ok"] and self.replicas_agree)

    def _bounds(self) -> list:
        """(name, bound) of every noise-floor bound (not bf16's elementwise ones)."""
        return ([(p["name"], p["bound"]) for p in self.parameters if "bound_kind" not in p]
                + [(b["name"], b["bound"]) for b in self.bn_sites] + [("loss", self.loss["bound"])])

    @property
    def worst(self) -> dict:
        return max(self.parameters, key=lambda p: p["rel_err"])

    def verdict(self) -> str:
        n_ok = sum(p["ok"] for p in self.parameters)
        b_ok = sum(b["ok"] for b in self.bn_sites)
        w = self.worst
        head, loose = _status(self.within, self._bounds())
        text = (f"{head}: {n_ok}/{len(self.parameters)} parameters, {b_ok}/{len(self.bn_sites)} "
                f"BN sites; worst rel err {w['rel_err']:.1e} ({w['name']})")
        text += _power_text(head, loose, self._bounds())
        if not self.within:
            bad = [p["name"] for p in self.parameters if not p["ok"]][:3]
            bad += [b["name"] for b in self.bn_sites if not b["ok"]][:max(0, 3 - len(bad))]
            text += "; first failing: " + ", ".join(bad) if bad else ""
            if not self.replicas_agree:
                text += "; replicas disagree on BN statistics / running buffers"
        return text

    def to_json(self) -> dict:
        return {"verdict": self.verdict(), "status": self.status, "ok": self.ok,
                "config": dataclasses.asdict(self.config),
                "parameters": self.parameters, "bn_sites": self.bn_sites, "loss": self.loss,
                "logits_rel_err": self.logits_rel_err, "buffers_rel_err": self.buffers_rel_err,
                "replicas_agree": self.replicas_agree}


def _replicas_agree(*reps) -> bool:
    """Every replica holds bitwise the same BN statistics and running buffers (on the host:
    eager jnp compiles a program per shape)."""
    return all(bool(np.all(a == a[:1]))
               for a in map(np.asarray, jax.tree.leaves([(r.stats, r.buffers) for r in reps])))


@functools.lru_cache(maxsize=1)
def single_side(cfg: TieConfig, net) -> tuple:
    """(inputs, the single-device runs, (parameter, BN, loss) SENSITIVITY) of a tie; the runs
    are on the batch as given and, in f32, on F32_NUDGES nudges of it too (`_batches`). Nothing
    here depends on the control, so a control tied after its tie reuses it (one entry)."""
    prec = tie_precision(cfg.precision)
    params, buffers, x, t = inputs = setup(cfg, net)
    single = single_program(net, cfg, prec)
    batches = _batches(cfg, x)
    runs = [single(params, buffers, xi, t) for xi in batches]
    if len(runs) == 1:
        return inputs, runs, noise_floor(single, params, buffers, x, t, runs[0], cfg.seed)
    reordered = [single(params, buffers, xi[::-1], t[::-1]) for xi in batches]
    return inputs, runs, closest(runs, reordered)


def closest(runs: list, reordered: list) -> tuple:
    """f32's SENSITIVITY: per tensor, how far the single device moves when one of its batches is
    summed in reverse order — the freedom the replica program takes — the second least over the
    batches: not the least, which one unusually quiet batch sets too low (from random BN a run
    with no bug then read NOT tied), nor the median, which two batches whose reversal flips a
    ReLU set too high (bench/RESULTS.md, "f32 ties at their defaults")."""
    parts = [moved_by([m], r) for r, m in zip(runs, reordered, strict=True)]
    grads, stats = ({k: _second_least(p[j][k] for p in parts) for k in parts[0][j]}
                    for j in (0, 1))
    return grads, stats, _second_least(p[2] for p in parts)


def _second_least(values) -> float:
    return sorted(values)[1]


def _batches(cfg: TieConfig, x) -> list:
    """The batches both programs run on: x, and in f32 also its F32_NUDGES nudges. A ReLU whose
    input lies within f32 rounding of zero goes either way, and which way depends on how each
    program rounded its sums — a discrete 1e-4 to 1e-2 in its block's gradients; a nudge of the
    input decides it afresh, for both programs alike (docs/tie.md#f32)."""
    return [x] + (nudged(x, cfg.seed, F32_NUDGES) if cfg.precision == "f32" else [])


def _run_programs(cfg: TieConfig, net, prec: Precision, say) -> tuple:
    """(inputs, single-device runs, replica runs — one per `_batches` — SENSITIVITY, whether
    the replicas agree)."""
    say(f"the single-device step at R N = {cfg.replicas * cfg.batch} and its noise floor "
        f"(compiling, running)")
    inputs, singles, floors = single_side(dataclasses.replace(cfg, control="none"), net)
    params, buffers, x, t = inputs
    say(f"the replica step, {cfg.replicas} replicas of N = {cfg.batch} (compiling, running)")
    replica = replica_program(net, cfg, prec)
    reps = [_on_replicas(replica, cfg, params, buffers, xi, t) for xi in _batches(cfg, x)]
    return inputs, singles, reps, floors, _replicas_agree(*reps)


def _on_replicas(replica, cfg: TieConfig, params, buffers, x, t):
    """``replica(params, buffers, x, t)``. With several processes (`twinstep.hosts`) the inputs —
    the same in every process — are placed on the replicas first, each process putting its
    own devices' shards, and every output is gathered back whole into every process."""
    if hosts.count() == 1:
        return replica(params, buffers, x, t)
    mesh = dp.mesh(cfg.replicas)
    on_all, by_rows = (NamedSharding(mesh, spec) for spec in (dp.REPLICATED, dp.BATCH))
    return hosts.gathered(hosts.run_together(replica, *hosts.placed((params, buffers), on_all),
                                             *hosts.placed((x, t), by_rows)))


def run_tie(cfg: TieConfig, net=None, progress=None) -> TieReport:
    """The tie of one gradient step (module docstring). ``progress(text)``: told what runs now."""
    net = net or get_net(cfg.net)
    say = progress or (lambda text: None)
    prec = tie_precision(cfg.precision)
    runtime.check_memory(memory_floor(cfg, net, prec), MEMORY_ADVICE)
    inputs, singles, reps, floors, agree = _run_programs(cfg, net, prec, say)
    ref, rep = singles[0], reps[0]  # on the batch as given
    params, buffers, x, t = inputs
    sensitivity, stat_sens, loss_sens = floors
    param_floor, stat_floor = FLOORS[prec.name]
    partials = None
    if prec.name == "bf16":
        say("the replicas' unrounded partial sums (the bf16 bound)")
        probe = dataclasses.replace(prec, round_weight_grads=False)
        partials = _on_replicas(replica_program(net, cfg, probe, collective=False), cfg,
                                params, buffers, x, t).grads

    def bound(floor, s):
        return max(floor, SENSITIVITY_FACTOR * s)

    parameters = []
    for name, shape in net.param_shapes(cfg.classes).items():
        a, b = host(rep.grads[name]), host(ref.grads[name])
        # f32: the closest of the pairs on one batch (docs/tie.md#f32); else the one pair
        err = min(grad_err(name, r.grads, s.grads) for r, s in zip(reps, singles, strict=True))
        row = {"name": name, "shape": list(shape), "rel_err": err,
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

    loss_err = abs(float(rep.loss) - float(ref.loss)) / abs(float(ref.loss))
    loss_bound = bound(stat_floor, loss_sens)
    buffers_err = max(rel(rep.buffers[k][0], ref.buffers[k]) for k in ref.buffers)
    return TieReport(cfg, parameters, bn_sites,
                     {"replica": float(rep.loss), "single": float(ref.loss), "rel_err": loss_err,
                      "bound": loss_bound, "ok": loss_err <= loss_bound},
                     rel(rep.logits, ref.logits), buffers_err, agree)


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
class StepsReport(_Verdict):
    config: TieConfig
    steps: list  # per step: {"step", "rows": [...], "loss": {...}}
    artifact: str | None = None  # the render tied (NAME.jaxexport), if not the Python step

    @property
    def within(self) -> bool:
        return all(r["ok"] for s in self.steps for r in s["rows"]) and all(
            s["loss"]["ok"] for s in self.steps)

    def _bounds(self) -> list:
        return [(f"{r['name']} (step {s['step']})", r["bound"]) for s in self.steps
                for r in [*s["rows"], {"name": "loss", **s["loss"]}]]

    def verdict(self) -> str:
        rows = [(r, s["step"]) for s in self.steps for r in s["rows"]]
        worst, at = max(rows, key=lambda rs: rs[0]["rel_err"])
        last = self.steps[-1]["rows"]
        head, loose = _status(self.within, self._bounds())
        text = (f"{head} over {len(self.steps)} steps: {sum(r['ok'] for r in last)}/{len(last)} "
                f"state tensors after the last; worst rel err {worst['rel_err']:.1e} "
                f"({worst['name']}, step {at})")
        text += _power_text(head, loose, self._bounds())
        if not self.within:
            bad = [f"{r['name']} (step {s})" for r, s in rows if not r["ok"]][:3]
            text += "; first failing: " + ", ".join(bad)
        return text

    def to_json(self) -> dict:
        out = {"verdict": self.verdict(), "status": self.status, "ok": self.ok,
               "config": dataclasses.asdict(self.config), "steps": self.steps}
        return out | ({"artifact": self.artifact} if self.artifact else {})


def train_programs(net, recipe, cfg: TieConfig, prec: Precision) -> tuple:
    """(single-device at R N, R-replica) `program.TrainProgram`s of the recipe; each step
    donates the state it steps."""
    kw = {"classes": cfg.classes, "precision": prec, "donate": True,
          "fast_compile": cfg.fast_compile}
    return (program.train_program(net, recipe, replicas=1, **kw),
            program.train_program(net, recipe, replicas=cfg.replicas, control=cfg.control, **kw))


def run_steps_tie(cfg: TieConfig, recipe=None, steps: int = STEPS, net=None, replica=None,
                  progress=None) -> StepsReport:
    """S whole training steps of ``recipe`` (default: cfg.recipe's; k micro-steps each) on R
    replicas of N and on one device at R N, from the same state and the same global batches and
    keys; every state tensor compared after every step (f64: max(1e-10, 10 x SENSITIVITY)
    norm-relative per tensor, see `compare_states`). ``replica``: the R-replica step to tie,
    (state, xs [k, R N, ...], ts, key) -> (state, metrics) — by default the Python step;
    `twinstep.program.artifact_program` ties a render's deserialized artifact instead. Every
    program may donate the state it steps: the four trajectories start from copies.
    ``progress(text)``: told what runs now."""
    net = net or get_net(cfg.net)
    recipe = recipe or cfg.parsed_recipe()
    if cfg.precision != "f64":
        raise UsageError("whole-step ties run in f64 (bf16's boundary: tie --precision bf16)")
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    say = progress or (lambda text: None)
    prec = tie_precision(cfg.precision)
    single, python_replica = train_programs(net, recipe, cfg, prec)
    # four trajectories, each one state, and a micro-batch's activations
    runtime.check_memory(memory_floor(cfg, net, prec) + 4 * _nbytes(single.state),
                         MEMORY_ADVICE)
    params, buffers, _, _ = setup(cfg, net)
    state = single.init(params, buffers)
    rng = np.random.default_rng(cfg.seed + 1)
    n, k = cfg.replicas * cfg.batch, recipe.accum
    ref, (nudged, reordered, ours) = state, jax.device_put((state,) * 3, may_alias=False)
    # a render's step takes its state replicated (its manifest's layout)
    ours = python_replica.place(ours) if replica is None else dp.replicate(ours, cfg.replicas)
    replica = replica or python_replica.step
    del state, params, buffers  # each trajectory holds only its latest state
    order, reverse = np.arange(n), np.arange(n)[::-1]
    report = StepsReport(cfg, [])
    for s in range(steps):
        xs, ts = synthetic.batch(rng, (k, n), cfg.res, cfg.classes, cfg.replicas, cfg.shift,
                                 prec.dtype)
        key = jax.random.fold_in(jax.random.key(cfg.seed), s)
        u = jax.random.normal(jax.random.fold_in(key, 1), xs.shape, xs.dtype)
        say(f"step {s + 1}/{steps}: the single device at R N = {n}"
            + (" (compiling)" if s == 0 else ""))
        ref, ref_m = single.step(ref, xs, ts, key, order)
        # the noise floor: the single device's own trajectory under a rounding-sized input nudge
        # and with every batch reversed (its masks reordered alike) — the same mathematics
        say(f"step {s + 1}/{steps}: the noise floor (nudged and reordered single-device runs)")
        nudged, nudged_m = single.step(nudged, xs * (1 + perturbation(xs.dtype) * u), ts, key,
                                       order)
        reordered, reordered_m = single.step(reordered, xs[:, ::-1], ts[:, ::-1], key, reverse)
        say(f"step {s + 1}/{steps}: {cfg.replicas} replicas of N = {cfg.batch}"
            + (" (compiling)" if s == 0 else ""))
        ours, our_m = replica(ours, xs, ts, key)
        say(f"step {s + 1}/{steps}: comparing every state tensor")
        report.steps.append({"step": s + 1,
                             "rows": compare_states(ours, ref, (nudged, reordered),
                                                    F64_PARAM_BOUND),
                             "loss": _loss_row(our_m, ref_m, (nudged_m, reordered_m),
                                               F64_STAT_BOUND)})
    return report


def _loss_row(ours: dict, ref: dict, moved: tuple, floor: float) -> dict:
    """The step's reported loss against the single device's, bound max(floor, 10 x what the
    single device's own ``moved`` trajectories move it by)."""
    def loss_rel(m):
        return abs(float(m["loss"]) - float(ref["loss"])) / abs(float(ref["loss"]))

    bound = max(floor, SENSITIVITY_FACTOR * max(map(loss_rel, moved)))
    return {"replica": float(ours["loss"]), "single": float(ref["loss"]),
            "rel_err": loss_rel(ours), "bound": bound, "ok": loss_rel(ours) <= bound}
