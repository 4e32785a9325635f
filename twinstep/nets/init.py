"""How a net's tensors start: timm's initialisation (He-normal convs, BN gamma 1 / beta 0, each
family's linear layers), and the nudged states the checks start from (docs/nets.md#initialisation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from twinstep.nets.layers import bn_names, buffer_shapes

# How a net's linear layers start (docs/nets.md#initialisation): {name: (the weight's U(+-b)
# bound from (fan_in, fan_out), whether the bias is drawn from the same U(+-b), else 0)}
LINEAR_INITS = {
    # PyTorch's nn.Linear default, which timm's ResNet keeps
    "fan_in": (lambda fan_in, fan_out: 1.0 / np.sqrt(fan_in), True),
    # timm's _init_weight_goog (EfficientNet, MobileNetV3 and V4)
    "fan_out": (lambda fan_in, fan_out: 1.0 / np.sqrt(fan_out), False),
}


def init_params(key, param_shapes: dict, zero_init: tuple = (), dtype=jnp.float32, *,
                linear: str) -> dict:
    """timm's initialisation: convs He normal (fan_out = Co k k / groups, ReLU gain), BN gamma 1,
    beta 0 (gamma 0 for the BN prefixes in ``zero_init``), linear layers as the net's timm
    model starts them, ``linear`` a key of `LINEAR_INITS` (a net's ``LINEAR_INIT``).

    One normal and one uniform draw cover every tensor and are cut on the host: eager
    ``jax.random`` compiles a program per distinct shape."""
    def is_linear(name, shape):  # a linear layer's weight [K, D] or its bias [K]
        prefix = name.rsplit(".", 1)[0]
        return len(shape) == 2 or (name.endswith(".bias") and prefix + ".weight" in param_shapes
                                   and len(param_shapes[prefix + ".weight"]) == 2)

    convs = {k: s for k, s in param_shapes.items() if len(s) == 4}
    linears = {k: s for k, s in param_shapes.items() if is_linear(k, s)}
    normal_key, uniform_key = jax.random.split(key)
    pieces = {**_draw(jax.random.normal, normal_key, convs, dtype),
              **_draw(jax.random.uniform, uniform_key, linears, dtype, -1.0, 1.0)}
    out = {}
    for name, shape in param_shapes.items():
        prefix = name.rsplit(".", 1)[0]
        if name in convs:  # OIHW; depthwise [C, 1, k, k]
            groups = shape[0] if shape[1] == 1 else 1
            fan_out = shape[0] * shape[2] * shape[3] // groups
            # a Python float: a NumPy scalar would promote an f32 weight to f64
            out[name] = pieces[name] * float(np.sqrt(2.0 / fan_out))
        elif name in linears:
            fan_out, fan_in = param_shapes[prefix + ".weight"]
            bound, bias_drawn = LINEAR_INITS[linear]
            out[name] = (pieces[name] * float(bound(fan_in, fan_out)) if bias_drawn
                         or name.endswith(".weight") else np.zeros(shape, dtype))
        elif name.endswith(".weight"):  # BN gamma
            out[name] = (np.zeros if prefix in zero_init else np.ones)(shape, dtype)
        else:  # BN beta
            out[name] = np.zeros(shape, dtype)
    return jax.device_put(out)


def _draw(sample, key, shapes: dict, dtype, *bounds) -> dict:
    """One ``sample(key, (total,), dtype, *bounds)`` cut on the host into the tensors of
    ``shapes``, in order: one program, whatever the number of shapes."""
    sizes = [int(np.prod(s)) for s in shapes.values()]
    flat = np.asarray(sample(key, (sum(sizes),), dtype, *bounds))
    pieces = np.split(flat, np.cumsum(sizes)[:-1]) if sizes else []
    return {name: p.reshape(s) for (name, s), p in zip(shapes.items(), pieces, strict=True)}


def init_buffers(param_shapes: dict, dtype=jnp.float32) -> dict:
    """BN's running means 0 and variances 1, made on the host and put in one transfer (jnp's
    zeros and ones would be a program per shape)."""
    return jax.device_put({k: (np.zeros if k.endswith("mean") else np.ones)(s, dtype)
                           for k, s in buffer_shapes(param_shapes).items()})


NEAR_INIT_SCALE = 0.01  # near-init: every BN gamma 1 + this N(0, 1), every beta this N(0, 1)
BRANCH_END_SCALE = 1e-3  # near-init: a residual branch's last gamma is this N(0, 1)


def near_init_bn(key, params: dict, branch_ends: tuple) -> dict:
    """timm's initialisation, nudged: every BN gamma 1 + 0.01 N(0, 1) and beta 0.01 N(0, 1); the
    last BN of each residual branch (``branch_ends``) gamma 1e-3 N(0, 1) — timm's zero_init_last
    moved just off zero, so that its branch has gradients while each block stays close to the
    identity. A network in this state is as well conditioned as at the start of training: a
    reordered f32 batch moves its gradients by ~1e-6, where `randomize_bn`'s state moves them
    by O(1) (docs/tie.md#f32)."""
    bns = bn_names({k: v.shape for k, v in params.items()})
    channels = {bn: params[bn + ".weight"].shape for bn in bns}
    dtype = params[bns[0] + ".weight"].dtype
    k = jax.random.split(key, 2)
    gamma = _draw(jax.random.normal, k[0], channels, dtype)
    beta = _draw(jax.random.normal, k[1], channels, dtype)
    out = dict(params)
    for bn in bns:
        out[bn + ".weight"] = (BRANCH_END_SCALE * gamma[bn] if bn in branch_ends
                               else 1 + NEAR_INIT_SCALE * gamma[bn])
        out[bn + ".bias"] = NEAR_INIT_SCALE * beta[bn]
    return jax.device_put(out)


def randomize_bn(key, params: dict, buffers: dict) -> tuple[dict, dict]:
    """BN gamma ~ U(0.5, 1.5), beta ~ N(0, 0.2), running mean ~ N(0, 0.2), running var ~
    U(0.5, 2): a parity check whose BNs are the identity at init would miss swapped layers.
    (Four draws cut on the host, as in `init_params`.)"""
    bns = bn_names({k: v.shape for k, v in params.items()})
    if not bns:
        return dict(params), dict(buffers)
    channels = {bn: params[bn + ".weight"].shape for bn in bns}
    dtype = params[bns[0] + ".weight"].dtype
    k = jax.random.split(key, 4)
    gamma = _draw(jax.random.uniform, k[0], channels, dtype, 0.5, 1.5)
    beta = _draw(jax.random.normal, k[1], channels, dtype)
    mean = _draw(jax.random.normal, k[2], channels, dtype)
    var = _draw(jax.random.uniform, k[3], channels, dtype, 0.5, 2.0)
    new_params, new_buffers = {}, {}
    for bn in bns:
        new_params[bn + ".weight"], new_params[bn + ".bias"] = gamma[bn], 0.2 * beta[bn]
        new_buffers[bn + ".running_mean"] = 0.2 * mean[bn]
        new_buffers[bn + ".running_var"] = var[bn]
    return {**params, **jax.device_put(new_params)}, {**buffers, **jax.device_put(new_buffers)}
