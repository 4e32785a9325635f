"""The training loop tied to timm's: `twinstep train` (R = 2 replicas, float64, on the digits)
against timm's own components in a torch loop written as timm's train.py writes it — the same
initial weights, the same (seed, step) batches, the recipe's optimizer (create_optimizer_v2),
schedule (create_scheduler_v2 stepped per update), loss, clip, accumulation and EMA
(ModelEmaV3) — compared after every optimizer step: every parameter, BN running statistic,
optimizer moment and EMA tensor, and the lr (docs/recipes.md#the-loop-against-timm).

Each tensor's bound is the tie's (`bounds.bound`): the f64 floor, or ten times how far timm's
own loop moves when every micro-batch's rows are reversed (the same mathematics summed in
another order). Its controls change one thing on timm's side — the scheduler stepped per epoch,
the warmup from 0, BN momentum 0.01, the EMA's warmup, weight decay on BN and bias — and each
must fail the comparison.
"""

import copy

import numpy as np
import pytest
import timm_recipe
from oracle_libs import timm, torch

from twinstep.checking import bounds

# test-all only: a float64 ResNet-50 run beside timm's loops peaks at 10.6-11.7 GB of RSS (its
# replicated LAMB state, a checkpoint in flight and one read back, three torch loops), more than
# make test's two workers can share on a 24 GB machine
pytestmark = [pytest.mark.oracle, pytest.mark.slow, pytest.mark.all]
STEPS, RES, REPLICAS = 12, 32, 2  # 12 optimizer steps cross the warmup's end (W = 1)
RECIPES = {"adamw": "resnet50in_emaaccdp2x2wx",  # AdamW, EMA, k = 2
           "lamb": "resnet50in_lambaccdp2x2wxclipbce"}  # LAMB, BCE, clip, k = 2
CONTROLS = ("per-epoch", "warmup-from-0", "bn-momentum", "ema-warmup", "decay-everything")


def _timm_loop(model, recipe, moved: str = "", control: str = "none"):
    """timm's components, stepped as train.py steps them: yields a snapshot after every update
    (one at a time: a float64 ResNet-50 state with its moments and EMA is ~0.8 GB). ``moved``:
    "reversed" (every micro-batch's rows in reverse order) or "nudged" (every input times
    1 + a rounding-sized N(0, 1) draw): the same mathematics, the noise floor's twins."""
    from twinstep.data import loader

    model = copy.deepcopy(model)
    opt = timm_recipe.optimizer(model, recipe, control)
    sched, per = timm_recipe.scheduler(opt, recipe, control)
    ema = timm_recipe.ema(model, recipe, control)
    loss_fn = timm_recipe.loss(recipe)
    src = loader.source("digits", RES)
    batches = loader.train_stream(src, loader.Augment(), 0, 0, STEPS, recipe.accum,
                                  REPLICAS * recipe.batch, 0)
    named = dict(model.named_parameters())
    updates = 0
    for xs, labels, *_ in batches:
        lr = opt.param_groups[0]["lr"]
        for x, y in zip(xs, labels, strict=True):
            x = torch.tensor(np.asarray(x, np.float64).transpose(0, 3, 1, 2))
            y = torch.tensor(np.asarray(y, np.int64))
            if moved == "reversed":
                x, y = x.flip(0), y.flip(0)
            elif moved == "nudged":
                u = np.random.default_rng([updates, len(x)]).standard_normal(x.shape)
                x = x * (1 + bounds.perturbation(np.float64) * torch.tensor(u))
            (loss_fn(model(x), y) / recipe.accum).backward()
        updates = timm_recipe.update(model, recipe, opt, sched, per, ema, updates)
        state = {k: opt.state[p] for k, p in named.items()}
        yield {  # views of the live tensors: read before the loop is advanced
            "lr": lr, "params": {k: p.detach().numpy() for k, p in named.items()},
            "buffers": _buffers(model),
            "mu": {k: s["exp_avg"].numpy() for k, s in state.items()},
            "nu": {k: s["exp_avg_sq"].numpy() for k, s in state.items()},
            **({"ema": {k: v.detach().numpy() for k, v in ema.module.named_parameters()},
                "ema_buffers": _buffers(ema.module)} if ema is not None else {})}


