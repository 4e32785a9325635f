"""ResNet-50 v1.5 (timm ``resnet50``): forward and explicit backward chain over the op library.

161 parameter tensors, 25,557,032 scalars at K = 1000; 53 convs, 53 BNs. Names, order and
shapes are timm's state_dict keys (OIHW convs, ``fc.weight`` [K, 2048]), so a timm checkpoint
loads with no renaming. Activations are NHWC; the input is any multiple of 32.

    stem    conv1 7x7/2 3->64 -> bn1 -> ReLU -> max-pool 3x3/2 (pad 1, -inf)
    stages  layer1..4 (`STAGE_ROWS`): [3, 4, 6, 3] bottlenecks, widths 256/512/1024/2048,
            mid = width / 4
    block   conv1 1x1 -> bn1 -> ReLU -> conv2 3x3/s -> bn2 -> ReLU -> conv3 1x1 -> bn3
            [-> drop-path] (+ shortcut: downsample.0 1x1/s -> downsample.1 in block 0) -> ReLU
    head    global average pool -> fc 2048 -> K

v1.5: the stride sits on the 3x3, so conv1/bn1 of a strided block run at the INPUT grid.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.nets import layers
from twinstep.nets.layers import ConvBN, Ctx, conv_bn_forward, conv_bn_vjp
from twinstep.ops import dense

NAME = "resnet50"
TIMM_NAME = "resnet50"
INPUT_MULTIPLE = 32
STEM_WIDTH = 64
MASKS = ("drop_path",)  # the keyword masks `forward` takes
TRAIN_RES = 224  # timm's training resolution for resnet50 (the RSB A1/A2 recipes)
DROP_PATH_RATE = 0.05  # the RSB recipes' stochastic depth
LINEAR_INIT = "fan_in"  # fc as timm's ResNet leaves it: PyTorch's default (layers.py)

# timm's resnet50 stages layer1..4: one row per stage (d bottlenecks of output width c, the
# stage's first block striding by s on its 3x3 and projecting its shortcut).
#   d  c     s
STAGE_ROWS = (
    (3, 256, 1),
    (4, 512, 2),
    (6, 1024, 2),
    (3, 2048, 2),
)
FEATURES = STAGE_ROWS[-1][1]


class Block(NamedTuple):
    prefix: str
    cin: int
    mid: int
    cout: int
    stride: int
    projects: bool  # block 0 of a stage: 1x1 conv + BN shortcut


def blocks() -> list[Block]:
    """The 16 bottlenecks of `STAGE_ROWS` in order."""
    out, cin = [], STEM_WIDTH
    for i, (depth, width, stride) in enumerate(STAGE_ROWS):
        for j in range(depth):
            out.append(Block(f"layer{i + 1}.{j}", cin, width // 4, width,
                             stride if j == 0 else 1, j == 0))
            cin = width
    return out


# Drop-path (stochastic depth) acts on the residual branch of these blocks, in this order.
DROP_PATH_SITES = tuple(b.prefix for b in blocks())


def drop_path_rates(rate: float) -> tuple:
    """timm's linear ramp: bottleneck i of 16 drops its branch with rate * i / 15."""
    n = len(DROP_PATH_SITES)
    return tuple(rate * i / (n - 1) for i in range(n))


def param_shapes(num_classes: int = 1000) -> dict:
    """{timm name: shape}, in timm's ``named_parameters()`` order."""
    shapes = {}

    def conv_bn(conv, bn, cout, cin, k):
        shapes[conv + ".weight"] = (cout, cin, k, k)
        shapes[bn + ".weight"] = shapes[bn + ".bias"] = (cout,)

    conv_bn("conv1", "bn1", STEM_WIDTH, 3, 7)
    for b in blocks():
        conv_bn(f"{b.prefix}.conv1", f"{b.prefix}.bn1", b.mid, b.cin, 1)
        conv_bn(f"{b.prefix}.conv2", f"{b.prefix}.bn2", b.mid, b.mid, 3)
        conv_bn(f"{b.prefix}.conv3", f"{b.prefix}.bn3", b.cout, b.mid, 1)
        if b.projects:
            conv_bn(f"{b.prefix}.downsample.0", f"{b.prefix}.downsample.1", b.cout, b.cin, 1)
    shapes["fc.weight"], shapes["fc.bias"] = (num_classes, FEATURES), (num_classes,)
    return shapes


