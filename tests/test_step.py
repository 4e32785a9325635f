"""The whole train step's accumulation (docs/recipes.md), single device, float64: k micro-steps
give the mean of k `grad_step` gradients, each micro-batch normalised over its own rows, and running
statistics moved k times at 1 - (1 - m)^(1/k)."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from twinstep import dp, optim, recipes, step
from twinstep.checking import bounds, inputs, tie
from twinstep.nets import get_net, layers
from twinstep.ops import batchnorm
from twinstep.ops.precision import F64

pytestmark = pytest.mark.slow  # whole ResNet-50 steps


def jit(fn, **kw):
    """XLA at -O0 (`dp.FAST_COMPILE`, the same numerics): each program here runs once or twice,
    so compiling it is most of its cost."""
    return jax.jit(fn, compiler_options=dp.compiler_options(fast_compile=True), **kw)


def test_accumulation_is_the_mean_of_the_micro_steps():
    net = get_net("resnet50")
    rec = recipes.parse("resnet50in_lambaccdp2x2wxclipbce")
    cfg = tie.TieConfig(replicas=1, batch=4)
    params, buffers, _, _ = inputs.setup(cfg, net)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((2, 4, 32, 32, 3)))
    ts = jnp.asarray(np.eye(10)[rng.integers(0, 10, (2, 4))])
    ctx = layers.Ctx(precision=F64)
    grads, bufs, _ = jit(lambda p, b, x, t: step.accumulate(
        net, p, b, x, t, recipe=rec, key=jax.random.key(0), ctx=ctx))(params, buffers, xs, ts)

    m = batchnorm.MOMENTUM  # every micro-step, as timm's train.py
    # the momentum an argument: one program for the micro-steps and the control below
    micro = jit(lambda p, b, x, t, momentum: step.grad_step(
        net, p, b, x, t, ctx=ctx, loss="bce", alpha=0.0, momentum=momentum))
    from twinstep.ops import loss
    t0, t1 = (loss.bce_targets(t, 0.0, None) for t in ts)
    a = micro(params, buffers, xs[0], t0, m)
    b = micro(params, a.buffers, xs[1], t1, m)
    for name in params:
        # the tie's f64 bounds: two compiled programs (a scan, two calls) round differently
        mean = (a.grads[name] + b.grads[name]) / 2
        assert bounds.rel(grads[name], mean) <= bounds.F64_PARAM_BOUND
    for name in buffers:
        assert bounds.rel(bufs[name], b.buffers[name]) <= bounds.F64_STAT_BOUND, name
    # a control: the momentum spread over the k micro-steps, 1 - (1 - m)^(1/k), moves the
    # buffers elsewhere
    c = micro(params, buffers, xs[0], t0, 1 - (1 - m) ** 0.5)
    assert max(bounds.rel(c.buffers[k], a.buffers[k]) for k in buffers) > 1e-3


def test_the_optimizer_sees_the_clipped_mean_and_eval_reads_raw_or_ema():
    """train_step = accumulate, then clip + AdamW on the MEAN gradient (global norm > 1 here, so
    the clip acts), then the EMA; eval_logits reads the raw or the EMA weights."""
    net = get_net("resnet50")
    rec = recipes.parse("resnet50in_emaaccdp2x2wxclip")
    params, buffers, _, _ = inputs.setup(tie.TieConfig(replicas=1, batch=4), net)
    rng = np.random.default_rng(1)
    xs = jnp.asarray(rng.standard_normal((2, 4, 32, 32, 3)))
    ts = jnp.asarray(np.eye(10)[rng.integers(0, 10, (2, 4))])
    ctx, key = layers.Ctx(precision=F64), jax.random.key(3)
    opt = optim.for_recipe(rec, params)
    state = step.init_state(rec, params, buffers, opt)
    # two steps, so the second has a nonzero learning rate (warmup starts at 0)
    train = jit(lambda st, x, t: step.train_step(net, st, x, t, key, recipe=rec, opt=opt,
                                                 ctx=ctx))
    state = train(state, xs, ts)[0]
    new = train(state, xs, ts)[0]

    # the mean gradient from the k = 1 program: accumulation is the mean of its micro-steps
    # (the test above), and this recipe draws no masks
    micro = jit(lambda p, b, x, t: step.accumulate(net, p, b, x, t, recipe=rec, key=key,
                                                   ctx=ctx)[0])
    each = [micro(state.params, state.buffers, xs[i:i + 1], ts[i:i + 1]) for i in range(2)]
    mean = jit(lambda a, b: jax.tree.map(lambda u, v: (u + v) / 2, a, b))
    grads = mean(*each)
    assert jit(optax.tree.norm)(grads) > 1.0
    step_with = jit(lambda g, st: optax.apply_updates(
        st.params, opt.update(g, st.opt_state, st.params)[0]))  # one program, eager is ~600
    expected = step_with(grads, state)
    for name in params:
        assert bounds.rel(new.params[name], expected[name]) <= bounds.F64_PARAM_BOUND, name
    # a control: clipping each micro-step's gradient before the mean lands elsewhere
    clip = jit(lambda g: optax.tree.scale(jnp.minimum(1.0, 1.0 / optax.tree.norm(g)), g))
    moved = step_with(mean(*map(clip, each)), state)
    assert max(bounds.rel(moved[n], expected[n]) for n in params) > 1e-6

    evaluate = jit(lambda st, use_ema: step.eval_logits(net, st, xs[0], ctx, use_ema),
                       static_argnums=1)
    with_ema = evaluate(new, True)
    # the EMA weights put in the raw weights' place, read by the same raw-weights program
    ema_as_raw = new._replace(params=new.ema[0], buffers=new.ema[1])
    assert bounds.rel(with_ema, evaluate(ema_as_raw, False)) <= 1e-12
    assert bounds.rel(evaluate(new, False), with_ema) > 1e-6
