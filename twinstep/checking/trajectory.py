"""The tie over whole training steps (``twinstep tie --recipe``, ``--render``;
docs/tie.md#whole-steps): S steps of a recipe — k micro-steps, clip, optimizer, EMA, masks
drawn for the global batch — on R replicas and on one device at R·N, from the same state,
batches and keys; every state tensor held to its bound (docs/tie.md#bounds) after every step,
SENSITIVITY measured on the single device's own trajectories (a nudged input; every batch
reversed with its masks).
"""

from __future__ import annotations

import collections.abc
import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding

from twinstep import dp, program, step
from twinstep.checking import bounds, inputs
from twinstep.checking.bounds import grad_err, host
from twinstep.checking.inputs import MEMORY_ADVICE, memory_floor, nbytes, setup, tie_precision
from twinstep.checking.tie import TieConfig
from twinstep.errors import UsageError
from twinstep.nets import get_net
from twinstep.ops.precision import Precision
from twinstep.processes import cluster, settings

STEPS = 3  # the default number of optimizer steps


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
    """One row per state tensor (params, buffers, optimizer state, EMA, step counter), held to
    `bounds.bound` (floor, SENSITIVITY): SENSITIVITY is how far the single device's own trajectories
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
                limit = bounds.bound(floor, sens)
                rows.append({"name": f"{group}/{name}", "shape": list(np.shape(b[name])),
                             "rel_err": err, "sensitivity": sens, "bound": limit,
                             "ok": err <= limit})
    return rows


@dataclasses.dataclass
class StepsReport(bounds.Verdict):
    config: TieConfig
    steps: list  # per step: {"step", "rows": [...], "loss": {...}}
    render: str | None = None  # the render tied (NAME.jaxexport), if not the Python step
    # in a process other than 0, which compares nothing (``steps`` empty): process 0's status
    shared_status: str | None = None

    @property
    def status(self) -> str:
        return self.shared_status or super().status

    @property
    def within(self) -> bool:
        return all(r["ok"] for s in self.steps for r in s["rows"]) and all(
            s["loss"]["ok"] for s in self.steps)

    def _bounds(self) -> list:
        return [(f"{r['name']} (step {s['step']})", r["bound"]) for s in self.steps
                for r in [*s["rows"], {"name": "loss", **s["loss"]}]]

    def verdict(self) -> str:
        if self.shared_status and not self.steps:
            return f"{self.shared_status} (compared in process 0)"
        rows = [(r, s["step"]) for s in self.steps for r in s["rows"]]
        worst, at = max(rows, key=lambda rs: rs[0]["rel_err"])
        last = self.steps[-1]["rows"]
        head, loose = bounds.status(self.within, self._bounds())
        held = sum(r["ok"] for r in last)
        counts = (f"{held}/{len(last)} state tensors after the last" if self.within else
                  f"{len(last) - held} of {len(last)} state tensors outside their bounds after "
                  f"the last")  # a failure counts the failures, not what held
        steps = f"{len(self.steps)} step" + ("s" if len(self.steps) != 1 else "")
        text = (f"{head} over {steps}: {counts}; worst rel err "
                f"{worst['rel_err']:.1e} ({worst['name']}, step {at})")
        text += bounds.power_text(head, loose, self._bounds())
        if not self.within:
            bad = [f"{r['name']} (step {s})" for r, s in rows if not r["ok"]][:3]
            text += "; first failing: " + ", ".join(bad)
        return text

    def to_json(self) -> dict:
        out = {"verdict": self.verdict(), "status": self.status, "ok": self.ok,
               "config": dataclasses.asdict(self.config), "steps": self.steps}
        return out | ({"render": self.render} if self.render else {})


def train_programs(net, recipe, cfg: TieConfig, prec: Precision) -> tuple:
    """(single-device at R N, R-replica) `program.TrainProgram`s of the recipe; each step
    donates the state it steps."""
    kw = {"classes": cfg.classes, "donate": True, "fast_compile": cfg.fast_compile}
    setup = cfg.setup(prec)
    return (program.train_program(net, recipe, setup.single(), **kw),
            program.train_program(net, recipe, setup, **kw))


def run_steps_tie(cfg: TieConfig, recipe=None, *, steps: int = STEPS, net=None, replica=None,
                  progress=None) -> StepsReport:
    """S whole training steps of ``recipe`` (default: cfg.recipe's; k micro-steps each) on R
    replicas of N and on one device at R N, from the same state and the same global batches and
    keys; every state tensor compared after every step (`compare_states`). ``replica``: the
    R-replica step to tie, (state, xs [k, R N, ...], ts, key) -> (state, metrics) — by default
    the Python step; `twinstep.rendering.reader.step` ties a render instead. Every program may
    donate the state it steps: the four trajectories start from copies. With several processes
    (`twinstep.processes.cluster`) all run the replica step, and only process 0 runs the
    single device's and compares; the others' report is empty and carries its status.
    ``progress(text)``: told what runs now."""
    net = net or get_net(cfg.net)
    recipe = recipe or cfg.parsed_recipe()
    if cfg.precision != "f64":
        raise UsageError("whole-step ties run in f64 (bf16's boundary: tie --precision bf16)")
    if steps < 1:
        raise UsageError(f"--steps must be >= 1, got {steps}")
    say = progress or (lambda text: None)
    primary = cluster.is_primary()  # the single device's side runs in process 0 alone
    prec = tie_precision(cfg.precision)
    single, python_replica = train_programs(net, recipe, cfg, prec)
    # four trajectories, each one state, and a micro-batch's activations
    settings.check_memory(memory_floor(cfg, net, prec) + 4 * nbytes(single.state),
                          MEMORY_ADVICE)
    params, buffers, _, _ = setup(cfg, net)
    state = single.init(params, buffers)
    rng = np.random.default_rng(cfg.seed + 1)
    n, k = cfg.replicas * cfg.batch, recipe.accum
    ref, (nudged, reordered, ours) = state, jax.device_put((state,) * 3, may_alias=False)
    # a render's step takes its state replicated (its manifest's layout)
    ours = python_replica.place(ours) if replica is None else dp.replicate(ours, cfg.replicas)
    replica = _together(replica or python_replica.step, cfg.replicas)
    del state, params, buffers  # each trajectory holds only its latest state
    order, reverse = np.arange(n), np.arange(n)[::-1]
    report = StepsReport(cfg, [])
    for s in range(steps):
        xs, ts = inputs.batch(rng, (k, n), res=cfg.res, classes=cfg.classes,
                              replicas=cfg.replicas, shift=cfg.shift, dtype=prec.dtype)
        key = jax.random.fold_in(jax.random.key(cfg.seed), s)
        u = jax.random.normal(jax.random.fold_in(key, 1), xs.shape, xs.dtype)
        if primary:
            say(f"step {s + 1}/{steps}: the single device at R N = {n}"
                + (" (compiling)" if s == 0 else ""))
            ref, ref_m = single.step(ref, xs, ts, key, order)
            # the noise floor: the single device's own trajectory under a rounding-sized input
            # nudge and with every batch reversed (its masks reordered alike) — the same
            # mathematics
            say(f"step {s + 1}/{steps}: the noise floor (nudged and reordered single-device "
                f"runs)")
            nudged, nudged_m = single.step(nudged, xs * (1 + bounds.perturbation(xs.dtype) * u),
                                           ts, key, order)
            reordered, reordered_m = single.step(reordered, xs[:, ::-1], ts[:, ::-1], key,
                                                 reverse)
        say(f"step {s + 1}/{steps}: {cfg.replicas} replicas of N = {cfg.batch}"
            + (" (compiling)" if s == 0 else ""))
        ours, our_m = replica(ours, xs, ts, key)
        gathered = cluster.gathered((ours, our_m))  # every process gathers together
        if primary:
            say(f"step {s + 1}/{steps}: comparing every state tensor")
            report.steps.append({
                "step": s + 1,
                "rows": compare_states(gathered[0], ref, (nudged, reordered),
                                       bounds.F64_PARAM_BOUND),
                "loss": _loss_row(gathered[1], ref_m, (nudged_m, reordered_m),
                                  bounds.F64_STAT_BOUND)})
    if cluster.count() > 1:
        report.shared_status = cluster.from_primary("steps tie status",
                                                    report.status if primary else None)
    return report


def _together(replica, replicas: int):
    """``replica`` as every process calls it (`twinstep.processes.cluster`; as is in one
    process): the global batch — the same in every process — laid out by rows first, each
    process putting its own devices' rows, and the step run once all have compiled it."""
    if cluster.count() == 1:
        return replica
    rows = NamedSharding(dp.mesh(replicas), dp.MICRO_BATCH)

    def run(state, xs, ts, key):
        return cluster.run_together(replica, state, *cluster.placed((xs, ts), rows), key)

    return run


def _loss_row(ours: dict, ref: dict, moved: tuple, floor: float) -> dict:
    """The step's reported loss against the single device's, held to `bounds.bound` (floor,
    what the single device's own ``moved`` trajectories move it by)."""
    def loss_rel(m):
        return abs(float(m["loss"]) - float(ref["loss"])) / abs(float(ref["loss"]))

    limit = bounds.bound(floor, max(map(loss_rel, moved)))
    return {"replica": float(ours["loss"]), "single": float(ref["loss"]),
            "rel_err": loss_rel(ours), "bound": limit, "ok": loss_rel(ours) <= limit}
