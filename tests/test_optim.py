"""Optimizers, LR schedule and EMA against their oracles: timm's Lamb and RMSpropTF, torch's AdamW
and SGD, and timm's ModelEmaV3, run on identical parameters and gradients; the controls that must
break each comparison; the schedules against timm's schedulers."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from oracle_libs import timm, torch

from twinstep import dp, ema, optim
from twinstep.nets import NETS

BOUND = {np.float64: 1e-10, np.float32: 2e-6}
WD = 0.05
LR = {"lamb": 0.05, "adamw": 0.02, "momentum": 0.1, "sgd": 0.1, "rmsproptf": 0.048}
STEPS = 3  # compared after step 1 and after the last step: STEPS, or the kind's own
# RMSpropTF's square average forgets its start of 1 as 0.9^t: 12 steps leave 0.28 of it, and the
# momentum has gathered most of its weight
STEPS_OF = {"rmsproptf": 12}
RMS_EPS = 1e-3  # timm's EfficientNet recipe's --opt-eps .001
ZERO = ("layer1.0.conv2.weight", "layer1.0.bn2.weight")  # all-zero: trust ratio 1 (‖θ‖ = 0)
pytestmark = pytest.mark.oracle  # every comparison runs torch / timm


def _tiny():
    """A torch model with 4-D convs, a 2-D linear, BN γ/β and a bias, under timm's names
    (layer1.0.bn1.weight, …). Defined here, not at module level: the file imports without torch."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(8, 8, 1, bias=False), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

        def forward(self, x):
            y = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(x + self.bn2(self.conv2(y)))

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8)
            self.layer1 = nn.Sequential(Block())
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            x = self.layer1(torch.relu(self.bn1(self.conv1(x))))
            return self.fc(x.mean((2, 3)))

    return Tiny()


def _model(params: dict, dtype):
    model = _tiny().to(torch.float64 if dtype == np.float64 else torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[n].astype(dtype)))
    return model


def _problem(rng, kind: str = ""):
    """Parameters (two all-zero tensors) and the kind's steps' gradient dicts (`STEPS_OF`), in
    f64. Per-tensor, per-step scales make the global norm ≫ 1 (the clip triggers) and vary, so
    the clip matters for Adam."""
    shapes = {n: tuple(p.shape) for n, p in _tiny().named_parameters()}
    params = {n: (0.0 if n in ZERO else rng.uniform(0.2, 1.0)) * rng.normal(size=s)
              for n, s in shapes.items()}
    grads = [{n: 10 ** rng.uniform(-1, 1) * rng.normal(size=s) for n, s in shapes.items()}
             for _ in range(STEPS_OF.get(kind, STEPS))]
    return params, grads


def _global_norm(g: dict) -> float:
    return math.sqrt(sum(float(np.sum(v ** 2)) for v in g.values()))


def _torch(kind, wx, clip, params, grads, dtype):
    """The oracle: timm / torch optimizers, parameter groups as timm's create_optimizer builds them,
    the clip as timm's train.py --clip-grad 1.0 applies it (clip_grad_norm_, before the step);
    timm's Lamb clips inside as well (max_grad_norm=1.0, its default). RMSpropTF is timm's
    ``--opt rmsproptf --opt-eps .001`` itself (create_optimizer_v2), its defaults checked."""
    model = _model(params, dtype)
    named = dict(model.named_parameters())
    groups = timm.optim.param_groups_weight_decay(model, WD) if wx else model.parameters()
    if kind == "rmsproptf":
        opt = timm.optim.create_optimizer_v2(model, "rmsproptf", lr=LR[kind], weight_decay=WD,
                                             eps=RMS_EPS, filter_bias_and_bn=wx)
        assert type(opt) is timm.optim.RMSpropTF and all(
            (g["alpha"], g["momentum"], g["eps"], g["lr_in_momentum"], g["decoupled_decay"],
             g["centered"], g["caution"]) == (0.9, 0.9, RMS_EPS, True, False, False, False)
            for g in opt.param_groups)
    elif kind == "lamb":
        opt = timm.optim.Lamb(groups, lr=LR[kind], weight_decay=WD, max_grad_norm=1.0)
    elif kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=LR[kind], betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    else:
        opt = torch.optim.SGD(groups, lr=LR[kind], momentum=0.9, nesterov=kind == "sgd",
                              weight_decay=WD)
    out = []
    for g in grads:
        for n, p in named.items():
            p.grad = torch.from_numpy(g[n].astype(dtype))
        if clip:
            torch.nn.utils.clip_grad_norm_(named.values(), 1.0)
        opt.step()
        out.append({n: p.detach().numpy().copy() for n, p in named.items()})
    return out


