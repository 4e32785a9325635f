"""MobileNetV4-Conv-M (timm ``mobilenetv4_conv_medium``): forward and explicit backward chain.

233 parameter tensors, 9,715,512 scalars at K = 1000; 77 convs, 77 BNs, no conv biases. Names,
order and shapes are timm's state_dict keys (OIHW convs, depthwise [C, 1, k, k],
``classifier.weight`` [K, 1280]). Activations are NHWC; the input is any multiple of 32.

    stem      conv_stem 3x3/2 3->32 -> bn1 -> ReLU
    blocks.0  fused IB (timm EdgeResidual): conv_exp 3x3/2 32->128 -> bn1 -> ReLU
              -> conv_pwl 1x1 128->48 -> bn2 (no skip: the width changes)
    blocks.1-3  the 21 universal inverted bottlenecks of `UIB_ROWS` (18 rows, two repeated):
              [dw_start a x a -> BN]  (no activation)
              pw_exp 1x1 -> BN -> ReLU
              [dw_mid k x k /s -> BN -> ReLU]
              pw_proj 1x1 -> BN  [-> drop-path] (+ x iff stride 1 and in = out)
    blocks.4  conv 1x1 256->960 -> bn1 -> ReLU
    head      global average pool -> conv_head 1x1 960->1280 (no bias) -> norm_head -> ReLU
              [-> dropout] -> classifier 1280 -> K

Every conv is followed by a BN, so every layer is one `conv_bn_forward`; a block is a chain of
them plus an optional identity skip. norm_head normalises [N, 1, 1, 1280]: over the batch only.

In train mode some gradients are exactly zero: every ``dw_start.bn.bias`` and the last UIB's
``pw_proj.bn.bias`` feed a 1x1 conv into a BN, which removes any per-channel constant (at a
32-pixel input stage 3 runs on a 1x1 grid, and every stage-3 ``pw_proj.bn.bias`` joins them
unless a drop-path mask differs across the batch). Any two implementations return rounding noise
there: compare those tensors against zero, not norm-relative to each other.
"""

from __future__ import annotations

from typing import NamedTuple

from twinstep.nets import layers
from twinstep.nets.layers import ConvBN, Ctx, conv_bn_forward, conv_bn_vjp
from twinstep.ops import dense, elementwise

NAME = "mnv4"
TIMM_NAME = "mobilenetv4_conv_medium"
INPUT_MULTIPLE = 32
STEM_WIDTH = 32
HEAD_WIDTH = 960
FEATURES = 1280
MASKS = ("drop_path", "dropout")  # the keyword masks `forward` takes
TRAIN_RES = 256  # timm's mobilenetv4_conv_medium.e500_r256_in1k recipe
DROP_PATH_RATE = 0.075  # that recipe's stochastic depth
LINEAR_INIT = "fan_out"  # the classifier as timm's _init_weight_goog starts it (layers.py)

# timm's arch_def for 'medium', stages 1-3: one row per arch string
# ``uir_r{r}_a{a}_k{k}_s{s}_e{e}_c{c}`` (r repeats; a, k the start / middle depthwise kernels,
# 0 = absent; s the stride of the row's first block; e the expansion; c the output width).
#   stage  r  a  k  s  e    c     kind
UIB_ROWS = (
    (1, 1, 3, 5, 2, 4, 80),   # ExtraDW
    (1, 1, 3, 3, 1, 2, 80),   # ExtraDW
    (2, 1, 3, 5, 2, 6, 160),  # ExtraDW
    (2, 2, 3, 3, 1, 4, 160),  # ExtraDW
    (2, 1, 3, 5, 1, 4, 160),  # ExtraDW
    (2, 1, 3, 3, 1, 4, 160),  # ExtraDW
    (2, 1, 3, 0, 1, 4, 160),  # ConvNeXt-like
    (2, 1, 0, 0, 1, 2, 160),  # FFN
    (2, 1, 3, 0, 1, 4, 160),  # ConvNeXt-like
    (3, 1, 5, 5, 2, 6, 256),  # ExtraDW
    (3, 1, 5, 5, 1, 4, 256),  # ExtraDW
    (3, 2, 3, 5, 1, 4, 256),  # ExtraDW
    (3, 1, 0, 0, 1, 4, 256),  # FFN
    (3, 1, 3, 0, 1, 4, 256),  # ConvNeXt-like
    (3, 1, 3, 5, 1, 2, 256),  # ExtraDW
    (3, 1, 5, 5, 1, 4, 256),  # ExtraDW
    (3, 2, 0, 0, 1, 4, 256),  # FFN
    (3, 1, 5, 0, 1, 2, 256),  # ConvNeXt-like
)
FUSED = (3, 2, 4, 48)  # blocks.0: er_k3_s2_e4_c48 (kernel, stride, expansion, width)


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
    index: int  # timm's global block index, 0..22: the drop-path ramp runs over it
    layers: tuple
    skip: bool  # identity skip (and drop-path site): stride 1 and in = out


STEM = Layer("conv_stem", "bn1", 3, STEM_WIDTH, 3, 2)
HEAD = Layer("conv_head", "norm_head", HEAD_WIDTH, FEATURES, 1)


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


