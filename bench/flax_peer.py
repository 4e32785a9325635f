"""The natural JAX peer of twinstep: ResNet-50 and MobileNetV4-Conv-M in Flax NNX, trained with
autodiff and ``jax.shard_map`` data parallelism, BN synchronised through ``nnx.BatchNorm``'s
``axis_name``. Written independently of twinstep's ops; only the self-check imports twinstep.

The modules mirror timm's attribute names (``layer1[0].conv1``, ``blocks[1][0].dw_start.conv``),
so an NNX state path joined with dots IS the timm state_dict name once the leaf is renamed
(kernel / scale -> weight, mean / var -> running_mean / running_var). Activations are NHWC;
kernels HWIO (timm OIHW), linear [D, K] (timm [K, D]).

    from_twinstep(net, params, buffers, K, axis_name)   twinstep's (timm-named) tensors -> module
    train_step_fn(net, model, optimizer, R, axis)     -> (step, state); step(state, x, y) ->
                                                         (state, loss), jitted once, state donated
    grad_fn(net, model, R, axis)                      -> (fn, state); fn(state, x, y) ->
                                                         (loss, grads, batch_stats)
    grads_to_timm(net, grads)                         NNX gradient State -> {timm name: array}

Self-check (f64, 4 CPU devices): the peer's R-replica gradients against twinstep's
single-device gradients at the global batch R N:

    python bench/flax_peer.py --net resnet50 --replicas 2 --batch 2 --res 32
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

NETS = ("resnet50", "mnv4")

# timm resnet50: (bottlenecks, output width, stride of the stage's first 3x3) per stage.
RESNET_STAGES = ((3, 256, 1), (4, 512, 2), (6, 1024, 2), (3, 2048, 2))

# timm's arch_def of mobilenetv4_conv_medium, verbatim (mobilenetv3.py, _gen_mobilenet_v4):
# er = EdgeResidual (fused IB), uir = universal inverted residual (a / k: start / middle
# depthwise kernels, 0 = absent), cn = conv-BN-ReLU; r repeats, s stride, e expansion, c width.
MNV4_ARCH = (
    ("er_r1_k3_s2_e4_c48",),
    ("uir_r1_a3_k5_s2_e4_c80", "uir_r1_a3_k3_s1_e2_c80"),
    ("uir_r1_a3_k5_s2_e6_c160", "uir_r2_a3_k3_s1_e4_c160", "uir_r1_a3_k5_s1_e4_c160",
     "uir_r1_a3_k3_s1_e4_c160", "uir_r1_a3_k0_s1_e4_c160", "uir_r1_a0_k0_s1_e2_c160",
     "uir_r1_a3_k0_s1_e4_c160"),
    ("uir_r1_a5_k5_s2_e6_c256", "uir_r1_a5_k5_s1_e4_c256", "uir_r2_a3_k5_s1_e4_c256",
     "uir_r1_a0_k0_s1_e4_c256", "uir_r1_a3_k0_s1_e4_c256", "uir_r1_a3_k5_s1_e2_c256",
     "uir_r1_a5_k5_s1_e4_c256", "uir_r2_a0_k0_s1_e4_c256", "uir_r1_a5_k0_s1_e2_c256"),
    ("cn_r1_k1_s1_c960",),
)
MNV4_STEM, MNV4_FEATURES = 32, 1280

# ------------------------------------------------------------------------------- the layers


class _Maker(NamedTuple):
    """What every layer is built with: the BN sync axis (None: no sync), dtype, rngs."""

    axis_name: str | None
    dtype: object
    rngs: nnx.Rngs

    def conv(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1) -> nnx.Conv:
        """k x k conv, no bias, timm's symmetric padding (k - 1) // 2 (never XLA "SAME")."""
        p = (k - 1) // 2
        return nnx.Conv(cin, cout, (k, k), strides=stride, padding=((p, p), (p, p)),
                        feature_group_count=groups, use_bias=False, dtype=self.dtype,
                        param_dtype=self.dtype, rngs=self.rngs)

    def bn(self, c: int) -> nnx.BatchNorm:
        """torch's BatchNorm2d: eps 1e-5, running <- 0.9 running + 0.1 batch. Normalises with
        the biased two-pass variance E[(x - E[x])^2], as torch does (use_fast_variance=True
        would be E[x^2] - E[x]^2). With axis_name both means are pmean'd: the global batch's.
        NB flax's running var takes the BIASED batch variance; torch's takes the unbiased."""
        return nnx.BatchNorm(c, axis_name=self.axis_name, momentum=0.9, epsilon=1e-5,
                             use_fast_variance=False, dtype=self.dtype, param_dtype=self.dtype,
                             rngs=self.rngs)

    def linear(self, d: int, k: int) -> nnx.Linear:
        return nnx.Linear(d, k, dtype=self.dtype, param_dtype=self.dtype, rngs=self.rngs)


