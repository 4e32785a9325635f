"""What a network is: tensor and scalar counts, BN layers, 1-D tensors, forward MACs.

MACs are read off the StableHLO of the eval forward at batch 1 (grouped depthwise path, so that
every convolution is one op): a convolution costs |output| x (input channels per group) x k^2,
the classifier |output| x D. Elementwise work (BN, ReLU, pooling) is not counted, as timm's
published GMACs do not count it.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from twinstep.nets import layers

_TENSOR = r"tensor<([0-9x]+)x[a-z0-9]+>"
_CONV = re.compile(r"stablehlo\.convolution.*?:\s*\(" + _TENSOR + r",\s*" + _TENSOR + r"\)\s*->\s*"
                   + _TENSOR)
_DOT = re.compile(r"stablehlo\.dot_general.*?:\s*\(" + _TENSOR + r",\s*" + _TENSOR + r"\)\s*->\s*"
                  + _TENSOR)


def _dims(s: str) -> list[int]:
    return [int(d) for d in s.split("x")]


def count_macs(stablehlo: str) -> int:
    """Multiply-accumulates of the forward convolutions (OIHW kernels) and dot products."""
    macs = 0
    for _, rhs, out in _CONV.findall(stablehlo):
        k = _dims(rhs)
        macs += int(np.prod(_dims(out))) * int(np.prod(k[1:]))
    for lhs, _, out in _DOT.findall(stablehlo):
        macs += int(np.prod(_dims(out))) * _dims(lhs)[-1]
    return macs


def forward_macs(net, res: int = 224, num_classes: int = 1000) -> int:
    shapes = net.param_shapes(num_classes)
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}
    buffers = {k: jax.ShapeDtypeStruct(s, jnp.float32)
               for k, s in layers.buffer_shapes(shapes).items()}
    x = jax.ShapeDtypeStruct((1, res, res, 3), jnp.float32)
    ctx = layers.Ctx(train=False, depthwise_path="grouped")
    text = jax.jit(lambda p, b, x: net.forward(p, b, x, ctx)[0]).lower(params, buffers, x).as_text()
    return count_macs(text)


def describe(net, res: int = 224, num_classes: int = 1000) -> dict:
    shapes = net.param_shapes(num_classes)
    return {
        "net": net.NAME,
        "timm": net.TIMM_NAME,
        "classes": num_classes,
        "res": res,
        "tensors": len(shapes),
        "scalars": int(sum(np.prod(s) for s in shapes.values())),
        "bn_layers": len(layers.bn_names(shapes)),
        "one_d_tensors": sum(len(s) == 1 for s in shapes.values()),
        "buffers": len(layers.buffer_shapes(shapes)),
        "gmacs": forward_macs(net, res, num_classes) / 1e9,
    }
