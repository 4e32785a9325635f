"""MobileNetV4-Conv-S, -M and -L (timm ``mobilenetv4_conv_small/medium/large``): forward and
explicit backward chain, one `MobileNetV4` per row of `VARIANTS`, each timm's ``arch_def`` as a
table (docs/nets.md).

Names, order and shapes are timm's state_dict keys (OIHW convs, depthwise [C, 1, k, k],
``classifier.weight`` [K, 1280]); no conv has a bias. Activations are NHWC; the input is any
multiple of 32. The medium net, twinstep's ``mnv4``: 233 parameter tensors, 9,715,512 scalars
at K = 1000, 77 convs and BNs.

    stem      conv_stem 3x3/2 3->stem -> bn1 -> ReLU
    blocks    one block per row repeat, stage by stage, of these kinds:
      cn      conv k x k /s -> bn1 -> ReLU (timm ConvBnAct; no skip)
      er      fused IB (timm EdgeResidual): conv_exp k x k /s -> bn1 -> ReLU
              -> conv_pwl 1x1 -> bn2 (no skip here: every one changes the width)
      uir     universal inverted bottleneck:
              [dw_start a x a -> BN]  (no activation)
              pw_exp 1x1 -> BN -> ReLU
              [dw_mid k x k /s -> BN -> ReLU]
              pw_proj 1x1 -> BN  [-> drop-path] (+ x iff stride 1 and in = out)
    head      global average pool -> conv_head 1x1 960->1280 (no bias) -> norm_head -> ReLU
              [-> dropout] -> classifier 1280 -> K

Every conv is followed by a BN, so every layer is one `conv_bn_forward`; a block is a chain of
them plus an optional identity skip. norm_head normalises [N, 1, 1, 1280]: over the batch only.

In train mode some gradients are exactly zero: every ``dw_start.bn.bias`` and the last UIB's
``pw_proj.bn.bias`` feed a 1x1 conv into a BN, which removes any per-channel constant (at a
32-pixel input the last stage runs on a 1x1 grid, and every one of its ``pw_proj.bn.bias`` joins
them unless a drop-path mask differs across the batch). Any two implementations return rounding
noise there: compare those tensors against zero, not norm-relative to each other.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.nets import layers
from twinstep.nets.layers import ConvBN, Ctx, conv_bn_forward, conv_bn_vjp

HEAD_WIDTH = 960  # every table's last row: cn_r1_k1_s1_c960
FEATURES = 1280  # conv_head's width, the classifier's input

# timm's arch_def rows, one per string: ``cn_r{r}_k{k}_s{s}_c{c}``, ``er_r{r}_k{k}_s{s}_e{e}_c{c}``
# or ``uir_r{r}_a{a}_k{k}_s{s}_e{e}_c{c}`` (r repeats; a, k the start / middle depthwise kernels
# of a UIB, 0 = absent, else the conv's kernel; s the stride of the row's first block; e the
# expansion; c the output width). A UIB with both depthwise convs is an ExtraDW, one with only
# a the ConvNeXt-like, one with only k the IR, one with neither the FFN.
#   stage kind   r  a  k  s  e    c
SMALL = (
    (0, "cn", 1, 0, 3, 2, 1, 32),
    (0, "cn", 1, 0, 1, 1, 1, 32),
    (1, "cn", 1, 0, 3, 2, 1, 96),
    (1, "cn", 1, 0, 1, 1, 1, 64),
    (2, "uir", 1, 5, 5, 2, 3, 96),   # ExtraDW
    (2, "uir", 4, 0, 3, 1, 2, 96),   # IR
    (2, "uir", 1, 3, 0, 1, 4, 96),   # ConvNeXt-like
    (3, "uir", 1, 3, 3, 2, 6, 128),  # ExtraDW
    (3, "uir", 1, 5, 5, 1, 4, 128),  # ExtraDW
    (3, "uir", 1, 0, 5, 1, 4, 128),  # IR
    (3, "uir", 1, 0, 5, 1, 3, 128),  # IR
    (3, "uir", 2, 0, 3, 1, 4, 128),  # IR
    (4, "cn", 1, 0, 1, 1, 1, HEAD_WIDTH),
)
MEDIUM = (
    (0, "er", 1, 0, 3, 2, 4, 48),
    (1, "uir", 1, 3, 5, 2, 4, 80),   # ExtraDW
    (1, "uir", 1, 3, 3, 1, 2, 80),   # ExtraDW
    (2, "uir", 1, 3, 5, 2, 6, 160),  # ExtraDW
    (2, "uir", 2, 3, 3, 1, 4, 160),  # ExtraDW
    (2, "uir", 1, 3, 5, 1, 4, 160),  # ExtraDW
    (2, "uir", 1, 3, 3, 1, 4, 160),  # ExtraDW
    (2, "uir", 1, 3, 0, 1, 4, 160),  # ConvNeXt-like
    (2, "uir", 1, 0, 0, 1, 2, 160),  # FFN
    (2, "uir", 1, 3, 0, 1, 4, 160),  # ConvNeXt-like
    (3, "uir", 1, 5, 5, 2, 6, 256),  # ExtraDW
    (3, "uir", 1, 5, 5, 1, 4, 256),  # ExtraDW
    (3, "uir", 2, 3, 5, 1, 4, 256),  # ExtraDW
    (3, "uir", 1, 0, 0, 1, 4, 256),  # FFN
    (3, "uir", 1, 3, 0, 1, 4, 256),  # ConvNeXt-like
    (3, "uir", 1, 3, 5, 1, 2, 256),  # ExtraDW
    (3, "uir", 1, 5, 5, 1, 4, 256),  # ExtraDW
    (3, "uir", 2, 0, 0, 1, 4, 256),  # FFN
    (3, "uir", 1, 5, 0, 1, 2, 256),  # ConvNeXt-like
    (4, "cn", 1, 0, 1, 1, 1, HEAD_WIDTH),
)
LARGE = (
    (0, "er", 1, 0, 3, 2, 4, 48),
    (1, "uir", 1, 3, 5, 2, 4, 96),   # ExtraDW
    (1, "uir", 1, 3, 3, 1, 4, 96),   # ExtraDW
    (2, "uir", 1, 3, 5, 2, 4, 192),  # ExtraDW
    (2, "uir", 3, 3, 3, 1, 4, 192),  # ExtraDW
    (2, "uir", 1, 3, 5, 1, 4, 192),  # ExtraDW
    (2, "uir", 5, 5, 3, 1, 4, 192),  # ExtraDW
    (2, "uir", 1, 3, 0, 1, 4, 192),  # ConvNeXt-like
    (3, "uir", 4, 5, 5, 2, 4, 512),  # ExtraDW
    (3, "uir", 1, 5, 0, 1, 4, 512),  # ConvNeXt-like
    (3, "uir", 1, 5, 3, 1, 4, 512),  # ExtraDW
    (3, "uir", 2, 5, 0, 1, 4, 512),  # ConvNeXt-like
    (3, "uir", 1, 5, 3, 1, 4, 512),  # ExtraDW
    (3, "uir", 1, 5, 5, 1, 4, 512),  # ExtraDW
    (3, "uir", 3, 5, 0, 1, 4, 512),  # ConvNeXt-like
    (4, "cn", 1, 0, 1, 1, 1, HEAD_WIDTH),
)


class Variant(NamedTuple):
    timm_name: str
    stem: int  # conv_stem's width
    rows: tuple  # the arch_def table
    train_res: int  # timm's training resolution for its published weights


# twinstep's name -> its row. The stochastic depth of a recipe with 'drop' is the medium
# recipe's (0.075) for all three: timm publishes no other.
VARIANTS = {
    "mnv4s": Variant("mobilenetv4_conv_small", 32, SMALL, 224),  # e2400_r224_in1k
    "mnv4": Variant("mobilenetv4_conv_medium", 32, MEDIUM, 256),  # e500_r256_in1k
    "mnv4l": Variant("mobilenetv4_conv_large", 24, LARGE, 384),  # e600_r384_in1k
}


class Layer(NamedTuple):
    """conv (k x k, stride) -> BN [-> ReLU], addressed by timm's prefixes."""

    conv: str
    bn: str
    cin: int
    cout: int
    k: int
    stride: int = 1
    relu: bool = True
    depthwise: bool = False


