"""The optimizers of the recipes, one `Optimizer` row each (docs/recipes.md#optimizers): a
recipe's ``<opt>`` token, its defaults, and what sets its update apart. Their optax chains are
composed from these fields (`twinstep.optim.make_optimizer`); a new optimizer is a row here
(and, if its update is new, its chain there).
"""

from __future__ import annotations

import dataclasses

from twinstep.defaults import BETAS, MOMENTUM


@dataclasses.dataclass(frozen=True, kw_only=True)
class Optimizer:
    """One optimizer of the recipes: what its name token, defaults and update are. Its optax
    chain is composed from these fields (`twinstep.optim.make_optimizer`)."""

    token: str  # in a recipe name (AdamW with accumulation is "acc" alone)
    lr: float  # the peak learning rate when a recipe gives none
    lr_batch: int  # the global batch that lr was published for
    weight_decay: float  # when the name has no wd token
    # an Adam's ε (its moments scale the update) or an RMSProp's (inside the square root); None:
    # SGD's momentum
    eps: float | None = None
    alpha: float | None = None  # RMSProp: its square average's smoothing α; None: not an RMSProp
    nesterov: bool = False  # SGD: Nesterov's momentum, else heavy-ball
    trust_ratio: bool = False  # LAMB: the per-tensor trust ratio, and its own clip inside
    what: str  # its name
    note: str = ""  # what sets it apart

    @property
    def text(self) -> str:
        """One line: what it is, with its hyper-parameters (`twinstep recipe`)."""
        note = f", {self.note}" if self.note else ""
        if self.eps is not None:
            eps = f"{self.eps:.0e}".replace("e-0", "e-")
            if self.alpha is not None:
                return (f"{self.what}: α {self.alpha:g}, ε {eps} inside the square root, "
                        f"momentum {MOMENTUM:g}{note}")
            return f"{self.what}: β {BETAS[0]:g}/{BETAS[1]:g}, ε {eps}{note}"
        momentum = "Nesterov" if self.nesterov else "heavy-ball"
        return f"{self.what}, {momentum} momentum {MOMENTUM:g}" + \
            (f" ({self.note})" if self.note else "")


# the catalogue
OPTIMIZERS = {
    "lamb": Optimizer(token="lamb", lr=5e-3, lr_batch=2048, weight_decay=0.02, eps=1e-6,
                      trust_ratio=True, what="LAMB", note="per-tensor trust ratio"),
    "adamw": Optimizer(token="adam", lr=4e-3, lr_batch=4096, weight_decay=0.05, eps=1e-8,
                       what="AdamW", note="decoupled decay"),
    "momentum": Optimizer(token="mom", lr=0.1, lr_batch=256, weight_decay=1e-4, what="SGD"),
    "sgd": Optimizer(token="sgd", lr=0.1, lr_batch=256, weight_decay=1e-4, nesterov=True,
                     what="SGD", note="timm --opt sgd"),
    # timm's EfficientNet-B0 recipe: --opt rmsproptf --opt-eps .001 --lr .048 --weight-decay 1e-5
    # (2 processes x -b 384). The lr as published, not scaled to DEFAULT_BATCH, as every row's is
    # its recipe's peak at that recipe's own global batch (LAMB's 2048, AdamW's 4096, SGD's 256)
    "rmsproptf": Optimizer(token="rms", lr=0.048, lr_batch=768, weight_decay=1e-5, eps=1e-3,
                           alpha=0.9, what="RMSProp (TF)",
                           note="lr in the momentum, square average from 1"),
}
