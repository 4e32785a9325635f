"""Defaults shared by the recipes (plain values, no JAX) and the code that applies them (the
loss, the EMA): one definition each, importable without starting JAX, so that `twinstep recipe`
answers at once."""

LABEL_SMOOTHING = 0.1  # CE's label smoothing unless a recipe names another (timm's default)
EMA_DECAY = 0.9999  # timm's ModelEmaV3 decay
EMA_WARMUPS = ("none", "timm", "tf")  # the EMA decay's warmup curves (twinstep.ema)
BETAS = (0.9, 0.999)  # Adam's and LAMB's (timm's and torch's defaults)
MOMENTUM = 0.9  # SGD's and RMSProp's momentum (timm's)
SCHEDULES = ("cosine", "step")  # the lr schedules after the warmup (twinstep.optim.recipe_schedule)
WARMUP_LR = 1e-5  # `twinstep train`'s lr at step 0, the warmup's start (timm's --warmup-lr)
# the largest R any command accepts, checked before JAX creates a device: more has never been
# run, and on CPU each virtual device takes time to create (4,096: 15 s) and slows the others
MAX_REPLICAS = 1024
