"""What the loop oracle (tests/test_loop.py) hands timm's loop from twinstep: the masks
twinstep draws, for timm's DropPath modules and its classifier's dropout, and the state a step
starts from where timm's own loop is chaotic (docs/recipes.md#the-loop-against-timm)."""

import numpy as np
from oracle_libs import torch


def _handed_modules():
    """(`HandedDropPath`, `HandedDropout`): torch modules, so defined at their first use — this
    file imports without torch (`make test-fast` collects tests/test_loop.py, then deselects it)."""
    class HandedDropPath(torch.nn.Module):
        """timm's DropPath of rate ``drop`` applying ``mask`` — twinstep's draw of the rows
        kept, each 0 or 1 / keep (`twinstep.step.draw_masks`) — instead of a draw of torch's
        own."""

        def __init__(self, drop: float):
            super().__init__()
            self.keep, self.mask = 1.0 - drop, None

        def forward(self, x):
            assert set(np.unique(self.mask)) <= {0.0, 1.0 / self.keep}  # timm's rate, twinstep's
            return x * torch.tensor(self.mask).view(-1, 1, 1, 1)

    class HandedDropout(torch.nn.Module):
        """timm's classifier dropout (`F.dropout` in MobileNetV3's forward_head, turned off by
        its ``drop_rate`` = 0) applying ``mask`` [rows, features] — twinstep's draw — before the
        classifier, through a forward pre-hook."""

        def __init__(self, drop: float, classifier):
            super().__init__()
            self.keep, self.mask = 1.0 - drop, None
            classifier.register_forward_pre_hook(lambda _, args: (self(args[0]),))

        def forward(self, x):
            assert set(np.unique(self.mask)) <= {0.0, 1.0 / self.keep}
            return x * torch.tensor(self.mask)

    return HandedDropPath, HandedDropout


def __getattr__(name: str):
    """``HandedDropPath`` and ``HandedDropout`` (`_handed_modules`), made once, at first access."""
    if name in ("HandedDropPath", "HandedDropout"):
        globals()["HandedDropPath"], globals()["HandedDropout"] = _handed_modules()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def hand_masks(model, recipe, rows: int, step: int, micro: int) -> None:
    """Gives ``model``'s `HandedDropPath` and `HandedDropout` modules their rows of the masks
    twinstep draws for a global batch of ``rows`` at micro-step ``micro`` of optimizer step
    ``step`` (0-based) of a seed-0 run: the step's key as `twinstep.training.loop` folds it, the
    micro-step's as `twinstep.step`."""
    import jax

    from twinstep import step as steps
    from twinstep.nets import get_net

    net = get_net(recipe.net)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), step), micro)
    masks = {k: np.asarray(m) for k, m in steps.draw_masks(
        net, recipe, key, rows, np.float64).items()}
    for site, mask in zip(net.DROP_PATH_SITES, masks.get("drop_path", ()), strict=True):
        drop = model.get_submodule(site).drop_path
        if drop is None:  # timm's rate 0 (the first block): no module, and twinstep keeps all
            assert np.all(mask == 1)
        else:
            drop.mask = mask
    if "dropout" in masks:
        model.twinstep_dropout.mask = masks["dropout"]


def masked_timm(net, params, buffers, classes: int, drop_path=None, dropout=None,
                dtype: str = "float64"):
    """timm's model of ``net`` with twinstep's weights (`twinstep.checking.parity.to_timm`, in
    ``dtype``) and twinstep's masks in place of timm's draws, in train mode: ``drop_path``
    [sites, rows] multiplies each residual block's branch (`net.DROP_PATH_SITES`), ``dropout``
    [rows, features] the classifier's input. The oracle half of the nets' mask tests."""
    from twinstep.checking import parity

    class MaskMul(torch.nn.Module):
        """timm's DropPath as a multiplication by twinstep's per-row mask (train mode)."""

        def __init__(self, mask):
            super().__init__()
            self.mask = mask

        def forward(self, x):
            return x * self.mask.view(-1, 1, 1, 1) if self.training else x

    kind = getattr(torch, dtype)
    model = parity.to_timm(net, params, buffers, classes, dtype=dtype)
    for prefix, mask in zip(net.DROP_PATH_SITES, drop_path, strict=True) if (
            drop_path is not None) else ():
        block = model.get_submodule(prefix)
        assert getattr(block, "has_skip", True), prefix  # a site is a residual block's branch
        block.drop_path = MaskMul(torch.tensor(np.asarray(mask), dtype=kind))
    if dropout is not None:
        tmask = torch.tensor(np.asarray(dropout), dtype=kind)
        model.get_classifier().register_forward_pre_hook(
            lambda m, args: (args[0] * tmask,) if m.training else args)
    return model


MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq", "trace": "momentum_buffer"}  # optax's: torch's


def start_from(model, opt, ema, state: dict) -> None:
    """Overwrites the tensors of timm's loop (after its first update: the optimizer's state
    exists) with ``state``, a twinstep checkpoint in the loop oracle's groups (`_ours`); the
    counts (the optimizer's step, the EMA's, the scheduler's) stay the loop's own."""
    def put(tensors, values):
        for k, t in tensors:
            if not k.endswith("num_batches_tracked"):
                t.detach().copy_(torch.tensor(np.asarray(values[k])))

    put(model.named_parameters(), state["params"])
    put(model.named_buffers(), state["buffers"])
    for k, p in model.named_parameters():
        put(((g, opt.state[p][theirs]) for g, theirs in MOMENTS.items() if g in state),
            {g: state[g][k] for g in MOMENTS if g in state})
    if ema is not None:
        put(ema.module.named_parameters(), state["ema"])
        put(ema.module.named_buffers(), state["ema_buffers"])
