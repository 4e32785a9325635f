"""``twinstep info NET``: what a network is — tensor and scalar counts, BN layers, 1-D tensors,
forward MACs.

MACs are read off the StableHLO of the eval forward at batch 1 (grouped depthwise path, so that
every convolution is one op): a convolution costs |output| x (input channels per group) x k^2,
the classifier |output| x D. Elementwise work (BN, ReLU, pooling) is not counted, as timm's
published GMACs do not count it.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from rich.table import Table

from twinstep.cli import options
from twinstep.cli.console import report_console
from twinstep.errors import ExitStatus
from twinstep.nets import NETS, layers
from twinstep.ops.levers import Levers
from twinstep.rendering import stablehlo


def add(p) -> None:
    p.description = ("Counts of a network's parameters (timm's names and shapes), its BatchNorm "
                     "layers and 1-D tensors, and its forward multiply-accumulates at one "
                     "resolution (batch 1). " + options.exits({ExitStatus.SUCCESS: "printed"}))
    p.add_argument("net", choices=sorted(NETS))
    options.count(p, "--res", 224, "input resolution (default 224)")
    options.count(p, "--classes", 1000, "classes K (default 1000)", least=2)
    options.json_print(p)


def run(args, parser) -> int:
    from twinstep import api  # lazy, the CLI's reason: the whole API, past 'info --help's needs

    d = describe(api.get_net(args.net), args.res, args.classes)
    if args.json:
        print(json.dumps(d))
        return ExitStatus.SUCCESS
    table = Table(title=f"{d['net']} (timm {d['timm']}), K = {d['classes']}, {d['res']}²")
    table.add_column("")
    table.add_column("", justify="right")
    for label, key in (("parameter tensors", "tensors"), ("parameter scalars", "scalars"),
                       ("BatchNorm layers", "bn_layers"),
                       ("1-D tensors (no weight decay)", "one_d_tensors"),
                       ("running-stat buffers", "buffers")):
        table.add_row(label, f"{d[key]:,}")
    table.add_row("forward GMACs (convs + classifier)", f"{d['gmacs']:.2f}")
    report_console().print(table)
    return ExitStatus.SUCCESS


def forward_macs(net, res: int = 224, num_classes: int = 1000) -> int:
    """The eval forward's MACs at batch 1 (module docstring)."""
    from twinstep import program  # lazy, the CLI's reason: the step and optax, as in run

    params, buffers = program.abstract_params(net, num_classes, jnp.float32)
    x = jax.ShapeDtypeStruct((1, res, res, 3), jnp.float32)
    # every convolution one op: grouped depthwise, dense as XLA convolutions
    forward = program.eval_program(net, program.Setup(levers=Levers(depthwise_path="grouped",
                                                                    dense_path="conv")))
    return stablehlo.macs(forward.lower(params, buffers, x).as_text())


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
