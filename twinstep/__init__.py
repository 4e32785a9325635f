"""twinstep: data-parallel BatchNorm nets (docs/nets.md) with synchronised BatchNorm, whose
R-replica train step is tied to the single-device step at the global batch R·N.

    import twinstep
    report = twinstep.tie("resnet50", replicas=2)
    print(report.verdict())

The functions below are `twinstep.api`'s, imported when first used (``import twinstep`` itself
does not start JAX, so the API can still ask JAX for R virtual CPU devices).
"""

from twinstep.errors import UsageError
from twinstep.version import __version__

API = ("tie", "tie_steps", "tie_render", "render", "load_render", "parse_recipe", "get_net",
       "devices", "train", "pack", "join")
__all__ = ["UsageError", "TrainConfig", "Levers", "__version__", *API]


def __getattr__(name: str):
    # lazy, the facade's reason: ``import twinstep`` imports no JAX (api and TrainConfig do)
    if name in API:
        from twinstep import api

        return getattr(api, name)
    if name == "TrainConfig":  # train's configuration, made and checked before training
        from twinstep.training.config import TrainConfig  # lazy: the facade's reason, above

        return TrainConfig
    if name == "Levers":  # tie's and a Setup's levers (docs/precision.md#gpu-levers)
        from twinstep.ops.levers import Levers  # lazy: the facade's reason, above

        return Levers
    raise AttributeError(f"module 'twinstep' has no attribute {name!r}")
