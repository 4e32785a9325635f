"""A twinstep recipe as timm's train.py builds it from its flags: the optimizer, the scheduler
stepped per update (--sched-on-updates), the EMA, the loss and the clip, from timm's own
components. Shared by the loop oracle (tests/test_loop.py) and the run against timm
(bench/timm_train.py); the flags each recipe token maps to are in docs/recipes.md.

Each ``control`` changes one thing on timm's side, for a check that must then fail:
"per-epoch" (the scheduler stepped per epoch of 5 updates), "warmup-from-0", "bn-momentum"
(0.01), "ema-warmup" (flipped), "decay-everything" (weight decay on BN and bias too),
"adam-betas" (AdamW's and LAMB's β (0.8, 0.99) for (0.9, 0.999)).
"""

from oracle_libs import torch

# "adam-betas": both moments decay otherwise; the first update, bias-corrected, is the same
ADAM_BETAS_CONTROL = (0.8, 0.99)


def optimizer(model, recipe, control: str = "none"):
    """timm's create_optimizer_v2 with the recipe's optimizer, lr, weight decay and filter."""
    from timm.optim import create_optimizer_v2

    if control == "bn-momentum":
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = 0.01
    from twinstep.optimizers import OPTIMIZERS

    betas = {"betas": ADAM_BETAS_CONTROL} if control == "adam-betas" else {}
    # --opt-eps: the row's ε (RMSpropTF's default, 1e-10, is not the recipe's 1e-3; SGD has none)
    eps = OPTIMIZERS[recipe.optimizer].eps
    return create_optimizer_v2(model, opt=recipe.optimizer, lr=recipe.lr,
                               weight_decay=recipe.effective_weight_decay,
                               filter_bias_and_bn=recipe.wx and control != "decay-everything",
                               **betas, **({} if eps is None else {"eps": eps}))


def scheduler(opt, recipe, control: str = "none"):
    """(timm's cosine scheduler, updates per epoch); step it with `step`."""
    from timm.scheduler import create_scheduler_v2

    per = 5 if control == "per-epoch" else 1  # updates per epoch
    sched, _ = create_scheduler_v2(
        opt, "cosine", num_epochs=recipe.total_steps // per,
        warmup_epochs=recipe.warmup_steps // per,
        warmup_lr=0.0 if control == "warmup-from-0" else recipe.warmup_lr, min_lr=0.0,
        step_on_epochs=per > 1, updates_per_epoch=per)
    return sched, per


def step(sched, per: int, updates: int) -> None:
    """The scheduler after ``updates`` optimizer steps, as train.py steps it."""
    if per > 1:
        if updates % per == 0:
            sched.step(updates // per)
    else:
        sched.step_update(num_updates=updates)


def ema(model, recipe, control: str = "none"):
    """timm's ModelEmaV3 when the recipe has ``ema`` (call ``.update(model, step=updates)``
    after each optimizer step), else None."""
    from timm.utils import ModelEmaV3

    if not recipe.ema:
        return None
    return ModelEmaV3(model, decay=recipe.ema_decay,
                      use_warmup=(recipe.ema_warmup == "timm") != (control == "ema-warmup"))


def loss(recipe, mixing: bool = False):
    """train.py's loss for the recipe: BinaryCrossEntropy with its threshold, else
    SoftTargetCrossEntropy under mixup / CutMix, else label-smoothed CE."""
    from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy

    smoothing = recipe.effective_label_smoothing
    if recipe.loss == "bce":
        return BinaryCrossEntropy(smoothing=smoothing, target_threshold=recipe.bce_threshold)
    return SoftTargetCrossEntropy() if mixing else LabelSmoothingCrossEntropy(smoothing)


def clip(model, recipe) -> None:
    """train.py's --clip-grad 1.0 (mode norm) on the accumulated gradient, if the recipe clips."""
    from timm.utils import dispatch_clip_grad

    if recipe.clip:
        dispatch_clip_grad(list(model.parameters()), value=1.0, mode="norm")


def update(model, recipe, opt, sched, per: int, ema, updates: int) -> int:
    """The end of an optimizer step as train.py writes it, on the accumulated gradient: the
    clip, the optimizer, zero_grad, the EMA, the scheduler. Returns the updates done."""
    clip(model, recipe)
    opt.step()
    opt.zero_grad()
    updates += 1
    if ema is not None:
        ema.update(model, step=updates)
    step(sched, per, updates)
    return updates