def blocks() -> list[Block]:
    """The 23 blocks of ``model.blocks`` in order: the fused IB, the 21 UIBs, the 1x1 conv."""
    k, s, e, width = FUSED
    p = "blocks.0.0"
    out = [Block(p, 0, (Layer(f"{p}.conv_exp", f"{p}.bn1", STEM_WIDTH, STEM_WIDTH * e, k, s),
                        Layer(f"{p}.conv_pwl", f"{p}.bn2", STEM_WIDTH * e, width, 1,
                              relu=False)), False)]
    cin, stage, j = width, 0, 0
    for row_stage, r, a, kk, s, e, c in UIB_ROWS:
        for _ in range(r):
            j = j + 1 if row_stage == stage else 0
            stage = row_stage
            stride = s if j == 0 else 1  # timm: only a stage's first block strides
            p = f"blocks.{stage}.{j}"
            out.append(Block(p, len(out), _uib(p, cin, c, e=e, a=a, k=kk, s=stride),
                             stride == 1 and cin == c))
            cin = c
    p = f"blocks.{stage + 1}.0"
    out.append(Block(p, len(out), (Layer(f"{p}.conv", f"{p}.bn1", cin, HEAD_WIDTH, 1),), False))
    return out


# Drop-path (stochastic depth) acts on the residual branch of these 18 blocks, in this order.
DROP_PATH_SITES = tuple(b.prefix for b in blocks() if b.skip)


def drop_path_rates(rate: float) -> tuple:
    """timm's ramp: block i of all 23 gets rate * i / 23; only the skip blocks use theirs."""
    bs = blocks()
    return tuple(rate * b.index / len(bs) for b in bs if b.skip)


def _layers() -> list[Layer]:
    return [STEM, *(la for b in blocks() for la in b.layers), HEAD]


def param_shapes(num_classes: int = 1000) -> dict:
    """{timm name: shape}, in timm's ``named_parameters()`` order."""
    shapes = {}
    for la in _layers():
        shapes[la.conv + ".weight"] = (la.cout, 1 if la.depthwise else la.cin, la.k, la.k)
        shapes[la.bn + ".weight"] = shapes[la.bn + ".bias"] = (la.cout,)
    shapes["classifier.weight"] = (num_classes, FEATURES)
    shapes["classifier.bias"] = (num_classes,)
    return shapes


def branch_end_bns() -> tuple:
    """The last BN of each residual branch: pw_proj.bn of the 18 identity-skip blocks."""
    return tuple(b.layers[-1].bn for b in blocks() if b.skip)


def zero_init_bns() -> tuple:
    """timm's MobileNetV4 init (``_init_weight_goog``) sets every BN gamma to 1: none zeroed."""
    return ()


class Tape(NamedTuple):
    names: tuple
    stem: object
    blocks: list
    gap: tuple
    head: object
    dropout: object
    classifier: tuple


def forward(params: dict, buffers: dict, x, ctx: Ctx, *, drop_path=None, dropout=None):
    """x [N, H, W, 3] -> (logits [N, K], tape, stats {bn: BNStats} — empty in eval mode).

    drop_path: None, or per-example masks [18, N] (already scaled by 1 / keep) for the residual
    branches of `DROP_PATH_SITES`; dropout: None, or a per-element mask [N, 1280] (scaled) on
    the classifier's input."""
    stats = {}
    y, stem = _layer_forward(params, buffers, STEM, x.astype(ctx.precision.dtype), ctx=ctx,
                             stats=stats)
    tapes, site = [], 0
    for b in blocks():
        mask = None
        if b.skip:
            mask = None if drop_path is None else drop_path[site]
            site += 1
        y, t = _block_forward(params, buffers, b, y, ctx=ctx, stats=stats, mask=mask)
        tapes.append(t)
    y, gap = layers.gap_forward(y, ctx=ctx)
    # conv_head acts on the pooled [N, 1, 1, 960]: its BN sees one row per example.
    y, head = _layer_forward(params, buffers, HEAD, y[:, None, None, :], ctx=ctx, stats=stats)
    y, m = y[:, 0, 0, :], None
    if dropout is not None:
        y, m = elementwise.mask_forward(y, dropout)
    logits, fc = dense.dense_forward(y, params["classifier.weight"], params["classifier.bias"])
    return logits, Tape(tuple(params), stem, tapes, gap, head, m, fc), stats


def backward(tape: Tape, dlogits) -> dict:
    """The explicit chain from d logits [N, K] to all 233 parameter gradients (timm order)."""
    grads = {}
    dy, grads["classifier.weight"], grads["classifier.bias"] = dense.dense_vjp(tape.classifier,
                                                                               dlogits)
    if tape.dropout is not None:
        dy = elementwise.mask_vjp(tape.dropout, dy)
    dy = conv_bn_vjp(tape.head, dy[:, None, None, :], grads)[:, 0, 0, :]
    dy = layers.gap_vjp(tape.gap, dy)
    for t in reversed(tape.blocks):
        dy = _block_vjp(t, dy, grads)
    conv_bn_vjp(tape.stem, dy, grads)  # the image's cotangent is not needed (XLA drops it)
    return {k: grads[k] for k in tape.names}


def _layer_forward(params, buffers, la: Layer, x, *, ctx, stats):
    return conv_bn_forward(params, buffers, ConvBN(la.conv, la.bn), x, stride=la.stride, ctx=ctx,
                           relu=la.relu, depthwise=la.depthwise, stats=stats)


def _block_forward(params, buffers, b: Block, x, *, ctx, stats, mask):
    y, tapes = x, []
    for la in b.layers:
        y, t = _layer_forward(params, buffers, la, y, ctx=ctx, stats=stats)
        tapes.append(t)
    skip = None
    if b.skip:
        y, skip = layers.residual_forward(y, x, ctx=ctx, mask=mask)
    return y, (tapes, skip)


def _block_vjp(tape, dy, grads):
    tapes, skip = tape
    d_shortcut = None
    if skip is not None:
        dy, d_shortcut = layers.residual_vjp(skip, dy)
    for t in reversed(tapes):
        dy = conv_bn_vjp(t, dy, grads)
    return dy if skip is None else layers.fork_vjp(skip, dy, d_shortcut)
