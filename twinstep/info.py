"""What a network is: tensor and scalar counts, BN layers, 1-D tensors, forward MACs.

MACs are read off the StableHLO of the eval forward at batch 1 (grouped depthwise path, so that
every convolution is one op): a convolution costs |output| x (input channels per group) x k^2,
the classifier |output| x D. Elementwise work (BN, ReLU, pooling) is not counted, as timm's
published GMACs do not count it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import hlo, program
from twinstep.nets import layers


def forward_macs(net, res: int = 224, num_classes: int = 1000) -> int:
    """The eval forward's MACs at batch 1 (module docstring)."""
    params, buffers = program.abstract_params(net, num_classes, jnp.float32)
    x = jax.ShapeDtypeStruct((1, res, res, 3), jnp.float32)
    # every convolution one op: grouped depthwise, dense as XLA convolutions
    forward = program.eval_program(net, "f32", depthwise_path="grouped", dense_path="conv")
    return hlo.macs(forward.lower(params, buffers, x).as_text())


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