class Block(NamedTuple):
    prefix: str
    index: int  # timm's global block index: the drop-path ramp runs over it
    layers: tuple
    skip: bool  # identity skip (and drop-path site): stride 1 and in = out


def _uib(p: str, cin: int, cout: int, *, e: int, a: int, k: int, s: int) -> tuple:
    """The layers of one universal inverted bottleneck. timm puts the stride on the middle
    depthwise, on the start one only when there is no middle one."""
    mid = cin * e  # every width here is a multiple of 8: timm's make_divisible is the identity
    out = []
    if a:
        out.append(Layer(f"{p}.dw_start.conv", f"{p}.dw_start.bn", cin, cin, a, 1 if k else s,
                         relu=False, depthwise=True))
    out.append(Layer(f"{p}.pw_exp.conv", f"{p}.pw_exp.bn", cin, mid, 1))
    if k:
        out.append(Layer(f"{p}.dw_mid.conv", f"{p}.dw_mid.bn", mid, mid, k, s, depthwise=True))
    out.append(Layer(f"{p}.pw_proj.conv", f"{p}.pw_proj.bn", mid, cout, 1, relu=False))
    return tuple(out)


def _block_layers(kind: str, p: str, cin: int, cout: int, *, a, k, s, e) -> tuple:
    """The layers of one block of a row of kind ``kind`` (cn, er or uir)."""
    if kind == "cn":
        return (Layer(f"{p}.conv", f"{p}.bn1", cin, cout, k, s),)
    if kind == "er":
        return (Layer(f"{p}.conv_exp", f"{p}.bn1", cin, cin * e, k, s),
                Layer(f"{p}.conv_pwl", f"{p}.bn2", cin * e, cout, 1, relu=False))
    return _uib(p, cin, cout, e=e, a=a, k=k, s=s)