def _buffers(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.named_buffers()
            if not k.endswith("num_batches_tracked")}


def _ours(state: dict) -> dict:
    """A twinstep checkpoint in `_timm_loop`'s groups."""
    adam = next(s for s in state["opt_state"] if isinstance(s, dict) and "mu" in s)
    out = {"params": state["params"], "buffers": state["buffers"], "mu": adam["mu"],
           "nu": adam["nu"]}
    if state.get("ema") is not None:
        out["ema"], out["ema_buffers"] = state["ema"]
    return out


GROUPS = ("params", "buffers", "mu", "nu", "ema", "ema_buffers")


def _groups(snapshot: dict) -> dict:
    """A snapshot's groups, Adam's second moments on the gradients' scale (square roots)."""
    return {g: ({k: np.sqrt(np.asarray(v, np.float64)) for k, v in snapshot[g].items()}
                if g == "nu" else snapshot[g]) for g in GROUPS if g in snapshot}


def _sensitivity(ref: dict, moved: list[dict]) -> dict:
    """{(group, name): how far timm's own moved twins are from its loop} at one step."""
    ref, moved = _groups(ref), [_groups(m) for m in moved]
    return {(g, n): max(_err(n, m[g], ref[g]) for m in moved) for g in ref for n in ref[g]}


def _rows(ours: dict, ref: dict, sensitivity: dict) -> list[dict]:
    """One row per tensor: its error against timm's, held to the tie's bound from timm's own
    noise floor (`bounds.bound`: the f64 floor, or ten times ``sensitivity``)."""
    ours, ref = _groups(ours), _groups(ref)
    rows = []
    for g in ref:
        for name in ref[g]:
            err = _err(name, ours[g], ref[g])
            limit = bounds.bound(bounds.F64_PARAM_BOUND, sensitivity[g, name])
            rows.append({"group": g, "name": name, "err": err, "bound": limit, "ok": err <= limit})
    return rows


def _compared(name: str, tmp, controls: tuple = ()) -> dict:
    """`twinstep train` of recipe ``name`` with timm's loops stepped beside it: after each
    optimizer step the checkpoint (written every step, the last few kept) is compared with
    timm's loop, its reordered twin and each control's. Returns {"rows": {control: [rows of
    every step]}, "lr": {control: [(ours, timm's)]}}."""
    from twinstep import api
    from twinstep.nets import get_net
    from twinstep.training import state_dict
    from twinstep.training.checkpoint import load_state
    from twinstep.training.config import TrainConfig

    out = str(tmp / "run")
    recipe = TrainConfig(name, out, replicas=REPLICAS, res=RES, steps=STEPS,
                         precision="f64").parsed_recipe()
    torch.manual_seed(0)
    model = timm.create_model(get_net(recipe.net).TIMM_NAME, num_classes=10).double()
    weights = str(tmp / "start.safetensors")
    state_dict.save(weights, {k: v.numpy() for k, v in model.state_dict().items()
                              if not k.endswith("num_batches_tracked")})
    twins = [_timm_loop(model, recipe, moved=m) for m in ("reversed", "nudged")]
    loops = {c: _timm_loop(model, recipe, control=c) for c in ("none", *controls)
             if c != "ema-warmup" or recipe.ema}
    found = {"rows": {c: [] for c in loops}, "lr": {c: [] for c in loops}}

    def compare(step: int, lr: float) -> None:
        ours, refs = _ours(load_state(out, step)), {c: next(loop) for c, loop in loops.items()}
        sensitivity = _sensitivity(refs["none"], [next(t) for t in twins])
        for control, ref in refs.items():  # a control is held to timm's own noise floor
            found["lr"][control].append((lr, ref["lr"]))
            found["rows"][control] += [{**r, "step": step}
                                       for r in _rows(ours, ref, sensitivity)]

    lrs = {}

    def progress(step: int, metrics: dict) -> None:
        lrs[step] = metrics["lr"]
        if step >= 2:  # step - 1's checkpoint is whole: step's own save waited for it
            compare(step - 1, lrs[step - 1])

    api.train(name, out, replicas=REPLICAS, res=RES, steps=STEPS, precision="f64",
              ckpt_every=1, keep=3, eval_every=STEPS, log_every=1, init_from=weights,
              progress=progress)
    compare(STEPS, lrs[STEPS])
    return found


