"""The networks, one file per family; each net is a `Net` (the interface its callers use).

Adding a network is a row in its family's table (`resnet.VARIANTS`, `efficientnet.VARIANTS`,
`mobilenetv4.VARIANTS`), or a new file implementing `Net` whose nets `NETS` lists; the recipes,
the tie, the trainer, renders and the tests take every net from `NETS` (docs/nets.md).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from twinstep.nets import efficientnet, mobilenetv4, resnet


@runtime_checkable
class Net(Protocol):
    """What callers use of a net module. Shapes: N examples, K classes, H = W a multiple of
    `INPUT_MULTIPLE`; activations NHWC, parameters in timm's names and shapes.

    ``isinstance(net, Net)`` checks that every member is present (not their types)."""

    NAME: str  # twinstep's name: "resnet50", "mnv4"
    TIMM_NAME: str  # the timm model it matches, e.g. "mobilenetv4_conv_medium"
    INPUT_MULTIPLE: int  # H and W of an input must be positive multiples of it
    FEATURES: int  # the classifier's input width D (its weight is [K, D])
    DROP_PATH_SITES: tuple[str, ...]  # block prefixes whose residual branch drop-path masks
    MASKS: tuple[str, ...]  # the keyword mask arguments `forward` accepts, e.g. ("drop_path",)
    TRAIN_RES: int  # the default training resolution of a recipe for this net (no <res> token)
    DROP_PATH_RATE: float  # the default stochastic-depth rate of a recipe with 'drop'
    LINEAR_INIT: str  # how timm starts its linear layers: a key of init.LINEAR_INITS

    def param_shapes(self, num_classes: int = 1000) -> dict[str, tuple[int, ...]]:
        """{timm name: shape} in timm's ``named_parameters()`` order; the classifier is
        [K, FEATURES] and [K] for K = num_classes."""
        ...

    def zero_init_bns(self) -> tuple[str, ...]:
        """BN prefixes whose gamma starts at 0 (timm's init), possibly none."""
        ...

    def branch_end_bns(self) -> tuple[str, ...]:
        """BN prefixes that end a residual branch (the branch's output is added to its skip)."""
        ...

    def drop_path_rates(self, rate: float) -> tuple[float, ...]:
        """timm's per-site drop-path rates for a model rate: one per `DROP_PATH_SITES` entry."""
        ...

    def forward(self, params: dict, buffers: dict, x: Any, ctx: Any,
                **masks: Any) -> tuple[Any, Any, dict]:
        """x [N, H, W, 3] -> (logits [N, K], tape, stats {bn prefix: BNStats}, empty in eval).

        ``ctx`` is a `twinstep.nets.layers.Ctx`; ``masks`` are the keywords of `MASKS`, each
        None or already scaled by 1 / keep: drop_path [len(DROP_PATH_SITES), N], dropout
        [N, FEATURES]."""
        ...

    def backward(self, tape: Any, dlogits: Any) -> dict:
        """d logits [N, K] -> {timm name: gradient}, every parameter of the forward's params,
        in their order and shapes (this replica's, before any gradient collective)."""
        ...


NETS: dict[str, Net] = {net.NAME: net for family in (resnet, efficientnet, mobilenetv4)
                        for net in family.NETS}


def get_net(name: str) -> Net:
    try:
        return NETS[name]
    except KeyError:
        raise ValueError(f"unknown net {name!r}; choose from {sorted(NETS)}") from None