class Tape(NamedTuple):
    names: tuple
    stem: object
    blocks: list
    gap: tuple
    head: object
    classifier: tuple


class MobileNetV4:
    """One row of `VARIANTS` as a `twinstep.nets.Net`."""

    INPUT_MULTIPLE = 32
    FEATURES = FEATURES
    MASKS = ("drop_path", "dropout")  # the keyword masks `forward` takes
    DROP_PATH_RATE = 0.075  # the medium recipe's stochastic depth
    LINEAR_INIT = "fan_out"  # the classifier as timm's _init_weight_goog starts it (init.py)

    def __init__(self, name: str):
        self.NAME = name
        self.TIMM_NAME, self.stem_width, self.rows, self.TRAIN_RES = VARIANTS[name]
        self.stem = Layer("conv_stem", "bn1", 3, self.stem_width, 3, 2)
        self.head = Layer("conv_head", "norm_head", HEAD_WIDTH, FEATURES, 1)
        self._blocks = self._table_blocks()
        # drop-path (stochastic depth) acts on the residual branch of the skip blocks, in order
        self.DROP_PATH_SITES = tuple(b.prefix for b in self._blocks if b.skip)

    def __repr__(self) -> str:
        return f"MobileNetV4({self.NAME!r})"

    def _table_blocks(self) -> tuple:
        out, cin, stage, j = [], self.stem_width, -1, 0
        for row_stage, kind, r, a, k, s, e, c in self.rows:
            for _ in range(r):
                j = j + 1 if row_stage == stage else 0
                stage = row_stage
                stride = s if j == 0 else 1  # timm: only a stage's first block strides
                p = f"blocks.{stage}.{j}"
                out.append(Block(p, len(out), _block_layers(kind, p, cin, c, a=a, k=k,
                                                             s=stride, e=e),
                                 kind == "uir" and stride == 1 and cin == c))
                cin = c
        return tuple(out)

    def blocks(self) -> tuple:
        """The blocks of ``model.blocks`` in order."""
        return self._blocks

    def drop_path_rates(self, rate: float) -> tuple:
        """timm's ramp: block i of all n gets rate * i / n; only the skip blocks use theirs."""
        n = len(self._blocks)
        return tuple(rate * b.index / n for b in self._blocks if b.skip)

    def _layers(self) -> list:
        return [self.stem, *(la for b in self._blocks for la in b.layers), self.head]

    def param_shapes(self, num_classes: int = 1000) -> dict:
        """{timm name: shape}, in timm's ``named_parameters()`` order."""
        shapes = {}
        for la in self._layers():
            shapes[la.conv + ".weight"] = (la.cout, 1 if la.depthwise else la.cin, la.k, la.k)
            shapes[la.bn + ".weight"] = shapes[la.bn + ".bias"] = (la.cout,)
        shapes["classifier.weight"] = (num_classes, FEATURES)
        shapes["classifier.bias"] = (num_classes,)
        return shapes

    def branch_end_bns(self) -> tuple:
        """The last BN of each residual branch: pw_proj.bn of the identity-skip blocks."""
        return tuple(b.layers[-1].bn for b in self._blocks if b.skip)

    def zero_init_bns(self) -> tuple:
        """timm's MobileNetV4 init (``_init_weight_goog``) sets every BN gamma to 1: none."""
        return ()

    def forward(self, params: dict, buffers: dict, x, ctx: Ctx, *, drop_path=None,
                dropout=None):
        """x [N, H, W, 3] -> (logits [N, K], tape, stats {bn: BNStats} — empty in eval mode).

        drop_path: None, or per-example masks [len(DROP_PATH_SITES), N] (already scaled by
        1 / keep) for the residual branches of `DROP_PATH_SITES`; dropout: None, or a
        per-element mask [N, 1280] (scaled) on the classifier's input."""
        stats = {}
        y, stem = _layer_forward(params, buffers, self.stem, x.astype(ctx.precision.dtype),
                                 ctx=ctx, stats=stats)
        tapes = []
        for b, mask in zip(self._blocks, layers.block_masks([b.skip for b in self._blocks],
                                                            drop_path), strict=True):
            y, t = _block_forward(params, buffers, b, y, ctx=ctx, stats=stats, mask=mask)
            tapes.append(t)
        y, gap = layers.gap_forward(y, ctx=ctx)
        # conv_head acts on the pooled [N, 1, 1, 960]: its BN sees one row per example.
        y, head = _layer_forward(params, buffers, self.head, y[:, None, None, :], ctx=ctx,
                                 stats=stats)
        logits, classifier = layers.classifier_forward(params, "classifier", y[:, 0, 0, :],
                                                       dropout)
        return logits, Tape(tuple(params), stem, tapes, gap, head, classifier), stats

    def backward(self, tape: Tape, dlogits) -> dict:
        """The explicit chain from d logits [N, K] to every parameter gradient (timm order)."""
        grads = {}
        dy = layers.classifier_vjp(tape.classifier, dlogits, grads)
        dy = conv_bn_vjp(tape.head, dy[:, None, None, :], grads)[:, 0, 0, :]
        dy = layers.gap_vjp(tape.gap, dy)
        for t in reversed(tape.blocks):
            dy = layers.skip_block_vjp(t, dy, grads)
        conv_bn_vjp(tape.stem, dy, grads)  # the image's cotangent is not needed (XLA drops it)
        return {k: grads[k] for k in tape.names}


def _layer_forward(params, buffers, la: Layer, x, *, ctx, stats):
    return conv_bn_forward(params, buffers, ConvBN(la.conv, la.bn), x, stride=la.stride, ctx=ctx,
                           act="relu" if la.relu else None, depthwise=la.depthwise, stats=stats)


def _block_forward(params, buffers, b: Block, x, *, ctx, stats, mask):
    y, tapes = x, []
    for la in b.layers:
        y, t = _layer_forward(params, buffers, la, y, ctx=ctx, stats=stats)
        tapes.append(t)
    skip = None
    if b.skip:
        y, skip = layers.residual_forward(y, x, ctx=ctx, mask=mask)
    return y, (tapes, skip)


NETS = tuple(MobileNetV4(name) for name in VARIANTS)
