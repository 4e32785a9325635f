"""MobileNetV2 and EfficientNet-B0 (timm ``mobilenetv2_100``, ``efficientnet_b0``): forward and
explicit backward chain, one `EfficientNet` per row of `VARIANTS` — timm builds both with one
class from one block library, and so does this module (docs/nets.md).

Names, order and shapes are timm's state_dict keys (OIHW convs, depthwise [C, 1, k, k],
``classifier.weight`` [K, 1280]). Activations are NHWC; the input is any multiple of 32.

    stem   conv_stem 3x3/2 3->32 -> bn1 -> act
    ds     depthwise-separable (timm DepthwiseSeparableConv): conv_dw k x k /s -> bn1 -> act
           [-> se] -> conv_pw 1x1 -> bn2 [-> drop-path] (+ x iff stride 1 and in = out)
    ir     inverted residual (timm InvertedResidual): conv_pw 1x1 -> bn1 -> act
           -> conv_dw k x k /s -> bn2 -> act [-> se] -> conv_pwl 1x1 -> bn3
           [-> drop-path] (+ x iff stride 1 and in = out)
    se     squeeze-excite on the block's widest activation, R = round(ratio x block input):
           mean over H, W -> conv_reduce (bias) -> act -> conv_expand (bias) -> sigmoid gate
    head   conv_head 1x1 320->1280 -> bn2 -> act -> global average pool [-> dropout]
           -> classifier 1280 -> K

act is ReLU6 in MobileNetV2 (its gradient 0 at 0 and 6) and SiLU in EfficientNet-B0.

In train mode every block's last BN bias has an exactly zero gradient: the block's output
reaches the next BNs only through 1x1 convs (and identity skips), which carry a per-channel
constant to a BN that removes it — unless a drop-path mask differs across the batch.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.nets import layers
from twinstep.nets.layers import ConvBN, Ctx, conv_bn_forward, conv_bn_vjp

STEM_WIDTH = 32
HEAD_WIDTH = 320  # the last row's width
FEATURES = 1280  # conv_head's width, the classifier's input

# timm's arch_def, one row per stage: ``{kind}_r{r}_k{k}_s{s}_e{e}_c{c}`` (r repeats, k the
# depthwise kernel, s the stride of the row's first block, e the expansion, c the output width)
#   kind  r  k  s  e    c
MOBILENETV2 = (
    ("ds", 1, 3, 1, 1, 16),
    ("ir", 2, 3, 2, 6, 24),
    ("ir", 3, 3, 2, 6, 32),
    ("ir", 4, 3, 2, 6, 64),
    ("ir", 3, 3, 1, 6, 96),
    ("ir", 3, 3, 2, 6, 160),
    ("ir", 1, 3, 1, 6, HEAD_WIDTH),
)
EFFICIENTNET_B0 = (
    ("ds", 1, 3, 1, 1, 16),
    ("ir", 2, 3, 2, 6, 24),
    ("ir", 2, 5, 2, 6, 40),
    ("ir", 3, 3, 2, 6, 80),
    ("ir", 3, 5, 1, 6, 112),
    ("ir", 4, 5, 2, 6, 192),
    ("ir", 1, 3, 1, 6, HEAD_WIDTH),
)


class Variant(NamedTuple):
    timm_name: str
    rows: tuple  # the arch_def table
    act: str  # a key of layers.ACTIVATIONS
    se: float  # squeeze-excite's ratio to a block's input width; 0: none


# twinstep's name (the seeds' system's) -> its row
VARIANTS = {
    "mobilenetv2": Variant("mobilenetv2_100", MOBILENETV2, "relu6", 0.0),
    "efficientnet": Variant("efficientnet_b0", EFFICIENTNET_B0, "silu", 0.25),
}


class Layer(NamedTuple):
    """conv (k x k, stride) -> BN [-> act], addressed by timm's prefixes."""

    conv: str
    bn: str
    cin: int
    cout: int
    k: int
    stride: int = 1
    act: bool = True
    depthwise: bool = False


