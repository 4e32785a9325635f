"""The networks, one file each. A net module provides NAME, TIMM_NAME, INPUT_MULTIPLE,
``param_shapes(K)``, ``zero_init_bns()``, ``DROP_PATH_SITES``, ``forward(params, buffers, x, ctx,
...) -> (logits, tape, stats)`` and ``backward(tape, dlogits) -> grads``."""

from twinstep.nets import mobilenetv4, resnet50

NETS = {resnet50.NAME: resnet50, mobilenetv4.NAME: mobilenetv4}


def get_net(name: str):
    try:
        return NETS[name]
    except KeyError:
        raise ValueError(f"unknown net {name!r}; choose from {sorted(NETS)}") from None
