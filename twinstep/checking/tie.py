"""The tie (docs/tie.md): the R-replica gradient step against the single-device step at R·N,
parameter by parameter, BN site by BN site.

Both programs are `twinstep.step.grad_step`: once jitted on the whole batch with no replicas,
once inside ``jax.shard_map`` on R devices with every sync site live. The same parameters (BN
gamma, beta and running statistics randomised, or near timm's initialisation), the same global
batch — its replica shards shifted apart so that Chan's correction term is O(1) — and the same
soft targets go into both. Each tensor is held to its bound (`twinstep.checking.bounds`); how
f32 and bf16 ties are run so that a bound can be both tight and honest is docs/tie.md#f32 and
docs/tie.md#bf16. The tie over whole training steps is `twinstep.checking.trajectory`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding

from twinstep import dp, program, recipes, step
from twinstep.checking import bounds, inputs
from twinstep.checking.bounds import grad_err, host, rel
from twinstep.collectives import CONTROLS, GRADIENT_ONLY_CONTROLS, MASK_CONTROLS
from twinstep.errors import UsageError
from twinstep.nets import NETS, get_net
from twinstep.ops import loss as losses
from twinstep.ops.levers import Levers
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import Precision
from twinstep.processes import cluster, settings

F32_NUDGES = 3  # f32 runs both programs on the batch and on this many nudges of it (`_batches`)

# The parameters a tie starts from: "random-bn" (every BN's gamma, beta and running statistics
# drawn far from the identity: a swapped or mis-wired layer cannot hide) or "near-init" (timm's
# initialisation, nudged: as well conditioned as a network starting to train — f32's default,
# where `random-bn` makes the single device's own f32 gradients move by O(1) under a reordering).
STATES = ("random-bn", "near-init")
# Per precision, what an unset --batch and --state mean. f32's default is where both nets' every
# bound is at most bounds.INCONCLUSIVE_BOUND (docs/tie.md#f32): R = 4, N = 4 rows per replica, so
# that no BN reduces fewer than 16 rows, near-init.
PRECISION_DEFAULTS = {"f64": {"batch": 2, "state": "random-bn"},
                      "bf16": {"batch": 2, "state": "random-bn"},
                      "f32": {"batch": 4, "state": "near-init"}}


DEFAULT_NET = "resnet50"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TieConfig:
    """What the tie runs; checks itself on construction (UsageError, one line, before any
    compile), the recipe parsed once (`parsed_recipe`). ``net``, ``batch`` and ``loss`` left
    None take the recipe's (else `DEFAULT_NET`, `PRECISION_DEFAULTS`' batch and ce)."""

    net: str | None = None
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
    # both programs' levers (`Levers.chosen`: a GPU's on any platform, or one lever alone); those
    # left None: this platform's (docs/precision.md#gpu-levers)
    levers: Levers = Levers()

    def __post_init__(self):
        recipe = None if self.recipe is None else recipes.parse(self.recipe)
        object.__setattr__(self, "_recipe", recipe)
        if self.net is None:
            object.__setattr__(self, "net", recipe.net if recipe else DEFAULT_NET)
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
        self.levers.check(Precision(self.precision))
        if self.precision == "bf16" and self.replicas & (self.replicas - 1):
            raise UsageError("a bf16 tie needs --replicas a power of two: a replica's loss "
                             "cotangent is R times the single device's, and bf16 rounding "
                             "commutes with that scale only for R = 2^k")
        if self.control != "none" and self.replicas < 2:
            raise UsageError(f"--control {self.control} breaks a collective and R = 1 has none: "
                             f"a control that cannot fire is not a pass; use --replicas >= 2")
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

    def parsed_recipe(self) -> recipes.Recipe | None:
        """The recipe, parsed on construction (None without one)."""
        return self._recipe

    def setup(self, prec: Precision) -> program.Setup:
        """The replica side's `twinstep.program.Setup` at ``prec``, with these levers;
        ``.single()`` is the single device it is tied to."""
        return program.Setup(replicas=self.replicas, precision=prec, control=self.control,
                             levers=self.levers)


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


def single_program(net, cfg: TieConfig, prec: Precision):
    """The single-device gradient step at the global batch R N."""
    return _grad_program(net, cfg.setup(prec).single(), loss=cfg.loss, collective=True,
                         per_replica=False, fast_compile=cfg.fast_compile)


def replica_program(net, cfg: TieConfig, prec: Precision, collective: bool = True):
    """The replica step; per-replica outputs (statistics, buffers, and without the collective the
    gradients) come back stacked along a leading replica axis, to check they agree."""
    return _grad_program(net, cfg.setup(prec), loss=cfg.loss, collective=collective,
                         per_replica=True, fast_compile=cfg.fast_compile)


# Ties ask for the same programs again (other seeds, shifts, the tests): one compile each.
_grad_program = functools.lru_cache(maxsize=16)(program.grad_program)


def noise_floor(single, params, buffers, x, t, *, ref, seed):
    """SENSITIVITY of each gradient, BN statistic and the loss of the single-device step: the
    larger of its relative change under (a) a rounding-sized relative perturbation of the input
    and (b) the same batch in reverse order — the same mathematics summed in other orders,
    which is exactly the freedom the replica program takes ((b) is usually the larger:
    docs/tie.md#bounds). Returns ({param: s}, {bn: s}, loss s)."""
    moved = [single(params, buffers, bounds.nudged(x, seed, 1)[0], t),
             single(params, buffers, x[::-1], t[::-1])]
    return bounds.moved_by(moved, ref)


@dataclasses.dataclass
class TieReport(bounds.Verdict):
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
        head, loose = bounds.status(self.within, self._bounds())
        n, b = len(self.parameters), len(self.bn_sites)
        counts = (f"{n_ok}/{n} parameters, {b_ok}/{b} BN sites" if self.within else
                  f"{n - n_ok} of {n} parameters and {b - b_ok} of {b} BN sites outside their "
                  f"bounds")  # a failure counts the failures, not what held
        text = f"{head}: {counts}; worst rel err {w['rel_err']:.1e} ({w['name']})"
        text += bounds.power_text(head, loose, self._bounds())
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
    """(start, the single-device runs, (parameter, BN, loss) SENSITIVITY) of a tie, start being
    `inputs.setup`'s (params, buffers, x, t); the runs are on the batch as given and, in f32, on
    F32_NUDGES nudges of it too (`_batches`). Nothing here depends on the control, so a control
    tied after its tie reuses it (one entry)."""
    prec = inputs.tie_precision(cfg.precision)
    params, buffers, x, t = start = inputs.setup(cfg, net)
    single = single_program(net, cfg, prec)
    batches = _batches(cfg, x)
    runs = [single(params, buffers, xi, t) for xi in batches]
    if len(runs) == 1:
        return start, runs, noise_floor(single, params, buffers, x, t, ref=runs[0], seed=cfg.seed)
    reordered = [single(params, buffers, xi[::-1], t[::-1]) for xi in batches]
    return start, runs, bounds.closest(runs, reordered)


def _batches(cfg: TieConfig, x) -> list:
    """The batches both programs run on: x, and in f32 also its F32_NUDGES nudges. A ReLU whose
    input lies within f32 rounding of zero goes either way, and which way depends on how each
    program rounded its sums — a discrete 1e-4 to 1e-2 in its block's gradients; a nudge of the
    input decides it afresh, for both programs alike (docs/tie.md#f32)."""
    return [x] + (bounds.nudged(x, cfg.seed, F32_NUDGES) if cfg.precision == "f32" else [])


def _run_programs(cfg: TieConfig, net, prec: Precision, say) -> tuple:
    """(start, single-device runs, replica runs — one per `_batches` — SENSITIVITY, whether
    the replicas agree)."""
    say(f"the single-device step at R N = {cfg.replicas * cfg.batch} and its noise floor "
        f"(compiling, running)")
    start, singles, floors = single_side(dataclasses.replace(cfg, control="none"), net)
    params, buffers, x, t = start
    say(f"the replica step, {cfg.replicas} replicas of N = {cfg.batch} (compiling, running)")
    replica = replica_program(net, cfg, prec)
    reps = [_on_replicas(replica, params, buffers, xi, t, cfg=cfg) for xi in _batches(cfg, x)]
    return start, singles, reps, floors, _replicas_agree(*reps)


def _on_replicas(replica, params, buffers, x, t, *, cfg: TieConfig):
    """``replica(params, buffers, x, t)``. With several processes (`twinstep.processes.cluster`)
    the inputs — the same in every process — are placed on the replicas first, each process
    putting its own devices' shards, and every output is gathered back whole into every
    process."""
    if cluster.count() == 1:
        return replica(params, buffers, x, t)
    mesh = dp.mesh(cfg.replicas)
    on_all, by_rows = (NamedSharding(mesh, spec) for spec in (dp.REPLICATED, dp.BATCH))
    return cluster.gathered(cluster.run_together(
        replica, *cluster.placed((params, buffers), on_all), *cluster.placed((x, t), by_rows)))


def run_tie(cfg: TieConfig, net=None, progress=None) -> TieReport:
    """The tie of one gradient step (module docstring). ``progress(text)``: told what runs now."""
    net = net or get_net(cfg.net)
    say = progress or (lambda text: None)
    prec = inputs.tie_precision(cfg.precision)
    settings.check_memory(inputs.memory_floor(cfg, net, prec), inputs.MEMORY_ADVICE)
    start, singles, reps, floors, agree = _run_programs(cfg, net, prec, say)
    ref, rep = singles[0], reps[0]  # on the batch as given
    params, buffers, x, t = start
    sensitivity, stat_sens, loss_sens = floors
    param_floor, stat_floor = bounds.FLOORS[prec.name]
    partials = None
    if prec.name == "bf16":
        say("the replicas' unrounded partial sums (the bf16 bound)")
        probe = dataclasses.replace(prec, round_weight_grads=False)
        partials = _on_replicas(replica_program(net, cfg, probe, collective=False), params,
                                buffers, x, t, cfg=cfg).grads

    parameters = []
    for name, shape in net.param_shapes(cfg.classes).items():
        a, b = host(rep.grads[name]), host(ref.grads[name])
        # f32: the closest of the pairs on one batch (docs/tie.md#f32); else the one pair
        err = min(grad_err(name, r.grads, s.grads) for r, s in zip(reps, singles, strict=True))
        row = {"name": name, "shape": list(shape), "rel_err": err,
               "abs_err": float(np.max(np.abs(a - b))), "sensitivity": sensitivity[name]}
        if prec.name == "bf16" and len(shape) == 4:
            elementwise = bounds.bf16_bound(partials[name])
            row["bound"] = float(np.linalg.norm(elementwise) / max(np.linalg.norm(b), 1e-300))
            row["bound_kind"] = "bf16 partial-sum rounding (elementwise)"
            row["ok"] = bool(np.all(np.abs(a - b) <= elementwise))
        else:
            row["bound"] = bounds.bound(param_floor, sensitivity[name])
            row["ok"] = row["rel_err"] <= row["bound"]
        parameters.append(row)

    bn_sites = []
    for name, s in ref.stats.items():
        r_stats = rep.stats[name]
        m, v = rel(r_stats.mean[0], s.mean), rel(r_stats.var[0], s.var)
        b_site = bounds.bound(stat_floor, stat_sens[name])
        bn_sites.append({"name": name, "mean_rel_err": m, "var_rel_err": v, "bound": b_site,
                         "sensitivity": stat_sens[name], "ok": max(m, v) <= b_site})

    loss_err = abs(float(rep.loss) - float(ref.loss)) / abs(float(ref.loss))
    loss_bound = bounds.bound(stat_floor, loss_sens)
    buffers_err = max(rel(rep.buffers[k][0], ref.buffers[k]) for k in ref.buffers)
    return TieReport(cfg, parameters, bn_sites,
                     {"replica": float(rep.loss), "single": float(ref.loss), "rel_err": loss_err,
                      "bound": loss_bound, "ok": loss_err <= loss_bound},
                     rel(rep.logits, ref.logits), buffers_err, agree)
