"""The program factory: every step program twinstep compiles or exports is built here, and only
here are a step's mesh and ``shard_map`` specs chosen.

  grad_program   (params, buffers, x [R N, S, S, 3], t [R N, K]) -> step.StepOut
                 forward, loss, backward and the gradient collective (`step.grad_step`)
  train_program  TrainProgram: init(params, buffers) -> TrainState, and
                 step(state, xs [k, R N, S, S, 3], ts [k, R N, K], key) -> (state, metrics)
                 a recipe's whole step (`step.train_step`); `compile_step` compiles it
                 ahead for the trainer's arguments
  eval_program   (params, buffers, x [N, S, S, 3]) -> logits [N, K], eval-mode BN, one device
  prepare_program  the host's batch (`twinstep.data.loader.Batch`: uint8 crops, labels, the
                 drawn mix) -> the step's xs, ts: normalised, mixed over the global batch

A render read back is a step too, callable like train_program's: `twinstep.rendering.reader`.

At R = 1 a program is jit of the single-device function: `Replicas` emits no collective, so
there is nothing to map. At R > 1 it is jit(shard_map) over the 1-D replica mesh: ``mesh=None``
the first R devices (a runnable program), ``dp.abstract_mesh(R)`` no devices at all (the program
`twinstep.rendering.render` exports) — the same code either way.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from twinstep import dp, optim, step
from twinstep.collectives import SINGLE
from twinstep.data import device_ops, transforms
from twinstep.nets import Net, layers
from twinstep.ops.levers import Levers
from twinstep.ops.precision import Precision, get_precision
from twinstep.processes import cluster, settings


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """Where and how a step program runs, one value for every factory: on ``replicas``
    replicas (R), at ``precision`` (`twinstep.ops.precision`), with a negative ``control``
    (`twinstep.collectives.CONTROLS`), with ``levers`` (`twinstep.ops.levers.Levers`; those
    left None take the platform's when a program is built). Checks itself on construction."""

    replicas: int = 1
    precision: str | Precision = "f32"
    control: str = "none"
    levers: Levers = Levers()

    def __post_init__(self):
        self.levers.check(get_precision(self.precision))

    def single(self) -> Setup:
        """The single device this setup is tied to: R = 1, no control."""
        return dataclasses.replace(self, replicas=1, control="none")

    def context(self, train: bool = True) -> layers.Ctx:
        """What a step's ops run in: the single device at R = 1, else R replicas on
        `dp.AXIS`; every lever resolved on this process's platform."""
        single = self.replicas == 1 and self.control == "none"
        rep = SINGLE if single else dp.replicas(self.replicas, self.control)
        return layers.Ctx(replicas=rep, precision=get_precision(self.precision), train=train,
                          levers=self.levers.on())


ONE_DEVICE = Setup()  # the factories' default: one device, f32, the platform's levers


def _stacked(tree):
    return jax.tree.map(lambda a: a[None], tree)


def grad_program(net: Net, setup: Setup = ONE_DEVICE, *, loss: str = "ce",
                 collective: bool = True, per_replica: bool = False, fast_compile: bool = False):
    """The gradient step (params, buffers, x, t) -> step.StepOut on ``setup``'s R replicas (x,
    t sharded by rows, everything else replicated). ``per_replica``: what each replica holds
    for itself — BN statistics, running buffers, and without the ``collective`` its own
    gradients — comes back stacked along a leading replica axis [R, ...], to check that the
    replicas agree."""
    ctx = setup.context()

    def fn(p, b, x, t):
        out = step.grad_step(net, p, b, x, t, ctx=ctx, loss=loss, collective=collective)
        if not per_replica:
            return out
        grads = out.grads if collective else _stacked(out.grads)
        return out._replace(grads=grads, stats=_stacked(out.stats),
                            buffers=_stacked(out.buffers))

    r, s = dp.REPLICATED, dp.BATCH
    own = s if per_replica else r  # stacked per-replica outputs are sharded along [R, ...]
    out_specs = step.StepOut(r, r if collective else s, own, own, s)
    return dp.replica_map(fn, setup.replicas, (r, r, s, s), out_specs,
                          fast_compile=fast_compile)


def eval_program(net: Net, setup: Setup = ONE_DEVICE, *, fast_compile: bool = False):
    """Eval-mode logits (params, buffers, x [N, S, S, 3]) -> [N, K] on one device, at
    ``setup``'s precision and conv paths; a uint8 x is normalised first (`network_input`)."""
    ctx = setup.single().context(train=False)
    dtype = ctx.precision.dtype
    return dp.jit(lambda p, b, x: net.forward(p, b, network_input(x, dtype), ctx)[0],
                  fast_compile)


def network_input(x, dtype):
    """x [..., 3] as the network takes it, in ``dtype``: uint8 pixels normalised as
    torchvision's ToTensor + Normalize do, bit for bit — by a 256-entry table per channel built
    on the host, since XLA turns a division by a constant into a multiplication by its
    reciprocal —, anything else (the digits, normalised already) only cast."""
    if x.dtype == jnp.uint8:
        x = jnp.asarray(transforms.NORMALIZED)[x.astype(jnp.int32), jnp.arange(3)]
    return x.astype(dtype)


def prepare_program(classes: int, setup: Setup = ONE_DEVICE, *, fast_compile: bool = False,
                    layout=None):
    """The step's inputs from the host's batch, on ``setup``'s replicas: (xs [k, R N, S, S, 3]
    uint8 or float32, labels [k, R N], mix [k, 2], box [k, 4], plan [k, R N, P]) -> (xs, ts
    [k, R N, K]) in the precision's dtype, xs, labels and plans sharded by rows. With a ``layout``
    (`twinstep.data.device.Layout`) xs are canvases [k, R N, C, C, 3] that each row's plan
    resizes and augments first (`twinstep.data.device_ops.crops`). Each micro-batch is mixed
    over its global rows as `twinstep.data.mix.apply` mixes it: row i with row R N - 1 - i,
    the CutMix box pasted when it is not empty, else λ x + (1 - λ) x' — where XLA fuses the
    two products into one FMA, one rounding fewer than timm's float32 tensors
    (docs/training.md#augmentation) —; the targets λ onehot(y) + (1 - λ) onehot(y')
    likewise."""
    dtype = get_precision(setup.precision).dtype

    def prepare(xs, labels, mix, box, plan):
        if layout is not None:  # per micro-batch: merged with the sharded rows, XLA would
            # gather every replica's rows to each
            xs = jnp.stack([device_ops.crops(xs[m], plan[m], layout) for m in range(len(xs))])
        x = network_input(xs, jnp.float32)
        partner = x[:, ::-1]
        a, b = (mix[:, j, None, None, None, None] for j in (0, 1))
        y = jnp.arange(x.shape[2])[None, :, None]
        c = jnp.arange(x.shape[3])[None, None, :]
        inside = ((box[:, 0, None, None] <= y) & (y < box[:, 1, None, None])
                  & (box[:, 2, None, None] <= c) & (c < box[:, 3, None, None]))
        cut = jnp.any(inside, axis=(1, 2))[:, None, None, None, None]
        blended = jnp.where(b == 0, x, x * a + partner * b)
        x = jnp.where(cut, jnp.where(inside[:, None, :, :, None], partner, x), blended)
        onehot = jax.nn.one_hot(labels, classes, dtype=jnp.float32)
        ts = onehot * mix[:, None, 0:1] + onehot[:, ::-1] * mix[:, None, 1:2]
        return x.astype(dtype), ts.astype(dtype)

    if setup.replicas == 1:
        return dp.jit(prepare, fast_compile)
    r, s = dp.REPLICATED, dp.MICRO_BATCH
    return dp.laid_out_jit(prepare, dp.mesh(setup.replicas), (s, s, r, r, s), (s, s),
                           fast_compile=fast_compile)


class TrainProgram(NamedTuple):
    opt: optax.GradientTransformation  # the recipe's clip + optimizer + schedule
    init: object  # (params, buffers) -> TrainState
    step: object  # the jitted step (see `train_program`)
    state: step.TrainState  # the state's ShapeDtypeStructs
    in_specs: tuple  # a PartitionSpec per argument of ``step`` (flat: per leaf; else the
    # state's is a TrainState of them)
    place: object  # (state) -> the state on the step's replicas, laid out as ``step`` takes it


def abstract_params(net: Net, classes: int, dtype) -> tuple[dict, dict]:
    """(params, buffers) as ShapeDtypeStructs at ``classes`` classes."""
    shapes = net.param_shapes(classes)
    return ({k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()},
            {k: jax.ShapeDtypeStruct(s, dtype) for k, s in layers.buffer_shapes(shapes).items()})


def train_program(net: Net, recipe, setup: Setup = ONE_DEVICE, *, classes: int, mesh=None,
                  flat: bool = False, donate: bool = False, fast_compile: bool = False,
                  shard_optimizer: bool = True) -> TrainProgram:
    """The recipe's whole train step on ``setup``'s R replicas.

    step(state, xs, ts, key) -> (state, {"loss", "lr"}); xs, ts sharded along their R N rows,
    the key replicated. At R = 1 step also takes ``row_order`` [N] (the tie's reordered
    single-device batch, see `step.accumulate`). ``flat``: the signature jax.export needs with
    no pytree registrations — (*state leaves, xs, ts, key data uint32[2]) -> (*state leaves,
    loss, lr), every state leaf replicated (a render's collectives are all in its StableHLO).
    ``donate``: the step may reuse the state's buffers (the caller drops the old state).
    ``mesh``: see the module docstring.

    ``shard_optimizer`` (R > 1, not flat, not LAMB: `optim.PER_TENSOR_NORMS`, one process):
    the optimizer state is spread over the replicas (`dp.slice_spec`: each holds a 1/R slice of
    every moment tensor), the gradient collective hands each replica only its slices, each
    replica runs the optimizer on them and the new parameters are all-gathered — R times less
    optimizer work and state per replica than every replica repeating it (ZeRO stage 1); the
    parameters, buffers, EMA and step stay replicated. Off, every replica holds the whole
    state and runs the whole update. Across processes (gloo on CPU) the reduce-scatter and the
    all-gathers cost more than the all-reduce and the update they replace (bench/history/),
    so a mesh over several processes keeps the whole state."""
    prec, replicas = get_precision(setup.precision), setup.replicas
    params, buffers = abstract_params(net, classes, prec.dtype)
    opt = optim.for_recipe(recipe, params)

    @jax.jit  # one program: the optimizer's zeros eagerly would be a program per shape
    def init(p, b):
        return step.init_state(recipe, p, b, opt)

    state = jax.eval_shape(init, params, buffers)
    ctx = setup.context()
    if (replicas > 1 and shard_optimizer and not flat and cluster.count() == 1
            and recipe.optimizer not in optim.PER_TENSOR_NORMS):
        return _sliced_optimizer_program(net, recipe, opt=opt, init=init, state=state, ctx=ctx,
                                         mesh=mesh or dp.mesh(replicas), donate=donate,
                                         fast_compile=fast_compile)

    def train(st, xs, ts, key, row_order=None):
        return step.train_step(net, st, xs, ts, key, recipe=recipe, opt=opt, ctx=ctx,
                               row_order=row_order)

    r, s = dp.REPLICATED, dp.MICRO_BATCH
    if flat:
        treedef = jax.tree.structure(state)
        n = treedef.num_leaves

        def fn(*args):
            *leaves, xs, ts, key_data = args
            new, metrics = train(jax.tree.unflatten(treedef, leaves), xs, ts,
                                 jax.random.wrap_key_data(key_data))
            # the schedule runs in the canonical float (f64 under x64); report it in the loss's
            loss = metrics["loss"]
            return (*jax.tree.leaves(new), loss, metrics["lr"].astype(loss.dtype))

        in_specs, out_specs, donated = (r,) * n + (s, s, r), (r,) * (n + 2), tuple(range(n))
    else:
        fn, in_specs, out_specs, donated = train, (r, s, s, r), (r, r), (0,)
    if replicas == 1:  # one device: nothing is sharded
        in_specs = (r,) * len(in_specs)
    program = dp.replica_map(fn, replicas, in_specs, out_specs, fast_compile=fast_compile, on=mesh,
                             donate=donated if donate else ())
    return TrainProgram(opt, init, program, state, in_specs,
                        lambda st: dp.replicate(st, replicas))


def compile_step(prog: TrainProgram, setup: Setup, *, micro: tuple[int, int], res: int,
                 classes: int):
    """``prog.step`` compiled ahead of time for the trainer's arguments, before any of them
    exists: the state as ``prog.place`` lays it out, xs [k, R N, S, S, 3] and ts [k, R N, K]
    (``micro`` = (k, R N)) as `prepare_program` returns them, the key. The compile then peaks
    on its own, not on top of the state, the data and the loader (docs/speed.md#memory).
    Arguments laid out otherwise are refused (a jitted step would compile again)."""
    dtype, replicas = get_precision(setup.precision).dtype, setup.replicas
    state = dp.placed_shapes(prog.state, prog.in_specs[0], replicas)
    rows = dp.placed_shapes((jax.ShapeDtypeStruct((*micro, res, res, 3), dtype),
                             jax.ShapeDtypeStruct((*micro, classes), dtype)), dp.MICRO_BATCH,
                            replicas)
    key = dp.placed_shapes(jax.eval_shape(lambda: jax.random.key(0)), dp.REPLICATED, replicas)
    devices = list(dp.mesh(replicas).devices.flat) if replicas > 1 else jax.devices()[:1]
    return settings.compiled(prog.step.lower(state, *rows, key), devices)


def _sliced_optimizer_program(net, recipe, *, opt, init, state, ctx, mesh, donate: bool,
                              fast_compile: bool) -> TrainProgram:
    """train_program's step with the optimizer state spread over the replicas: the micro-steps
    and the gradient collective per replica (shard_map), then the update on the whole arrays,
    which XLA partitions as the state's layout says — each replica updates its slices, a
    clip's norm is summed over the replicas, the new parameters are all-gathered. The gradient
    collective reduce-scatters: each replica receives only its slices. Both per tensor, not in
    buckets: in one process packing a bucket cost more than it saved (bench/history/)."""
    count = ctx.replicas.count
    r, s = dp.REPLICATED, dp.MICRO_BATCH

    def spec(path, leaf):
        return dp.slice_spec(leaf.shape, count) if step.path_parts(path)[0] == "opt_state" else r

    state_specs = jax.tree_util.tree_map_with_path(spec, state)
    grad_specs = {k: dp.slice_spec(p.shape, count) for k, p in state.params.items()}
    slices = dp.shardings(grad_specs, mesh)
    everywhere = NamedSharding(mesh, r)
    # each replica receives only the slices of the mean gradient it updates (a reduce-scatter)
    dims = {k: dp.slice_dim(p.shape, count) for k, p in state.params.items()}
    accumulate = dp.per_replica(
        lambda p, b, xs, ts, key: step.accumulate(net, p, b, xs, ts, recipe=recipe, key=key,
                                                  ctx=ctx, slice_dims=dims, packed=False),
        mesh, (r, r, s, s, r), (grad_specs, r, r))

    def train(st, xs, ts, key):
        grads, buffers, loss = accumulate(st.params, st.buffers, xs, ts, key)
        return step.update(st, grads, buffers, loss, recipe=recipe, opt=opt,
                           sliced=lambda t: jax.lax.with_sharding_constraint(t, slices),
                           whole=lambda t: jax.lax.with_sharding_constraint(
                               t, {k: everywhere for k in t}))

    in_specs = (state_specs, s, s, r)
    program = dp.laid_out_jit(train, mesh, in_specs, (state_specs, r), fast_compile=fast_compile,
                              donate=(0,) if donate else ())
    return TrainProgram(opt, init, program, state, in_specs,
                        lambda st: dp.place(st, state_specs, count))
