"""ResNet v1.5 (timm ``resnet18/34/50/101/152``): forward and explicit backward chain over the
op library, one `ResNet` per row of `VARIANTS` (docs/nets.md).

Names, order and shapes are timm's state_dict keys (OIHW convs, ``fc.weight`` [K, FEATURES]),
so a timm checkpoint loads with no renaming. Activations are NHWC; the input is any multiple
of 32.

    stem        conv1 7x7/2 3->64 -> bn1 -> ReLU -> max-pool 3x3/2 (pad 1, -inf)
    stages      layer1..4: the row's blocks per stage, widths 64/128/256/512 (x4 for a
                bottleneck's output); a stage's first block strides (layer2..4) and
                projects its shortcut when its input width or grid changes
    basic       conv1 3x3/s -> bn1 -> ReLU -> conv2 3x3 -> bn2 [-> drop-path]
                (+ shortcut: downsample.0 1x1/s -> downsample.1) -> ReLU
    bottleneck  conv1 1x1 -> bn1 -> ReLU -> conv2 3x3/s -> bn2 -> ReLU -> conv3 1x1 -> bn3
                [-> drop-path] (+ shortcut as above) -> ReLU
    head        global average pool [-> dropout] -> fc FEATURES -> K

v1.5: a bottleneck's stride sits on its 3x3, so its conv1/bn1 run at the INPUT grid.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.nets import layers
from twinstep.nets.layers import ConvBN, Ctx, conv_bn_forward, conv_bn_vjp

STEM_WIDTH = 64
STAGE_WIDTHS = (64, 128, 256, 512)  # a basic block's output; a bottleneck's middle width
EXPANSION = 4  # a bottleneck's output is 4 x its middle width

# timm's resnets: name -> (blocks in layer1..4, bottleneck blocks or basic ones). One row a net.
#             depths          bottleneck
VARIANTS = {
    "resnet18": ((2, 2, 2, 2), False),
    "resnet34": ((3, 4, 6, 3), False),
    "resnet50": ((3, 4, 6, 3), True),
    "resnet101": ((3, 4, 23, 3), True),
    "resnet152": ((3, 8, 36, 3), True),
}


class Block(NamedTuple):
    prefix: str
    cin: int
    mid: int  # a bottleneck's 1x1 -> 3x3 width; a basic block's conv1 output (= cout)
    cout: int
    stride: int
    projects: bool  # 1x1 conv + BN shortcut: the width or the grid changes


class Tape(NamedTuple):
    names: tuple
    stem: object
    pool: object
    blocks: list
    gap: tuple
    fc: tuple


class ResNet:
    """One row of `VARIANTS` as a `twinstep.nets.Net`."""

    INPUT_MULTIPLE = 32
    MASKS = ("drop_path", "dropout")  # the keyword masks `forward` takes
    TRAIN_RES = 224  # timm's training resolution (the RSB A1/A2 recipes)
    DROP_PATH_RATE = 0.05  # the RSB recipes' stochastic depth
    LINEAR_INIT = "fan_in"  # fc as timm's ResNet leaves it: PyTorch's default (init.py)

    def __init__(self, name: str):
        self.NAME = self.TIMM_NAME = name
        self.depths, self.bottleneck = VARIANTS[name]
        self.FEATURES = STAGE_WIDTHS[-1] * (EXPANSION if self.bottleneck else 1)
        self._blocks = self._stage_blocks()
        # drop-path (stochastic depth) acts on the residual branch of every block, in order
        self.DROP_PATH_SITES = tuple(b.prefix for b in self._blocks)

    def __repr__(self) -> str:
        return f"ResNet({self.NAME!r})"

    def _stage_blocks(self) -> tuple:
        out, cin = [], STEM_WIDTH
        for i, (depth, width) in enumerate(zip(self.depths, STAGE_WIDTHS, strict=True)):
            cout = width * (EXPANSION if self.bottleneck else 1)
            for j in range(depth):
                stride = 2 if i > 0 and j == 0 else 1
                out.append(Block(f"layer{i + 1}.{j}", cin, width, cout, stride,
                                 stride != 1 or cin != cout))
                cin = cout
        return tuple(out)

    def blocks(self) -> tuple:
        """The blocks of the row's stages in order."""
        return self._blocks

    def drop_path_rates(self, rate: float) -> tuple:
        """timm's linear ramp: block i of n drops its branch with rate * i / (n - 1)."""
        n = len(self.DROP_PATH_SITES)
        return tuple(rate * i / (n - 1) for i in range(n))

    def _convs(self, b: Block) -> tuple:
        """(conv, bn, cout, cin, kernel, stride) of ``b``'s branch, in timm's order: the stride
        on its first 3x3."""
        p, s = b.prefix, b.stride
        if self.bottleneck:
            return ((f"{p}.conv1", f"{p}.bn1", b.mid, b.cin, 1, 1),
                    (f"{p}.conv2", f"{p}.bn2", b.mid, b.mid, 3, s),
                    (f"{p}.conv3", f"{p}.bn3", b.cout, b.mid, 1, 1))
        return ((f"{p}.conv1", f"{p}.bn1", b.mid, b.cin, 3, s),
                (f"{p}.conv2", f"{p}.bn2", b.cout, b.mid, 3, 1))

    def param_shapes(self, num_classes: int = 1000) -> dict:
        """{timm name: shape}, in timm's ``named_parameters()`` order."""
        shapes = {}

        def conv_bn(conv, bn, cout, cin, k):
            shapes[conv + ".weight"] = (cout, cin, k, k)
            shapes[bn + ".weight"] = shapes[bn + ".bias"] = (cout,)

        conv_bn("conv1", "bn1", STEM_WIDTH, 3, 7)
        for b in self._blocks:
            for conv, bn, cout, cin, k, _ in self._convs(b):
                conv_bn(conv, bn, cout, cin, k)
            if b.projects:
                conv_bn(f"{b.prefix}.downsample.0", f"{b.prefix}.downsample.1", b.cout, b.cin, 1)
        shapes["fc.weight"], shapes["fc.bias"] = (num_classes, self.FEATURES), (num_classes,)
        return shapes

    def branch_end_bns(self) -> tuple:
        """The last BN of each residual branch: every block's bn3 (bottleneck) or bn2 (basic)."""
        return tuple(self._convs(b)[-1][1] for b in self._blocks)

    def zero_init_bns(self) -> tuple:
        """timm's ``zero_init_last``: the last BN of each block starts with gamma = 0."""
        return self.branch_end_bns()

    def forward(self, params: dict, buffers: dict, x, ctx: Ctx, *, drop_path=None,
                dropout=None):
        """x [N, H, W, 3] -> (logits [N, K], tape, stats {bn: BNStats} — empty in eval mode).

        drop_path: None, or per-example masks [len(DROP_PATH_SITES), N] (already scaled by
        1 / keep) for the residual branches of `DROP_PATH_SITES`; dropout: None, or a
        per-element mask [N, FEATURES] (scaled) on fc's input (timm's ``drop_rate``)."""
        stats = {}
        x = x.astype(ctx.precision.dtype)
        y, stem = conv_bn_forward(params, buffers, ConvBN("conv1", "bn1"), x, stride=2, ctx=ctx,
                                  stats=stats)
        y, pool_tape = layers.maxpool_forward(y, ctx=ctx)
        tapes = []
        for i, b in enumerate(self._blocks):
            mask = None if drop_path is None else drop_path[i]
            y, t = self._block_forward(params, buffers, b, y, ctx=ctx, stats=stats, mask=mask)
            tapes.append(t)
        y, gap = layers.gap_forward(y, ctx=ctx)
        logits, fc = layers.classifier_forward(params, "fc", y, dropout)
        return logits, Tape(tuple(params), stem, pool_tape, tapes, gap, fc), stats

    def backward(self, tape: Tape, dlogits) -> dict:
        """The explicit chain from d logits [N, K] to every parameter gradient (timm order)."""
        grads = {}
        dy = layers.classifier_vjp(tape.fc, dlogits, grads)
        dy = layers.gap_vjp(tape.gap, dy)
        for t in reversed(tape.blocks):
            dy = _block_vjp(t, dy, grads)
        dy = layers.maxpool_vjp(tape.pool, dy)
        conv_bn_vjp(tape.stem, dy, grads)  # the image's cotangent is not needed (XLA drops it)
        return {k: grads[k] for k in tape.names}

    def _block_forward(self, params, buffers, b: Block, x, *, ctx, stats, mask):
        """A block's branch, its shortcut, their sum and the ReLU after it."""
        convs, y, tapes = self._convs(b), x, []
        for i, (conv, bn, _, _, _, stride) in enumerate(convs):
            y, t = conv_bn_forward(params, buffers, ConvBN(conv, bn), y, stride=stride, ctx=ctx,
                                   act="relu" if i < len(convs) - 1 else None,
                                   stats=stats)
            tapes.append(t)
        shortcut, td = x, None
        if b.projects:
            shortcut, td = conv_bn_forward(params, buffers,
                                           ConvBN(f"{b.prefix}.downsample.0",
                                                  f"{b.prefix}.downsample.1"), x,
                                           stride=b.stride, ctx=ctx, act=None, stats=stats)
        y, tr = layers.residual_forward(y, shortcut, ctx=ctx, mask=mask, relu=True)
        return y, (tuple(tapes), td, tr)


def _block_vjp(tape, dy, grads):
    branch, td, tr = tape
    d_branch, d_shortcut = layers.residual_vjp(tr, dy)
    for t in reversed(branch):
        d_branch = conv_bn_vjp(t, d_branch, grads)
    return layers.fork_vjp(tr, d_branch, conv_bn_vjp(td, d_shortcut, grads) if td is not None
                           else d_shortcut)


NETS = tuple(ResNet(name) for name in VARIANTS)