def branch_end_bns() -> tuple:
    """The last BN of each residual branch: every block's bn3."""
    return tuple(f"{b.prefix}.bn3" for b in blocks())


def zero_init_bns() -> tuple:
    """timm's ``zero_init_last``: the last BN of each block starts with gamma = 0."""
    return branch_end_bns()


class Tape(NamedTuple):
    names: tuple
    stem: object
    pool: object
    blocks: list
    gap: tuple
    fc: tuple


def forward(params: dict, buffers: dict, x, ctx: Ctx, *, drop_path=None):
    """x [N, H, W, 3] -> (logits [N, K], tape, stats {bn: BNStats} — empty in eval mode).

    drop_path: None, or per-example masks [16, N] (already scaled by 1 / keep) for the
    residual branches of `DROP_PATH_SITES`."""
    stats = {}
    x = x.astype(ctx.precision.dtype)
    y, stem = conv_bn_forward(params, buffers, ConvBN("conv1", "bn1"), x, stride=2, ctx=ctx,
                              stats=stats)
    y, pool_tape = layers.maxpool_forward(y, ctx=ctx)
    tapes = []
    for i, b in enumerate(blocks()):
        mask = None if drop_path is None else drop_path[i]
        y, t = _bottleneck_forward(params, buffers, b, y, ctx=ctx, stats=stats, mask=mask)
        tapes.append(t)
    y, gap = layers.gap_forward(y, ctx=ctx)
    logits, fc = dense.dense_forward(y, params["fc.weight"], params["fc.bias"])
    return logits, Tape(tuple(params), stem, pool_tape, tapes, gap, fc), stats


def backward(tape: Tape, dlogits) -> dict:
    """The explicit chain from d logits [N, K] to all 161 parameter gradients (timm order)."""
    grads = {}
    dy, grads["fc.weight"], grads["fc.bias"] = dense.dense_vjp(tape.fc, dlogits)
    dy = layers.gap_vjp(tape.gap, dy)
    for t in reversed(tape.blocks):
        dy = _bottleneck_vjp(t, dy, grads)
    dy = layers.maxpool_vjp(tape.pool, dy)
    conv_bn_vjp(tape.stem, dy, grads)  # the image's cotangent is not needed (XLA drops it)
    return {k: grads[k] for k in tape.names}


def _bottleneck_forward(params, buffers, b: Block, x, *, ctx, stats, mask):
    p = b.prefix
    y, t1 = conv_bn_forward(params, buffers, ConvBN(f"{p}.conv1", f"{p}.bn1"), x, stride=1,
                            ctx=ctx, stats=stats)
    y, t2 = conv_bn_forward(params, buffers, ConvBN(f"{p}.conv2", f"{p}.bn2"), y,
                            stride=b.stride, ctx=ctx, stats=stats)
    y, t3 = conv_bn_forward(params, buffers, ConvBN(f"{p}.conv3", f"{p}.bn3"), y, stride=1,
                            ctx=ctx, relu=False, stats=stats)
    shortcut, td = x, None
    if b.projects:
        shortcut, td = conv_bn_forward(params, buffers,
                                       ConvBN(f"{p}.downsample.0", f"{p}.downsample.1"), x,
                                       stride=b.stride, ctx=ctx, relu=False, stats=stats)
    y, tr = layers.residual_forward(y, shortcut, ctx=ctx, mask=mask, relu=True)
    return y, (t1, t2, t3, td, tr)


def _bottleneck_vjp(tape, dy, grads):
    t1, t2, t3, td, tr = tape
    d_branch, d_shortcut = layers.residual_vjp(tr, dy)
    dx = conv_bn_vjp(t1, conv_bn_vjp(t2, conv_bn_vjp(t3, d_branch, grads), grads), grads)
    return layers.fork_vjp(tr, dx, conv_bn_vjp(td, d_shortcut, grads) if td is not None
                           else d_shortcut)