def _cba(conv, bn, x, act: bool = True):
    """conv -> BN [-> ReLU]: x [N, H, W, Ci] -> [N, Ho, Wo, Co]."""
    y = bn(conv(x))
    return jax.nn.relu(y) if act else y


# -------------------------------------------------------------------------------- ResNet-50


class Bottleneck(nnx.Module):
    """timm's v1.5 bottleneck (stride on the 3x3): [N, H, W, cin] -> [N, H/s, W/s, cout]."""

    def __init__(self, mk: _Maker, cin: int, cout: int, stride: int):
        mid = cout // 4
        self.conv1, self.bn1 = mk.conv(cin, mid, 1), mk.bn(mid)
        self.conv2, self.bn2 = mk.conv(mid, mid, 3, stride), mk.bn(mid)
        self.conv3, self.bn3 = mk.conv(mid, cout, 1), mk.bn(cout)
        self.downsample = (nnx.List([mk.conv(cin, cout, 1, stride), mk.bn(cout)])
                           if stride != 1 or cin != cout else None)

    def __call__(self, x):
        y = _cba(self.conv1, self.bn1, x)
        y = _cba(self.conv2, self.bn2, y)
        y = _cba(self.conv3, self.bn3, y, act=False)
        short = x if self.downsample is None else _cba(*self.downsample, x, act=False)
        return jax.nn.relu(y + short)


class ResNet50(nnx.Module):
    """timm resnet50: x [N, H, W, 3] (H, W multiples of 32) -> logits [N, K]."""

    def __init__(self, mk: _Maker, classes: int):
        self.conv1, self.bn1 = mk.conv(3, 64, 7, 2), mk.bn(64)
        cin = 64
        for i, (depth, width, stride) in enumerate(RESNET_STAGES):
            blocks = [Bottleneck(mk, cin if j == 0 else width, width, stride if j == 0 else 1)
                      for j in range(depth)]
            setattr(self, f"layer{i + 1}", nnx.List(blocks))
            cin = width
        self.fc = mk.linear(cin, classes)

    def __call__(self, x):
        y = _cba(self.conv1, self.bn1, x)
        y = nnx.max_pool(y, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))  # -inf padding
        for i in range(len(RESNET_STAGES)):
            for block in getattr(self, f"layer{i + 1}"):
                y = block(y)
        return self.fc(jnp.mean(y, axis=(1, 2)))


# ------------------------------------------------------------------------ MobileNetV4-Conv-M


def make_divisible(v: float, divisor: int = 8) -> int:
    """timm's channel rounding (the identity for every width of conv-medium)."""
    out = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * v else out


def parse_block(spec: str) -> tuple[str, dict]:
    """'uir_r2_a3_k5_s1_e4_c160' -> ('uir', {'r': 2, 'a': 3, 'k': 5, 's': 1, 'e': 4, 'c': 160})."""
    kind, *opts = spec.split("_")
    return kind, {o[0]: int(o[1:]) for o in opts}