def _ours(opt, params, grads, dtype):
    p = {n: jnp.asarray(v, dtype) for n, v in params.items()}
    state = opt.init(p)
    out = []
    for g in grads:
        p, state = optim.apply(opt, {n: jnp.asarray(v, dtype) for n, v in g.items()}, state, p)
        out.append({n: np.asarray(v) for n, v in p.items()})
    return out


def _err(ours: dict, theirs: dict) -> float:
    """The worst per-tensor norm-relative error."""
    return max(float(np.linalg.norm(ours[n] - theirs[n]) / np.linalg.norm(theirs[n]))
               for n in theirs)


def _errs(ours: list, theirs: list) -> tuple[float, float]:
    return _err(ours[0], theirs[0]), _err(ours[-1], theirs[-1])


CASES = [(k, wx, clip) for k in optim.KINDS for wx in (False, True) for clip in (False, True)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind,wx,clip", CASES)
def test_optimizer_matches_oracle(kind, wx, clip, dtype, rng):
    params, grads = _problem(rng, kind)
    if clip:
        assert min(_global_norm(g) for g in grads) > 10  # the clip triggers at every step
    opt = optim.make_optimizer(kind, LR[kind], weight_decay=WD, wx=wx, clip=clip, params=params)
    theirs = _torch(kind, wx, clip, params, grads, dtype)
    ours = _ours(opt, params, grads, dtype)
    e1, e3 = _errs(ours, theirs)
    # the steps are not negligible against the parameters (else the comparison would prove little)
    moved = min(np.linalg.norm(theirs[-1][n] - params[n]) / np.linalg.norm(theirs[-1][n])
                for n in params)
    print(f"{kind} wx={wx} clip={clip} {dtype.__name__}: step 1 {e1:.2e}, step {len(grads)} "
          f"{e3:.2e}, moved >= {moved:.1e}")
    assert max(e1, e3) <= BOUND[dtype] and moved > 1e-3


# ----------------------------------------------------------------- controls that must break parity


def _per_tensor_clip():
    return optax.stateless(lambda u, _: jax.tree.map(lambda g: g / jnp.maximum(
        jnp.linalg.norm(g), 1.0), u))


def _wrong(name, params):
    """(oracle case, a deliberately wrong optimizer)."""
    mask = optim.decay_mask(params, True)
    lr = optax.scale_by_learning_rate
    if name == "lamb trust ratio on 1-D under wx":
        return ("lamb", True, True), optax.chain(
            optax.clip_by_global_norm(1.0), optax.scale_by_adam(eps=1e-6),
            optax.add_decayed_weights(WD, mask), optax.scale_by_trust_ratio(), lr(LR["lamb"]))
    if name == "lamb clip per tensor":
        return ("lamb", False, True), optax.chain(
            _per_tensor_clip(), optim.make_optimizer("lamb", LR["lamb"], weight_decay=WD, wx=False,
                                                     clip=False, params=params))
    if name == "lamb without any clip":
        return ("lamb", True, True), optax.chain(
            optax.scale_by_adam(eps=1e-6), optax.add_decayed_weights(WD, mask),
            optax.masked(optax.scale_by_trust_ratio(), mask), lr(LR["lamb"]))
    if name == "adamw coupled decay":
        return ("adamw", True, False), optax.chain(
            optax.add_decayed_weights(WD, mask), optax.scale_by_adam(eps=1e-8), lr(LR["adamw"]))
    if name == "adamw decay on 1-D":
        return ("adamw", True, False), optim.make_optimizer(
            "adamw", LR["adamw"], weight_decay=WD, wx=False, clip=False, params=params)
    if name == "momentum as nesterov":
        return ("momentum", False, False), optim.make_optimizer(
            "sgd", LR["sgd"], weight_decay=WD, wx=False, clip=False, params=params)
    if name == "sgd as heavy-ball":
        return ("sgd", False, False), optim.make_optimizer(
            "momentum", LR["sgd"], weight_decay=WD, wx=False, clip=False, params=params)
    if name == "momentum decoupled decay":
        return ("momentum", True, False), optax.chain(
            optax.trace(0.9), optax.add_decayed_weights(WD, mask), lr(LR["momentum"]))
    if name.startswith("rmsproptf"):  # one change each to the TF form (optim's docstring)
        rms = {"decay": 0.9, "eps": RMS_EPS, "initial_scale": 1.0, "eps_in_sqrt": True}
        rms.update({"rmsproptf ε outside the square root": {"eps_in_sqrt": False},
                    "rmsproptf square average from 0": {"initial_scale": 0.0},
                    "rmsproptf α 0.99": {"decay": 0.99}}.get(name, {}))
        if name == "rmsproptf decay on 1-D":
            return ("rmsproptf", True, False), optim.make_optimizer(
                "rmsproptf", LR["rmsproptf"], weight_decay=WD, wx=False, clip=False,
                params=params)
        return ("rmsproptf", True, False), optax.chain(
            optax.add_decayed_weights(WD, mask), optax.scale_by_rms(**rms),
            lr(LR["rmsproptf"], flip_sign=False), optax.trace(0.9), optax.scale(-1.0))
    raise KeyError(name)


WRONG = ["lamb trust ratio on 1-D under wx", "lamb clip per tensor", "lamb without any clip",
         "adamw coupled decay", "adamw decay on 1-D", "momentum as nesterov", "sgd as heavy-ball",
         "momentum decoupled decay", "rmsproptf ε outside the square root",
         "rmsproptf square average from 0", "rmsproptf α 0.99", "rmsproptf decay on 1-D"]


@pytest.mark.parametrize("name", WRONG)
def test_controls_break_parity(name, rng):
    params, grads = _problem(rng, name.split()[0])  # each name starts with its kind
    (kind, wx, clip), opt = _wrong(name, params)
    e1, e3 = _errs(_ours(opt, params, grads, np.float64),
                   _torch(kind, wx, clip, params, grads, np.float64))
    print(f"{name}: step 1 {e1:.2e}, step {len(grads)} {e3:.2e}")
    assert e3 > 100 * BOUND[np.float32]


def test_rmsproptf_takes_the_lr_inside_its_momentum(rng):
    """Under a changing lr (a warmup, then timm's step decay) RMSpropTF's lr_in_momentum=True,
    b ← μ b + lr_t g/√(v + ε), θ ← θ − b, differs from PyTorch's θ ← θ − lr_t b: a constant lr,
    as `test_optimizer_matches_oracle` runs, cannot tell them apart. Ours is timm's at every
    step; timm's with lr_in_momentum=False is the control."""
    params, grads = _problem(rng, "rmsproptf")
    schedule = optim.step_lr_schedule(LR["rmsproptf"], 4, 2.4, 0.5, 1e-3)
    lrs = [float(schedule(s)) for s in range(len(grads))]

    def timm_run(lr_in_momentum: bool) -> list[dict]:
        model = _model(params, np.float64)
        named = dict(model.named_parameters())
        opt = timm.optim.RMSpropTF(timm.optim.param_groups_weight_decay(model, WD), lr=lrs[0],
                                   alpha=0.9, eps=RMS_EPS, momentum=0.9,
                                   lr_in_momentum=lr_in_momentum)
        out = []
        for lr, g in zip(lrs, grads, strict=True):
            for group in opt.param_groups:
                group["lr"] = lr
            for n, p in named.items():
                p.grad = torch.from_numpy(g[n].copy())
            opt.step()
            out.append({n: p.detach().numpy().copy() for n, p in named.items()})
        return out

    ours = _ours(optim.make_optimizer("rmsproptf", schedule, weight_decay=WD, wx=True, clip=False,
                                      params=params), params, grads, np.float64)
    assert len(set(lrs)) > 3  # it changes, in the warmup and in the staircase
    worst = max(_err(o, t) for o, t in zip(ours, timm_run(True), strict=True))
    control = max(_err(o, t) for o, t in zip(ours, timm_run(False), strict=True))
    print(f"lr in the momentum: worst {worst:.2e}; PyTorch's lr outside it {control:.2e}")
    assert worst <= BOUND[np.float64] and control > 100 * BOUND[np.float32]


def test_the_clips_are_timms(rng):
    """A recipe's clip is torch's clip_grad_norm_ (timm's train.py --clip-grad 1.0), element for
    element; LAMB's own clip divides by timm Lamb's max(‖g‖, 1), its norm over every tensor of
    every group. The two differ by 1e-6/‖g‖, which this comparison resolves (the control)."""
    params, grads = _problem(rng)
    g = grads[0]
    model = _model(params, np.float64)
    named = dict(model.named_parameters())
    for n, p in named.items():
        p.grad = torch.from_numpy(g[n].copy())
    lamb = timm.optim.Lamb(timm.optim.param_groups_weight_decay(model, WD), max_grad_norm=1.0)
    theirs = float(lamb._get_clip_grad_norm())  # max(‖g‖, 1), the divisor
    ours = float(optax.tree.norm({n: jnp.asarray(v) for n, v in g.items()}))
    assert ours > 10 and abs(ours - theirs) <= 1e-14 * theirs
    jg = {n: jnp.asarray(v) for n, v in g.items()}
    lambs, _ = optax.clip_by_global_norm(1.0).update(jg, optax.EmptyState())
    assert abs(float(optax.tree.norm(lambs)) - 1.0) <= 1e-14
    recipes, _ = optim.clip_grad_norm(1.0).update(jg, optax.EmptyState())
    torch.nn.utils.clip_grad_norm_(named.values(), 1.0)
    torch_clipped = {n: p.grad.numpy() for n, p in named.items()}
    assert _err({n: np.asarray(v) for n, v in recipes.items()}, torch_clipped) <= 1e-14
    assert _err({n: np.asarray(v) for n, v in lambs.items()}, torch_clipped) == pytest.approx(
        1e-6 / ours, rel=1e-3)


# ---------------------------------------------------------------------------- masks, jit, export


def test_decay_mask():
    for net, (tensors, one_d) in ((NETS["resnet50"], (161, 107)), (NETS["mnv4"], (233, 155))):
        shapes = {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in net.param_shapes().items()}
        mask = optim.decay_mask(shapes, True)
        assert (len(mask), sum(not m for m in mask.values())) == (tensors, one_d)
        assert all(optim.decay_mask(shapes, False).values())
    model = _tiny()
    no_decay = {id(p) for p in timm.optim.param_groups_weight_decay(model, WD)[0]["params"]}
    mask = optim.decay_mask(dict(model.named_parameters()), True)
    assert mask == {n: id(p) not in no_decay for n, p in model.named_parameters()}


def test_jit_shard_map_export(rng):
    """The optimizer inside jit, inside shard_map on replicated values, and through a serialized
    jax.export (with an LR schedule) gives the eager result. optax's state namedtuples are not
    registered for export serialization, so the exported function takes and returns flat leaves."""
    params, grads = _problem(rng)
    p = {n: jnp.asarray(v) for n, v in params.items()}
    g = {n: jnp.asarray(v) for n, v in grads[0].items()}
    opt = optim.make_optimizer("lamb", optim.lr_schedule(0.05, 2, 10, 1e-3), weight_decay=WD,
                               wx=True, clip=True, params=p)
    state = opt.init(p)
    step = lambda p, s, g: optim.apply(opt, g, s, p)  # noqa: E731
    want = step(p, state, g)
    leaves, tree_in = jax.tree.flatten((p, state, g))
    flat = jax.jit(lambda *xs: jax.tree.leaves(step(*jax.tree.unflatten(tree_in, xs))))
    exported = jax.export.deserialize(jax.export.export(flat)(*leaves).serialize())
    mapped = jax.jit(jax.shard_map(step, mesh=dp.mesh(8), in_specs=dp.REPLICATED,
                                   out_specs=dp.REPLICATED))
    for got in (jax.jit(step)(p, state, g), mapped(p, state, g),
                jax.tree.unflatten(jax.tree.structure(want), exported.call(*leaves))):
        assert _err(jax.tree.map(np.asarray, got[0]), jax.tree.map(np.asarray, want[0])) <= 1e-14
        assert int(got[1][2].count) == 1  # scale_by_adam's count, after the two clips


def test_unknown_kind():
    with pytest.raises(ValueError, match="'adam'"):
        optim.make_optimizer("adam", 1e-3, weight_decay=0.0, wx=False, clip=False, params={})


# ----------------------------------------------------------------------------------- the schedule


@pytest.mark.parametrize("warmup, total, init", [(5, 20, 1e-5), (2, 20, 0.0), (0, 7, 0.0),
                                                  (10, 11, 1e-5)])
def test_lr_schedule_is_timms_per_update(warmup, total, init):
    """lr(s) for every optimizer step s against timm's own scheduler as train.py builds it with
    --sched-on-updates (create_scheduler_v2, cosine, step_update after each update), past the
    end; and the controls it must tell apart: stepped per epoch (5 updates an epoch), and the
    warmup started from 0 instead of warmup_lr."""
    from timm.scheduler import create_scheduler_v2

    peak, end = 8e-3, 0.0
    ours = jax.jit(optim.lr_schedule(peak, warmup, total, init, end))

    def timm_lrs(per_epoch: bool = False, warmup_lr: float = init) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        upe = 5 if per_epoch else 1
        sched, _ = create_scheduler_v2(opt, "cosine", num_epochs=total // upe,
                                       warmup_epochs=warmup // upe, warmup_lr=warmup_lr,
                                       min_lr=end, step_on_epochs=per_epoch,
                                       updates_per_epoch=upe)
        out = []
        for s in range(total + 3):
            out.append(opt.param_groups[0]["lr"])
            if per_epoch and (s + 1) % upe == 0:
                sched.step((s + 1) // upe)
            elif not per_epoch:
                sched.step_update(num_updates=s + 1)
        return out

    want = timm_lrs()
    got = [float(ours(s)) for s in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-14, abs=1e-18)
    if total >= 10 and warmup % 5 == 0:
        assert got != pytest.approx(timm_lrs(per_epoch=True), rel=1e-6)
    if init > 0:
        assert got != pytest.approx(timm_lrs(warmup_lr=0.0), rel=1e-6)
    with pytest.raises(ValueError):
        optim.lr_schedule(peak, total, total)


@pytest.mark.parametrize("warmup, decay, rate, init", [(5, 2.4, 0.97, 1e-6), (0, 3, 0.5, 0.0),
                                                       (3, 1.1, 0.9, 1e-5), (10, 7, 0.97, 1e-6)])
def test_step_lr_schedule_is_timms_per_update(warmup, decay, rate, init):
    """lr(s) of the step decay for every optimizer step s against timm's own scheduler as
    train.py builds it with ``--sched step --decay-epochs D --decay-rate r --sched-on-updates``
    (create_scheduler_v2, step_update after each update); a fractional D as timm's 2.4, and
    D = 1.1, where ⌊s / D⌋ would part from timm's s // D at s = 11. The controls it must tell
    apart: the decay counted from the warmup's end (--warmup-prefix), stepped per epoch (5
    updates an epoch), and the warmup started from 0 instead of warmup_lr."""
    from timm.scheduler import create_scheduler_v2

    peak, total = 0.048, 30
    ours = jax.jit(optim.step_lr_schedule(peak, warmup, decay, rate, init))

    def timm_lrs(per_epoch: bool = False, warmup_lr: float = init,
                 prefix: bool = False) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        upe = 5 if per_epoch else 1
        sched, _ = create_scheduler_v2(opt, "step", num_epochs=total // upe,
                                       decay_epochs=decay / upe, decay_rate=rate,
                                       warmup_epochs=warmup // upe, warmup_lr=warmup_lr,
                                       warmup_prefix=prefix, step_on_epochs=per_epoch,
                                       updates_per_epoch=upe)
        out = []
        for s in range(total):
            out.append(opt.param_groups[0]["lr"])
            if per_epoch and (s + 1) % upe == 0:
                sched.step((s + 1) // upe)
            elif not per_epoch:
                sched.step_update(num_updates=s + 1)
        return out

    want = timm_lrs()
    got = [float(ours(s)) for s in range(total)]
    assert got == pytest.approx(want, rel=1e-14, abs=1e-18)
    assert len(set(want[warmup:])) > 3  # the staircase steps down within the run
    if warmup:
        assert got != pytest.approx(timm_lrs(prefix=True), rel=1e-6)
    if warmup % 5 == 0:
        assert got != pytest.approx(timm_lrs(per_epoch=True), rel=1e-6)
    if init > 0:
        assert got != pytest.approx(timm_lrs(warmup_lr=0.0), rel=1e-6)
    with pytest.raises(ValueError):
        optim.step_lr_schedule(peak, warmup, 0.0, rate)


def test_a_recipe_takes_its_schedule():
    """`recipe_schedule` is the recipe's kind of schedule, with its fields."""
    from twinstep.recipes import Recipe

    cosine = Recipe(net="resnet18", optimizer="rmsproptf", warmup_steps=3, total_steps=40,
                    warmup_lr=1e-6)
    step = dataclasses.replace(cosine, schedule="step", decay_steps=2.4, decay_rate=0.97)
    for recipe, want in ((cosine, optim.lr_schedule(0.048, 3, 40, 1e-6)),
                         (step, optim.step_lr_schedule(0.048, 3, 2.4, 0.97, 1e-6))):
        got = optim.recipe_schedule(recipe)
        assert [float(got(s)) for s in range(40)] == [float(want(s)) for s in range(40)]


def test_first_step_uses_lr_at_zero():
    """The first optimizer update uses lr(0) (heavy-ball's first step is −lr g)."""
    p, g = {"w": jnp.ones(3)}, {"w": jnp.arange(3.0)}
    opt = optim.make_optimizer("momentum", optim.lr_schedule(1.0, 4, 8, 0.25), weight_decay=0.0,
                               wx=False, clip=False, params=p)
    new, _ = optim.apply(opt, g, opt.init(p), p)
    np.testing.assert_array_equal(new["w"], 1.0 - 0.25 * g["w"])


# ------------------------------------------------------------------------------------------ EMA


def test_ema_decay_matches_timm():
    model = _tiny()
    for warmup in ("none", "timm"):
        timm_ema = timm.utils.ModelEmaV3(model, decay=0.9999, use_warmup=warmup == "timm")
        for step in [0, 1, 2, 3, 10, 1000, 31_623, 10 ** 6, 10 ** 7]:
            got = float(jax.jit(lambda s, w=warmup: ema.ema_decay(s, warmup=w))(step))
            assert got == pytest.approx(timm_ema.get_decay(step), rel=1e-15, abs=1e-15), step
    for step in [0, 1, 2, 3, 10, 100, 10 ** 5]:
        t = step - 1
        want = 0.0 if t <= 0 else min(0.9999, (1 + t) / (10 + t))
        assert float(ema.ema_decay(step, warmup="tf")) == pytest.approx(want, rel=1e-15, abs=1e-15)


def _state(model) -> tuple[dict, dict]:
    names = {n for n, _ in model.named_parameters()}
    sd = {n: v.detach().numpy().copy() for n, v in model.state_dict().items()}
    return ({n: v for n, v in sd.items() if n in names},
            {n: v for n, v in sd.items() if n not in names})


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("warmup,decay", [("none", 0.9999), ("timm", 0.9999), ("none", 0.9)])
def test_ema_matches_timm(warmup, decay, dtype, rng):
    """Five train-loop steps: weights move, BN running statistics (and the integer counter) update
    in a train-mode forward, num_updates += 1, then both EMAs update with step=num_updates."""
    params, _ = _problem(rng)
    model = _model(params, dtype)
    timm_ema = timm.utils.ModelEmaV3(model, decay=decay, use_warmup=warmup == "timm")
    ours = ema.ema_init(*_state(model))
    x = torch.from_numpy(rng.normal(size=(4, 3, 6, 6)).astype(dtype))
    for num_updates in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.from_numpy(0.1 * rng.normal(size=p.shape).astype(dtype)))
            model.train()(x)
        timm_ema.update(model, step=num_updates)
        ours = ema.ema_update(ours, _state(model), num_updates, decay=decay, warmup=warmup)
        theirs = timm_ema.module.state_dict()
        for tree in ours:
            for n, v in tree.items():
                want = theirs[n].numpy()
                assert v.dtype == want.dtype
                if n.endswith("num_batches_tracked"):
                    assert int(v) == int(want) == num_updates
                else:
                    assert _err({n: np.asarray(v)}, {n: want}) <= BOUND[dtype], (num_updates, n)


def test_ema_off_by_one_breaks_parity(rng):
    """Counting the step one too high (decay 0.9999 instead of the copy on the first update)."""
    params, _ = _problem(rng)
    model = _model(params, np.float64)
    timm_ema = timm.utils.ModelEmaV3(model)
    ours = ema.ema_init(*_state(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    timm_ema.update(model, step=1)
    ours = ema.ema_update(ours, _state(model), 2)
    assert _err({n: np.asarray(v) for n, v in ours[0].items()},
                {n: v.numpy() for n, v in timm_ema.module.state_dict().items() if n in ours[0]}) \
        > 1e-3