class Block(NamedTuple):
    prefix: str
    layers: tuple  # the block's layers; squeeze-excite acts after `se_after` of them
    se_after: int  # the number of layers before the squeeze-excite (0: none)
    se_width: int  # R: conv_reduce's output width
    skip: bool  # identity skip (and drop-path site): stride 1 and in = out


class Tape(NamedTuple):
    names: tuple
    stem: object
    blocks: list
    head: object
    gap: tuple
    classifier: tuple


class EfficientNet:
    """One row of `VARIANTS` as a `twinstep.nets.Net`."""

    INPUT_MULTIPLE = 32
    FEATURES = FEATURES
    MASKS = ("drop_path", "dropout")  # the keyword masks `forward` takes
    TRAIN_RES = 224  # timm's training resolution for both
    DROP_PATH_RATE = 0.2  # timm's EfficientNet-B0 recipe (--drop-path 0.2)
    LINEAR_INIT = "fan_out"  # the classifier as timm's _init_weight_goog starts it (init.py)

    def __init__(self, name: str):
        self.NAME = name
        self.TIMM_NAME, self.rows, self.act, self.se = VARIANTS[name]
        self.stem = Layer("conv_stem", "bn1", 3, STEM_WIDTH, 3, 2)
        self.head = Layer("conv_head", "bn2", HEAD_WIDTH, FEATURES, 1)
        self._blocks = self._table_blocks()
        # drop-path (stochastic depth) acts on the residual branch of the skip blocks, in order
        self.DROP_PATH_SITES = tuple(b.prefix for b in self._blocks if b.skip)

    def __repr__(self) -> str:
        return f"EfficientNet({self.NAME!r})"

    def _table_blocks(self) -> tuple:
        out, cin = [], STEM_WIDTH
        for stage, (kind, r, k, s, e, c) in enumerate(self.rows):
            for j in range(r):
                p, stride = f"blocks.{stage}.{j}", s if j == 0 else 1
                se_width = round(cin * self.se)
                if kind == "ds":
                    lays = (Layer(f"{p}.conv_dw", f"{p}.bn1", cin, cin, k, stride,
                                  depthwise=True),
                            Layer(f"{p}.conv_pw", f"{p}.bn2", cin, c, 1, act=False))
                    se_after = 1
                else:
                    mid = cin * e  # a multiple of 8 here: timm's make_divisible is the identity
                    lays = (Layer(f"{p}.conv_pw", f"{p}.bn1", cin, mid, 1),
                            Layer(f"{p}.conv_dw", f"{p}.bn2", mid, mid, k, stride,
                                  depthwise=True),
                            Layer(f"{p}.conv_pwl", f"{p}.bn3", mid, c, 1, act=False))
                    se_after = 2
                out.append(Block(p, lays, se_after if self.se else 0, se_width,
                                 stride == 1 and cin == c))
                cin = c
        return tuple(out)

    def blocks(self) -> tuple:
        """The blocks of ``model.blocks`` in order."""
        return self._blocks

    def drop_path_rates(self, rate: float) -> tuple:
        """timm's ramp: block i of all n gets rate * i / n; only the skip blocks use theirs."""
        n = len(self._blocks)
        return tuple(rate * i / n for i, b in enumerate(self._blocks) if b.skip)

    def param_shapes(self, num_classes: int = 1000) -> dict:
        """{timm name: shape}, in timm's ``named_parameters()`` order."""
        shapes = {}

        def conv_bn(la: Layer):
            shapes[la.conv + ".weight"] = (la.cout, 1 if la.depthwise else la.cin, la.k, la.k)
            shapes[la.bn + ".weight"] = shapes[la.bn + ".bias"] = (la.cout,)

        conv_bn(self.stem)
        for b in self._blocks:
            for i, la in enumerate(b.layers):
                if i == b.se_after and b.se_after:
                    c, r = b.layers[i - 1].cout, b.se_width
                    shapes[b.prefix + ".se.conv_reduce.weight"] = (r, c, 1, 1)
                    shapes[b.prefix + ".se.conv_reduce.bias"] = (r,)
                    shapes[b.prefix + ".se.conv_expand.weight"] = (c, r, 1, 1)
                    shapes[b.prefix + ".se.conv_expand.bias"] = (c,)
                conv_bn(la)
        conv_bn(self.head)
        shapes["classifier.weight"] = (num_classes, FEATURES)
        shapes["classifier.bias"] = (num_classes,)
        return shapes

    def branch_end_bns(self) -> tuple:
        """The last BN of each residual branch: that of every identity-skip block."""
        return tuple(b.layers[-1].bn for b in self._blocks if b.skip)

    def zero_init_bns(self) -> tuple:
        """timm's ``_init_weight_goog`` sets every BN gamma to 1: none."""
        return ()

    def forward(self, params: dict, buffers: dict, x, ctx: Ctx, *, drop_path=None,
                dropout=None):
        """x [N, H, W, 3] -> (logits [N, K], tape, stats {bn: BNStats} — empty in eval mode).

        drop_path: None, or per-example masks [len(DROP_PATH_SITES), N] (already scaled by
        1 / keep) for the residual branches of `DROP_PATH_SITES`; dropout: None, or a
        per-element mask [N, 1280] (scaled) on the classifier's input (timm's ``drop_rate``)."""
        stats = {}
        y, stem = self._layer(params, buffers, self.stem, x.astype(ctx.precision.dtype),
                              ctx=ctx, stats=stats)
        tapes = []
        for b, mask in zip(self._blocks, layers.block_masks([b.skip for b in self._blocks],
                                                            drop_path), strict=True):
            y, t = self._block_forward(params, buffers, b, y, ctx=ctx, stats=stats, mask=mask)
            tapes.append(t)
        y, head = self._layer(params, buffers, self.head, y, ctx=ctx, stats=stats)
        y, gap = layers.gap_forward(y, ctx=ctx)
        logits, classifier = layers.classifier_forward(params, "classifier", y, dropout)
        return logits, Tape(tuple(params), stem, tapes, head, gap, classifier), stats

    def backward(self, tape: Tape, dlogits) -> dict:
        """The explicit chain from d logits [N, K] to every parameter gradient (timm order)."""
        grads = {}
        dy = layers.classifier_vjp(tape.classifier, dlogits, grads)
        dy = conv_bn_vjp(tape.head, layers.gap_vjp(tape.gap, dy), grads)
        for t in reversed(tape.blocks):
            dy = layers.skip_block_vjp(t, dy, grads)
        conv_bn_vjp(tape.stem, dy, grads)  # the image's cotangent is not needed (XLA drops it)
        return {k: grads[k] for k in tape.names}

    def _layer(self, params, buffers, la: Layer, x, *, ctx, stats):
        return conv_bn_forward(params, buffers, ConvBN(la.conv, la.bn), x, stride=la.stride,
                               ctx=ctx, act=self.act if la.act else None,
                               depthwise=la.depthwise, stats=stats)

    def _block_forward(self, params, buffers, b: Block, x, *, ctx, stats, mask):
        y, tapes = x, []
        for i, la in enumerate(b.layers):
            if i == b.se_after and b.se_after:
                y, t = layers.squeeze_excite_forward(params, b.prefix + ".se", y, ctx=ctx,
                                                     act=self.act)
                tapes.append(t)
            y, t = self._layer(params, buffers, la, y, ctx=ctx, stats=stats)
            tapes.append(t)
        skip = None
        if b.skip:
            y, skip = layers.residual_forward(y, x, ctx=ctx, mask=mask)
        return y, (tapes, skip)


NETS = tuple(EfficientNet(name) for name in VARIANTS)