def _err(name: str, ours: dict, ref: dict) -> float:
    """`bounds.grad_err`, and |ours| where ref's tensor and its BN's gamma are both exactly 0
    (ResNet's zero_init_last at step 1: every gradient inside a residual branch is 0)."""
    if not np.any(ref[name]):
        return float(np.linalg.norm(ours[name]))
    return bounds.grad_err(name, ours, ref)


# AdamW + EMA from timm's initialisation at 32²: timm's own loop moves O(1) under a reordering
# (Adam turns rounding noise in tiny gradient elements into +-lr steps), so every bound is too
# loose to see a bug — inconclusive, as a tie would say; it needs a better-conditioned setting
INCONCLUSIVE = pytest.mark.xfail(strict=True, reason="inconclusive: bounds above 1e-3")


@pytest.fixture(scope="module", params=["lamb", pytest.param("adamw", marks=INCONCLUSIVE)])
def compared(request, tmp_path_factory):
    return request.param, _compared(RECIPES[request.param], tmp_path_factory.mktemp("loop"))


@pytest.fixture(scope="module", params=["lamb"])
def controlled(request, tmp_path_factory):
    """A run compared with every control's loop too (each holds a float64 ResNet-50, its
    optimizer state and gradients, ~0.8 GB more)."""
    return request.param, _compared(RECIPES[request.param], tmp_path_factory.mktemp("loop"),
                                    CONTROLS)


def test_the_loop_is_timms_every_tensor_every_step(compared):
    kind, found = compared
    rows, lrs = found["rows"]["none"], found["lr"]["none"]
    assert [a for a, _ in lrs] == pytest.approx([b for _, b in lrs], rel=1e-14)
    assert lrs[0][1] < lrs[1][1]  # the warmup's end is crossed
    bad = [f"{r['group']}/{r['name']} at step {r['step']}: {r['err']:.1e} > {r['bound']:.1e}"
           for r in rows if not r["ok"]]
    assert not bad, bad[:5]
    loose = [r for r in rows if r["bound"] > bounds.INCONCLUSIVE_BOUND]
    assert not loose, f"inconclusive: {len(loose)} bounds above {bounds.INCONCLUSIVE_BOUND}"
    assert {r["step"] for r in rows} == set(range(1, STEPS + 1))
    worst = {}
    for r in rows:
        worst[r["group"]] = max(worst.get(r["group"], 0.0), r["err"])
    print(kind, {g: f"{e:.1e}" for g, e in worst.items()})
    assert len(worst) == (6 if kind == "adamw" else 4)


@pytest.mark.parametrize("control", CONTROLS)
def test_the_loop_oracle_sees_each_control(controlled, control):
    """Each control — on timm's side, against the same twinstep run — fails the comparison: the
    lr differs, or some tensor exceeds its bound."""
    kind, found = controlled
    if control not in found["rows"]:
        pytest.skip("no EMA in this recipe")
    lr_off = any(a != pytest.approx(b, rel=1e-14) for a, b in found["lr"][control])
    failing = [r for r in found["rows"][control] if not r["ok"]]
    print(kind, control, "lr differs;" if lr_off else "", len(failing), "rows fail, worst "
          "err/bound", max((r["err"] / r["bound"] for r in failing), default=None))
    assert lr_off or failing