class ConvNormAct(nnx.Module):
    """timm ConvNormAct (attributes conv, bn): [N, H, W, cin] -> [N, H/s, W/s, cout]."""

    def __init__(self, mk: _Maker, cin, cout, k, stride=1, depthwise=False, act=True):
        self.conv = mk.conv(cin, cout, k, stride, cin if depthwise else 1)
        self.bn, self.act = mk.bn(cout), act

    def __call__(self, x):
        return _cba(self.conv, self.bn, x, self.act)


class UIB(nnx.Module):
    """Universal inverted residual: [dw_start] -> pw_exp -> [dw_mid] -> pw_proj (+ x)."""

    def __init__(self, mk: _Maker, cin: int, o: dict, stride: int):
        mid, a, k, c = make_divisible(cin * o["e"]), o["a"], o["k"], o["c"]
        self.dw_start = (ConvNormAct(mk, cin, cin, a, 1 if k else stride, True, act=False)
                         if a else None)
        self.pw_exp = ConvNormAct(mk, cin, mid, 1)
        self.dw_mid = ConvNormAct(mk, mid, mid, k, stride, True) if k else None
        self.pw_proj = ConvNormAct(mk, mid, c, 1, act=False)
        self.skip = stride == 1 and cin == c

    def __call__(self, x):
        y = x
        for layer in (self.dw_start, self.pw_exp, self.dw_mid, self.pw_proj):
            y = y if layer is None else layer(y)
        return y + x if self.skip else y


class EdgeResidual(nnx.Module):
    """Fused IB: conv_exp k x k /s -> bn1 -> ReLU -> conv_pwl 1x1 -> bn2 (+ x)."""

    def __init__(self, mk: _Maker, cin: int, o: dict, stride: int):
        mid, c = make_divisible(cin * o["e"]), o["c"]
        self.conv_exp, self.bn1 = mk.conv(cin, mid, o["k"], stride), mk.bn(mid)
        self.conv_pwl, self.bn2 = mk.conv(mid, c, 1), mk.bn(c)
        self.skip = stride == 1 and cin == c

    def __call__(self, x):
        y = _cba(self.conv_pwl, self.bn2, _cba(self.conv_exp, self.bn1, x), act=False)
        return y + x if self.skip else y


class ConvBnAct(nnx.Module):
    """timm ConvBnAct block: conv k x k /s -> bn1 -> ReLU (+ x)."""

    def __init__(self, mk: _Maker, cin: int, o: dict, stride: int):
        self.conv, self.bn1 = mk.conv(cin, o["c"], o["k"], stride), mk.bn(o["c"])
        self.skip = stride == 1 and cin == o["c"]

    def __call__(self, x):
        y = _cba(self.conv, self.bn1, x)
        return y + x if self.skip else y


BLOCK_KINDS = {"er": EdgeResidual, "uir": UIB, "cn": ConvBnAct}


class MobileNetV4(nnx.Module):
    """timm mobilenetv4_conv_medium: x [N, H, W, 3] (H, W multiples of 32) -> logits [N, K]."""

    def __init__(self, mk: _Maker, classes: int):
        self.conv_stem, self.bn1 = mk.conv(3, MNV4_STEM, 3, 2), mk.bn(MNV4_STEM)
        stages, cin = [], MNV4_STEM
        for stage in MNV4_ARCH:
            blocks = []
            for spec in stage:
                kind, o = parse_block(spec)
                for _ in range(o["r"]):
                    stride = o["s"] if not blocks else 1  # only a stage's first block strides
                    blocks.append(BLOCK_KINDS[kind](mk, cin, o, stride))
                    cin = o["c"]
            stages.append(nnx.List(blocks))
        self.blocks = nnx.List(stages)
        self.conv_head, self.norm_head = mk.conv(cin, MNV4_FEATURES, 1), mk.bn(MNV4_FEATURES)
        self.classifier = mk.linear(MNV4_FEATURES, classes)

    def __call__(self, x):
        y = _cba(self.conv_stem, self.bn1, x)
        for stage in self.blocks:
            for block in stage:
                y = block(y)
        y = jnp.mean(y, axis=(1, 2), keepdims=True)  # [N, 1, 1, 960]: norm_head sees N rows
        y = _cba(self.conv_head, self.norm_head, y)
        return self.classifier(y[:, 0, 0, :])


