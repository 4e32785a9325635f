"""The named recipes, as plain data: the published presets as a table of `Recipe` fields
(docs/recipes.md; `twinstep.recipes.PRESETS` holds them as recipes) and the reference grammar
names whose renders are committed (docs/renders.md)."""

from __future__ import annotations

IMAGENET_TRAIN_IMAGES = 1_281_167


REPLICAS = 8  # the R each preset is data-parallel for: N = timm's global batch / 8


def _preset(epochs: int, global_batch: int, replicas: int = REPLICAS, **fields) -> dict:
    """A preset's row (docs/recipes.md) as dp at N = global / R with k = 1 on R = 8, its schedule
    per optimizer step: timm's drop-last epoch of ImageNet, 5 warmup epochs, cosine to the end."""
    per_epoch = IMAGENET_TRAIN_IMAGES // global_batch
    return dict(dp=True, batch=global_batch // replicas, wx=True, epochs=epochs,
                warmup_steps=5 * per_epoch, total_steps=epochs * per_epoch, **fields)


# The accuracy anchors (docs/recipes.md). wx: timm excludes 1-D tensors from decay by default. No
# clip (timm's LAMB clips at 1.0 internally), no EMA, f32: precision is the render's choice, not the
# recipe's accuracy.
PRESETS: dict[str, dict] = {  # name -> the fields of its `twinstep.recipes.Recipe`
    "rsb-a1": _preset(600, 2048, net="resnet50", optimizer="lamb", lr=5e-3, weight_decay=0.01,
                      bce=True, bce_threshold=0.2, label_smoothing=0.1, drop=True,
                      drop_path_rate=0.05, mixup=0.2, randaugment=7, repeated_aug=3),
    "rsb-a2": _preset(300, 2048, net="resnet50", optimizer="lamb", lr=5e-3, weight_decay=0.02,
                      bce=True, bce_threshold=0.2, drop=True, drop_path_rate=0.05,
                      mixup=0.1, cutmix=1.0, randaugment=6, repeated_aug=3),
    "rsb-a3": _preset(100, 2048, net="resnet50", res=160, eval_res=224, optimizer="lamb", lr=8e-3,
                      weight_decay=0.02, bce=True,
                      mixup=0.1, cutmix=1.0, randaugment=6),
    "mnv4-conv-m": _preset(500, 4096, net="mnv4", optimizer="adamw", lr=4e-3, weight_decay=0.1,
                           label_smoothing=0.1, drop=True, drop_path_rate=0.075, dropout=True,
                           dropout_rate=0.2, randaugment=15),
}

REFERENCE_NAMES = (
    "resnet50in160_lambaccdp4x128wxclipbcebf16",
    "resnet50in160_lambaccdp8x64wxclipbce",
    "resnet50in_lambaccdp4x128wxclipdropbce",
    "resnet50in_emalambaccdp4x128wxclipdropbce",
    "resnet50in_momdp64",
    "mnv4in_emaaccdp8x128wxdowd005bf16",
    "mnv4in_accdp8x128wxdropdowd01bf16",
    "mnv4in_adamdp64",
)
