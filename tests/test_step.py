"""The whole train step's accumulation (SPEC §6), single device, float64: k micro-steps give the
mean of k `grad_step` gradients, each micro-batch normalised over its own rows, and running
statistics moved k times at 1 - (1 - m)^(1/k)."""

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import recipe as recipes
from twinstep import step, tie
from twinstep.nets import get_net, layers
from twinstep.ops import batchnorm
from twinstep.ops.precision import F64


def test_accumulation_is_the_mean_of_the_micro_steps():
    net = get_net("resnet50")
    rec = recipes.parse("resnet50in_lambaccdp2x2wxclipbce")
    cfg = tie.TieConfig(replicas=1, batch=4)
    params, buffers, _, _ = tie.setup(cfg, net)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((2, 4, 32, 32, 3)))
    ts = jnp.asarray(np.eye(10)[rng.integers(0, 10, (2, 4))])
    ctx = layers.Ctx(precision=F64)
    grads, bufs, _ = jax.jit(lambda p, b, x, t: step.accumulate(
        net, rec, p, b, x, t, jax.random.key(0), ctx))(params, buffers, xs, ts)

    m = 1 - (1 - batchnorm.MOMENTUM) ** 0.5
    micro = jax.jit(lambda p, b, x, t: step.grad_step(
        net, p, b, x, t, ctx, "bce", alpha=0.0, momentum=m))
    from twinstep.ops import loss
    t0, t1 = (loss.bce_targets(t, 0.0, None) for t in ts)
    a = micro(params, buffers, xs[0], t0)
    b = micro(params, a.buffers, xs[1], t1)
    for name in params:
        # the tie's f64 bounds: two compiled programs (a scan, two calls) round differently
        assert tie.rel(grads[name], (a.grads[name] + b.grads[name]) / 2) <= tie.F64_PARAM_BOUND
    for name in buffers:
        assert tie.rel(bufs[name], b.buffers[name]) <= tie.F64_STAT_BOUND, name
    # a control: one micro-step at the full momentum moves the buffers elsewhere
    c = jax.jit(lambda p, b, x, t: step.grad_step(net, p, b, x, t, ctx, "bce", alpha=0.0))(
        params, buffers, xs[0], t0)
    assert max(tie.rel(c.buffers[k], a.buffers[k]) for k in buffers) > 1e-3