# ------------------------------------------------------------------ twinstep / timm tensors


def _check_net(net_name: str) -> None:
    if net_name not in NETS:
        raise ValueError(f"unknown net {net_name!r}; choose from {NETS}")


def build(net_name: str, classes: int, axis_name: str | None, dtype=jnp.float32,
          seed: int = 0) -> nnx.Module:
    """A freshly initialised module (Flax's default init; `from_twinstep` loads weights)."""
    _check_net(net_name)
    cls = ResNet50 if net_name == "resnet50" else MobileNetV4
    return cls(_Maker(axis_name, dtype, nnx.Rngs(seed)), classes)


LEAF_NAMES = {"kernel": "weight", "scale": "weight", "bias": "bias", "mean": "running_mean",
              "var": "running_var"}


def timm_name(path) -> str:
    """A pytree path into an NNX State -> timm name ('layer1.0.conv1.kernel' -> ...weight)."""
    parts = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    return ".".join(parts[:-1] + [LEAF_NAMES[parts[-1]]])


def to_flax(a):
    """timm layout -> Flax: conv OIHW (depthwise [C, 1, k, k]) -> HWIO, linear [K, D] -> [D, K]."""
    return {4: lambda t: t.transpose(2, 3, 1, 0), 2: lambda t: t.T}.get(a.ndim, lambda t: t)(a)


def to_timm(a):
    """Flax layout -> timm: the inverse of `to_flax`."""
    return {4: lambda t: t.transpose(3, 2, 0, 1), 2: lambda t: t.T}.get(a.ndim, lambda t: t)(a)


def from_twinstep(net_name: str, params: dict, buffers: dict, classes: int,
                  axis_name: str | None, dtype=jnp.float32) -> nnx.Module:
    """The peer module holding twinstep's tensors: params {timm name: array} (convs OIHW,
    classifier [K, D]), buffers {'<bn>.running_mean' / '.running_var': [C]}. ``axis_name``:
    the replica axis BN syncs over (None for one device)."""
    graphdef, state = nnx.split(nnx.eval_shape(
        lambda: build(net_name, classes, axis_name, dtype)))
    tensors, used = {**params, **buffers}, set()

    def load(path, leaf):
        name = timm_name(path)
        a = jnp.asarray(to_flax(jnp.asarray(tensors[name])), dtype)
        if a.shape != leaf.shape:
            raise ValueError(f"{name}: twinstep {a.shape} vs peer {leaf.shape} (Flax layout)")
        used.add(name)
        return a

    state = jax.tree_util.tree_map_with_path(load, state)
    if used != set(tensors):
        raise ValueError(f"tensors the peer does not have: {sorted(set(tensors) - used)[:5]}")
    return nnx.merge(graphdef, state)


def grads_to_timm(net_name: str, grads_state) -> dict:
    """An NNX gradient State (of nnx.Param) -> {timm name: gradient in timm's layout}."""
    _check_net(net_name)
    flat = jax.tree_util.tree_flatten_with_path(grads_state)[0]
    return {timm_name(path): to_timm(g) for path, g in flat}


# ------------------------------------------------------------------------------ the step


class PeerState(NamedTuple):
    """What the step carries, replicated: params and batch stats (NNX States), opt state."""

    params: object
    batch_stats: object
    opt_state: object


def _loss_and_grads(graphdef, smoothing: float, axis: str | None):
    """(params, stats, x [N, H, W, 3], y [N, K]) -> (loss, grads, new stats), replica-averaged.

    The loss is the mean over THIS replica's rows; BN (axis_name) normalises with the global
    batch's statistics, so pmean over replicas of the per-replica gradients is the gradient of
    the global batch's mean loss (the transpose of BN's pmean carries the cross-replica terms).
    """
    def loss_fn(params, stats, x, y):
        model = nnx.merge(graphdef, params, stats, copy=True)  # Variables of this trace
        logits = model(x)
        q = optax.smooth_labels(y.astype(logits.dtype), smoothing)
        return optax.softmax_cross_entropy(logits, q).mean(), nnx.state(model, nnx.BatchStat)

    def fn(params, stats, x, y):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats, x, y)
        if axis is not None:
            loss, grads = jax.lax.pmean((loss, grads), axis)
        return loss, grads, stats

    return fn


def _replica_map(fn, replicas: int, axis: str, donate: tuple = ()):
    """jit(fn) at R = 1; else jit(shard_map(fn)) over the first R devices: the first argument
    (the state) replicated, the others sharded by rows; every output replicated.

    check_vma=False: with it on, jax.grad would already psum the gradient of a replicated
    parameter (the transpose of its implicit pvary), and the pmean here would count R times."""
    if replicas == 1:
        return jax.jit(fn, donate_argnums=donate), None
    mesh = Mesh(np.array(jax.devices()[:replicas]), (axis,))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(axis), P(axis)), out_specs=P(),
                           check_vma=False)
    return jax.jit(mapped, donate_argnums=donate), NamedSharding(mesh, P())


def _placed(state, sharding):
    """A private copy of the state, replicated: donation must not free the model's (or the
    caller's) arrays, and ``device_put`` to a replicated sharding reuses device 0's buffer
    even with may_alias=False."""
    state = jax.tree.map(lambda a: jnp.array(a, copy=True), state)
    return state if sharding is None else jax.device_put(state, sharding)


def _split(net_name: str, model: nnx.Module, replicas: int, axis: str):
    """(graphdef, params, batch stats), after checking that every BN syncs over ``axis`` at
    R > 1 and over nothing at R = 1 (a mismatch would silently train per-replica BN)."""
    _check_net(net_name)
    want = axis if replicas > 1 else None
    have = {m.axis_name for _, m in nnx.iter_graph(model) if isinstance(m, nnx.BatchNorm)}
    if have != {want}:
        raise ValueError(f"the model's BNs sync over {have}; R = {replicas} needs {want!r}")
    return nnx.split(model, nnx.Param, nnx.BatchStat)


def grad_fn(net_name: str, model: nnx.Module, replicas: int, axis: str,
            label_smoothing: float = 0.1):
    """(fn, state): fn(state, x [R N, H, W, 3], y [R N, K]) -> (loss, grads (an nnx.Param
    State, pmean'd), new batch stats); state = (params, batch stats). The model's BNs must sync
    over ``axis`` (R > 1) or not at all (R = 1)."""
    graphdef, params, stats = _split(net_name, model, replicas, axis)
    inner = _loss_and_grads(graphdef, label_smoothing, axis if replicas > 1 else None)
    fn, sharding = _replica_map(lambda st, x, y: inner(*st, x, y), replicas, axis)
    return fn, _placed((params, stats), sharding)


def train_step_fn(net_name: str, model: nnx.Module, optimizer: optax.GradientTransformation,
                  replicas: int, axis: str, label_smoothing: float = 0.1):
    """(step, state): step(state, x [R N, H, W, 3], y_onehot [R N, K]) -> (state, loss), one
    jitted program (state donated); state a `PeerState`. Train-mode BN (running statistics
    updated), label-smoothed CE, pmean'd gradients and loss, then the optimizer."""
    graphdef, params, stats = _split(net_name, model, replicas, axis)
    inner = _loss_and_grads(graphdef, label_smoothing, axis if replicas > 1 else None)

    def step(state: PeerState, x, y):
        loss, grads, new_stats = inner(state.params, state.batch_stats, x, y)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return PeerState(optax.apply_updates(state.params, updates), new_stats, opt_state), loss

    fn, sharding = _replica_map(step, replicas, axis, donate=(0,))
    return fn, _placed(PeerState(params, stats, optimizer.init(params)), sharding)


# ----------------------------------------------------------------------------- self-check

AXIS = "replicas"
# A tensor whose norm is below this fraction of the whole gradient's is a structural zero (in
# f64 ~1e-17 of it; the smallest real tensors here are ~1e-7 of it).
ZERO_FLOOR = 1e-12


def _twinstep_case(net_name: str, classes: int, rows: int, res: int):
    """twinstep's near-init f64 (params, buffers, x [rows, res, res, 3], t [rows, K], grads)."""
    from twinstep import program
    from twinstep.nets import get_net, init

    net = get_net(net_name)
    shapes = net.param_shapes(classes)
    params = init.init_params(jax.random.key(0), shapes, net.zero_init_bns(), jnp.float64,
                                linear=net.LINEAR_INIT)
    params = init.near_init_bn(jax.random.key(1), params, net.branch_end_bns())
    buffers = init.init_buffers(shapes, jnp.float64)
    kx, ky = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (rows, res, res, 3), jnp.float64)
    t = jax.nn.one_hot(jax.random.randint(ky, (rows,), 0, classes), classes, dtype=jnp.float64)
    grad = program.grad_program(net, program.Setup(precision="f64"), loss="ce")
    out = grad(params, buffers, x, t)
    return params, buffers, x, t, out.grads


def worst_error(peer: dict, ref: dict) -> tuple[float, str, int]:
    """(worst ||a - b|| / ||b|| over tensors, its name, structural zeros): a tensor whose
    reference norm is below ZERO_FLOOR of the whole gradient's is exactly zero in exact
    arithmetic (twinstep/nets/mobilenetv4.py: the dw_start.bn biases, the pw_proj.bn biases of
    stage 3 at a 1x1 grid), and both sides are rounding noise: it is measured against the whole
    gradient's norm instead."""
    if set(peer) != set(ref):
        raise SystemExit(f"tensor names differ: {sorted(set(peer) ^ set(ref))[:5]}")
    total = float(np.sqrt(sum(np.sum(np.square(np.asarray(g))) for g in ref.values())))
    worst, where, zeros = 0.0, "", 0
    for name, b in ref.items():
        a, b = np.asarray(peer[name]), np.asarray(b)
        norm = float(np.linalg.norm(b))
        zero = norm < ZERO_FLOOR * total
        zeros += zero
        err = float(np.linalg.norm(a - b)) / (total if zero else norm)
        if err > worst:
            worst, where = err, name
    return worst, where, zeros


def self_check(net_name: str, replicas: int, batch: int, res: int, classes: int) -> float:
    """The worst per-tensor gradient error of the peer at R replicas vs twinstep at R N."""
    params, buffers, x, t, ref = _twinstep_case(net_name, classes, replicas * batch, res)
    model = from_twinstep(net_name, params, buffers, classes,
                          AXIS if replicas > 1 else None, jnp.float64)
    fn, state = grad_fn(net_name, model, replicas, AXIS)
    _, grads, _ = fn(state, x, t)
    worst, where, zeros = worst_error(grads_to_timm(net_name, grads), ref)
    print(f"flax peer vs twinstep, f64, R={replicas} N={batch}: worst gradient error "
          f"{worst:.3g} over {len(ref)} tensors")
    print(f"  worst at {where}; {zeros} structural zeros measured against the whole gradient")
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", choices=NETS, default="resnet50")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2, help="rows per replica")
    ap.add_argument("--res", type=int, default=32)
    ap.add_argument("--classes", type=int, default=10)
    args = ap.parse_args(argv)
    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_num_cpu_devices", max(4, args.replicas))
    t0 = time.perf_counter()
    worst = self_check(args.net, args.replicas, args.batch, args.res, args.classes)
    print(f"  ({time.perf_counter() - t0:.0f} s)")
    return 1 if worst > 1e-8 else 0


if __name__ == "__main__":
    sys.exit(main())
