"""MobileNetV4-Conv-M against its two oracles, in float64: ``jax.grad`` of the same forward
(the explicit chain, every parameter) and timm's ``mobilenetv4_conv_medium`` in PyTorch (names,
shapes, logits in train and eval mode, all 233 gradients, running buffers, drop-path and dropout
masks, f32), plus two wrong nets that the timm parity must catch; and every table of the family
(Conv-S, -M, -L) against timm's modules, and Conv-S's and -L's parity.

Compile time dominates (the shift-path depthwise VJPs make ~1,600 XLA:CPU kernels per step), so
each input shape is compiled ONCE, as one function returning everything the tests compare, with
LLVM at -O0 and XLA:CPU's legacy loop emitters (same f64 numerics; measured: compile ~7 s instead
of ~30 s per chain at 64 px, run ~3 s instead of ~1.2 s).

Structurally zero gradients. In train mode a BN's beta that reaches the loss only through a
1x1 conv into another train-mode BN has gradient exactly 0: the next BN removes any per-channel
constant. That is every ``dw_start.bn.bias`` (dw_start -> pw_exp 1x1 -> BN), the last UIB's
``pw_proj.bn.bias`` (-> blocks.4.0.conv 1x1 -> BN), and, when stage 3 runs on a 1x1 grid (input
32), every stage-3 ``pw_proj.bn.bias`` (on a 1x1 grid a depthwise conv is a per-channel scale)
— less those whose drop-path mask differs across the batch.
Both chains compute rounding noise there, so those tensors are held to zero (relative to their
BN's d gamma), not compared norm-relative to each other's noise.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle_libs import timm, torch
from timm_handover import masked_timm

from twinstep.checking import parity
from twinstep.dp import compiler_options
from twinstep.nets import NETS, layers, mobilenetv4
from twinstep.ops import loss
from twinstep.ops.precision import F32, F64

K = 10
BCE_SMOOTHING = 0.1  # timm's BinaryCrossEntropy default
TOL_CHAIN = 1e-10  # explicit chain vs jax.grad, norm-relative per tensor
TOL_ZERO = 1e-10  # a structurally zero gradient, relative to its BN's d gamma
TOL_LOGITS, TOL_GRAD, TOL_BUF = 1e-9, 1e-8, 1e-9  # vs timm, f64
TOL_LOGITS_F32 = 1e-4
CONTROL_MIN_ERR = 1e-3
LOSSES = ("ce", "bce")
# (res, batch, masked): every input size and batch of the brief; drop-path and dropout masks on
# two of them, so both the masked and the mask-free chains are checked against jax.grad.
SHAPES = ((32, 2, False), (64, 4, False), (32, 4, True), (64, 2, True))
SHAPES_IDS = [f"{r}px-n{n}{'-masked' if m else ''}" for r, n, m in SHAPES]
# `make test` compiles two of them against timm, one without masks and one with, and the masked
# one against jax.grad (the mask-free chain at 64 px is held to torch autograd by the parity
# test); test-all: all four, both ways
IN_MAKE_TEST = ((64, 4, False), (32, 4, True))
CHAIN_IN_MAKE_TEST = ((32, 4, True),)


def shape_params(in_make_test) -> list:
    """One param per shape; a shape's tests share one worker (xdist group), where `_compiled`
    keeps its program: compiled once, not once on each worker."""
    return [pytest.param(s, id=i, marks=(pytest.mark.xdist_group(f"mnv4-{i}"),
                                         *(() if s in in_make_test else (pytest.mark.all,))))
            for s, i in zip(SHAPES, SHAPES_IDS, strict=True)]


SHAPE_PARAMS = shape_params(IN_MAKE_TEST)
# 32 px at batch 2, train mode: stage 3 runs on a 1x1 grid, so its BNs (and blocks.4.0's and
# norm_head) see 2 rows per channel, many with variance << eps (the two examples nearly equal).
# Such a BN divides x - mu by ~sqrt(eps): it amplifies its input's relative rounding by
# |x| / |x - mu|, layer after layer. Measured: moving timm's input by 1e-15 (relative) moves its
# own logits by 5e-10 and its gradients by 2e-6 (ours vs timm: 4e-9 and 1.3e-5), so 1e-9 / 1e-8
# against timm, whose rounding differs from XLA's, is out of reach there. The chain vs jax.grad
# shares the forward's rounding and still holds 1e-10; eval mode and the buffers keep theirs.
ILL_CONDITIONED = (32, 2, False)

net = NETS["mnv4"]
SHAPES_K = net.param_shapes(K)
TRAIN, EVAL = layers.Ctx(precision=F64), layers.Ctx(precision=F64, train=False)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def logit_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))


def structurally_zero(res: int, drop_path) -> set:
    """The train-mode gradients that are exactly 0 (module docstring). A drop-path mask that
    differs across the batch scales the branch per example, which no BN removes: that block's
    pw_proj beta is then not among them."""
    zero = {k for k in SHAPES_K if k.endswith("dw_start.bn.bias")}
    uibs = [b for b in net.blocks() if any(".pw_proj." in la.conv for la in b.layers)]
    on_1x1 = res // net.INPUT_MULTIPLE == 1
    for b in uibs:
        mask = None
        if drop_path is not None and b.skip:
            mask = drop_path[net.DROP_PATH_SITES.index(b.prefix)]
        if (b is uibs[-1] or on_1x1 and b.prefix.startswith("blocks.3.")) and (
                mask is None or np.all(mask == mask[0])):
            zero.add(f"{b.prefix}.pw_proj.bn.bias")
    return zero


# ------------------------------------------------------------------------------ the fixtures


@functools.cache
def weights():
    """Random parameters and BN state (numpy: no per-shape jax.random compiles). Convs He normal
    (timm's fan-out), BN gamma U(0.5, 1.5), beta N(0, 0.2), running mean N(0, 0.2), running var
    U(0.5, 2): BNs that are not the identity, so a swapped layer cannot hide."""
    rng = np.random.default_rng(4)
    params = {}
    for name, shape in SHAPES_K.items():
        if len(shape) == 4:
            groups = shape[0] if shape[1] == 1 else 1
            params[name] = rng.standard_normal(shape) * np.sqrt(2 * groups / (
                shape[0] * shape[2] * shape[3]))
        elif name.startswith("classifier"):
            params[name] = rng.uniform(-1, 1, shape) / np.sqrt(net.FEATURES)
        elif name.endswith(".weight"):
            params[name] = rng.uniform(0.5, 1.5, shape)
        else:
            params[name] = 0.2 * rng.standard_normal(shape)
    buffers = {}
    for name, shape in layers.buffer_shapes(SHAPES_K).items():
        buffers[name] = (0.2 * rng.standard_normal(shape) if name.endswith("mean")
                         else rng.uniform(0.5, 2.0, shape))
    return params, buffers


@functools.cache
def batch(res: int, n: int, masked: bool):
    """(x [n, res, res, 3], labels [n], drop-path masks [18, n] | None, dropout [n, 1280] | None);
    masks scaled by 1 / keep, with some zeros in each."""
    rng = np.random.default_rng(res * 10 + n)
    x = rng.standard_normal((n, res, res, 3))
    labels = rng.integers(0, K, n)
    if not masked:
        return x, labels, None, None
    keep_dp, keep_do = 0.75, 0.8
    drop_path = (rng.uniform(size=(len(net.DROP_PATH_SITES), n)) < keep_dp) / keep_dp
    drop_path[:, 0] = 1 / keep_dp
    drop_path[0, 1] = drop_path[5, 0] = 0.0
    dropout = (rng.uniform(size=(n, net.FEATURES)) < keep_do) / keep_do
    return x, labels, drop_path, dropout


def _step(p, b, x, t, w, drop_path, dropout):
    """One train step and one eval forward. The loss is w[0] CE + w[1] BCE, with w = (1, 0) or
    (0, 1) (exact selections): one compiled function serves both losses. Returns logits (train),
    logits (eval), explicit gradients, jax.grad's gradients, the updated running buffers."""
    bce_t = loss.bce_targets(t, BCE_SMOOTHING)

    def objective(z):
        return w[0] * loss.smoothed_ce(z, t)[0] + w[1] * loss.bce(z, bce_t)[0]

    logits, tape, stats = net.forward(p, b, x, TRAIN, drop_path=drop_path, dropout=dropout)
    dz = w[0] * loss.smoothed_ce(logits, t)[1] + w[1] * loss.bce(logits, bce_t)[1]
    grads = net.backward(tape, dz)
    reference = jax.grad(lambda q: objective(net.forward(q, b, x, TRAIN, drop_path=drop_path,
                                                         dropout=dropout)[0]))(p)
    eval_logits = net.forward(p, b, x, EVAL)[0]
    return logits, eval_logits, grads, reference, layers.update_running(b, stats)


@functools.cache
def ours(res: int, n: int, masked: bool, kind: str):
    return _compiled(res, n, masked)(*_args(res, n, masked, kind))


def _args(res, n, masked, kind):
    params, buffers = weights()
    x, labels, drop_path, dropout = batch(res, n, masked)
    w = jnp.asarray([1.0, 0.0] if kind == "ce" else [0.0, 1.0])
    return params, buffers, x, np.eye(K)[labels], w, drop_path, dropout


def _fast() -> dict | None:
    """XLA at -O0 (`dp.FAST_COMPILE`, the same numerics)."""
    return compiler_options(fast_compile=True)


@functools.cache
def _compiled(res, n, masked):
    return jax.jit(_step).lower(*_args(res, n, masked, "ce")).compile(_fast())


def timm_model(params, buffers, dtype: str = "float64", drop_path=None, dropout=None):
    """timm's model with our weights; our masks in place of its DropPath and classifier
    dropout (`timm_handover.masked_timm`)."""
    return masked_timm(net, params, buffers, K, drop_path, dropout, dtype)


@functools.cache
def theirs(res: int, n: int, masked: bool, kind: str, perturb: float = 0.0):
    """timm, float64: (train logits, eval logits, gradients, running buffers after the step);
    ``perturb``: the input moved by that much, relative, at random (timm's own sensitivity)."""
    params, buffers = weights()
    x, labels, drop_path, dropout = batch(res, n, masked)
    x = x * (1 + perturb * np.random.default_rng(1).standard_normal(x.shape))
    model = timm_model(params, buffers, drop_path=drop_path, dropout=dropout)
    criterion = (timm.loss.LabelSmoothingCrossEntropy(loss.LABEL_SMOOTHING) if kind == "ce"
                 else timm.loss.BinaryCrossEntropy(smoothing=BCE_SMOOTHING))
    tx = torch.tensor(x.transpose(0, 3, 1, 2))
    model.eval()  # first: the train forward below moves the running statistics
    with torch.no_grad():
        ez = model(tx).numpy()
    model.train()
    z = model(tx)
    criterion(z, torch.tensor(labels)).backward()
    grads = {k: v.grad.numpy() for k, v in model.named_parameters()}
    bufs = {k: v.numpy().copy() for k, v in model.named_buffers() if "running" in k}
    return z.detach().numpy(), ez, grads, bufs


def check_grads(grads, reference, res, drop_path, tol):
    """Per tensor: norm-relative <= tol, or, where the gradient is structurally zero, both
    sides zero to rounding. Returns the worst error of each kind."""
    zero = structurally_zero(res, drop_path)
    errs = {k: rel(grads[k], reference[k]) for k in SHAPES_K if k not in zero}
    bad = {k: e for k, e in errs.items() if not e <= tol}
    worst = sorted(bad.items(), key=lambda kv: -kv[1])[:5]
    assert not bad, f"{len(bad)} tensors over {tol}: {worst}"
    zeros = {k: max(np.linalg.norm(grads[k]), np.linalg.norm(reference[k]))
             / np.linalg.norm(reference[k[:-len("bias")] + "weight"]) for k in zero}
    bad = {k: e for k, e in zeros.items() if not e <= TOL_ZERO}
    assert not bad, f"structurally zero gradients that are not: {bad}"
    return max(errs.values()), max(zeros.values())


# ------------------------------------------------------------------------ names and schedule


# per table: parameter tensors, scalars at K = 1000, 1-D tensors, BNs, blocks, ExtraDW blocks,
# drop-path sites (timm 1.0.31's counts)
FAMILY_COUNTS = {"mnv4s": (140, 3_774_024, 93, 46, 17, 3, 10),
                 "mnv4": (233, 9_715_512, 155, 77, 23, 13, 18),
                 "mnv4l": (308, 32_590_864, 205, 102, 28, 19, 23)}
FAMILY = [pytest.param(NETS[n], id=n) for n in mobilenetv4.VARIANTS]


def test_the_family_is_its_tables():
    assert set(FAMILY_COUNTS) == set(mobilenetv4.VARIANTS)
    for name, (tensors, scalars, one_d, bns, blocks, extra_dw, sites) in FAMILY_COUNTS.items():
        table = NETS[name]
        full = table.param_shapes()
        assert (len(full), sum(int(np.prod(s)) for s in full.values()),
                sum(len(s) == 1 for s in full.values()), len(layers.bn_names(full))) == (
                    tensors, scalars, one_d, bns), name
        assert (len(table.blocks()), sum(len(b.layers) == 4 for b in table.blocks()),
                len(table.DROP_PATH_SITES)) == (blocks, extra_dw, sites), name


@pytest.mark.oracle
@pytest.mark.parametrize("table", FAMILY)
def test_param_and_buffer_names_match_timm(table):
    model = timm.create_model(table.TIMM_NAME, num_classes=K)
    shapes = table.param_shapes(K)
    theirs_ = [(k, tuple(v.shape)) for k, v in model.named_parameters()]
    assert list(shapes.items()) == theirs_
    running = [(k, tuple(v.shape)) for k, v in model.named_buffers() if "running" in k]
    assert list(layers.buffer_shapes(shapes).items()) == running
    assert len(running) == 2 * FAMILY_COUNTS[table.NAME][3]
    assert table.FEATURES == model.head_hidden_size
    assert mobilenetv4.HEAD_WIDTH == model.num_features


@pytest.mark.oracle
@pytest.mark.parametrize("table", FAMILY)
def test_blocks_table_matches_timm(table):
    """Every layer's kernel, stride, groups, activation and every block's skip, from timm's
    modules (the table decodes to what timm builds)."""
    model = timm.create_model(table.TIMM_NAME, num_classes=K)
    assert len(table.blocks()) == len([m for s in model.blocks for m in s])
    for b in table.blocks():
        block = model.get_submodule(b.prefix)
        assert getattr(block, "has_skip", False) == b.skip, b.prefix
        for la in b.layers:
            conv = model.get_submodule(la.conv)
            assert (conv.kernel_size, conv.stride, conv.padding, conv.groups, conv.bias) == (
                (la.k, la.k), (la.stride, la.stride), ((la.k - 1) // 2, (la.k - 1) // 2),
                la.cin if la.depthwise else 1, None), la.conv
            act = model.get_submodule(la.bn).act
            assert isinstance(act, torch.nn.ReLU if la.relu else torch.nn.Identity), la.bn
    assert model.conv_head.bias is None and isinstance(model.norm_head.act, torch.nn.ReLU)


@pytest.mark.oracle
@pytest.mark.parametrize("table", FAMILY)
def test_drop_path_sites_and_rates_match_timm(table):
    rate = 0.23
    model = timm.create_model(table.TIMM_NAME, num_classes=K, drop_path_rate=rate)
    sites = [f"blocks.{i}.{j}" for i, s in enumerate(model.blocks) for j, m in enumerate(s)
             if getattr(m, "has_skip", False)]
    assert list(table.DROP_PATH_SITES) == sites
    np.testing.assert_allclose(table.drop_path_rates(rate),
                               [model.get_submodule(s).drop_path.drop_prob for s in sites],
                               rtol=1e-15)


@pytest.mark.oracle
def test_init_convention_matches_timm():
    """timm's MobileNetV4 init leaves every BN gamma at 1 (no zero-init-last)."""

    model = timm.create_model(net.TIMM_NAME, num_classes=K)
    assert net.zero_init_bns() == ()
    assert all(bool(torch.all(model.get_submodule(bn).weight == 1))
               for bn in layers.bn_names(SHAPES_K))


# --------------------------------------------------------------- the explicit chain, jax.grad


@pytest.mark.slow
@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("shape", shape_params(CHAIN_IN_MAKE_TEST))
def test_explicit_chain_matches_jax_grad(shape, kind):
    res, n, masked = shape
    _, _, grads, reference, _ = ours(res, n, masked, kind)
    check_grads(grads, reference, res, batch(*shape)[2], TOL_CHAIN)


# -------------------------------------------------------------------------------- timm parity


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("shape", SHAPE_PARAMS)
@pytest.mark.oracle
@pytest.mark.slow
def test_timm_parity(shape, kind):
    """Train logits, eval logits, all 233 gradients and the 154 running buffers after one step;
    on the masked shapes with OUR drop-path and dropout masks inside timm. At the
    ill-conditioned shape the train-mode bounds are relative to timm's own sensitivity."""
    res, n, masked = shape
    logits, eval_logits, grads, _, new_buffers = ours(res, n, masked, kind)
    tz, tez, tgrads, tbufs = theirs(res, n, masked, kind)
    tol_logits, tol_grad = TOL_LOGITS, TOL_GRAD
    if shape == ILL_CONDITIONED:
        pz, _, pgrads, _ = theirs(res, n, masked, kind, perturb=1e-15)
        zero = structurally_zero(res, None)
        sensitivity = max(rel(pgrads[k], tgrads[k]) for k in SHAPES_K if k not in zero)
        assert sensitivity > 10 * TOL_GRAD  # the strict bound is out of any f64 code's reach
        tol_logits, tol_grad = 100 * logit_err(pz, tz), 100 * sensitivity
    assert logit_err(logits, tz) <= tol_logits
    assert logit_err(eval_logits, tez) <= TOL_LOGITS
    if masked:  # the masks reached both nets and change the step
        assert logit_err(tz, theirs(res, n, False, kind)[0]) > CONTROL_MIN_ERR
    check_grads(grads, tgrads, res, batch(*shape)[2], tol_grad)
    assert list(tbufs) == list(layers.buffer_shapes(SHAPES_K))
    assert max(rel(new_buffers[k], tbufs[k]) for k in tbufs) <= TOL_BUF


@pytest.mark.oracle
@pytest.mark.slow
def test_timm_parity_float32():
    res, n, masked = SHAPES[1]
    params, buffers = weights()
    x = batch(res, n, masked)[0]
    p32, b32 = ({k: v.astype(np.float32) for k, v in d.items()} for d in (params, buffers))

    @jax.jit
    def logits(p, b, x):
        return tuple(net.forward(p, b, x, layers.Ctx(precision=F32, train=t))[0]
                     for t in (True, False))

    z, ez = logits(p32, b32, x.astype(np.float32))
    assert z.dtype == jnp.float32
    model = timm_model(p32, b32, "float32")
    tx = torch.tensor(x.transpose(0, 3, 1, 2), dtype=torch.float32)
    with torch.no_grad():
        tez = model.eval()(tx).numpy()  # first: a train forward moves the running statistics
        tz = model.train()(tx).numpy()
    assert logit_err(z, tz) <= TOL_LOGITS_F32 and logit_err(ez, tez) <= TOL_LOGITS_F32


# ------------------------------------------------------------------------------- the controls


def _stride_on_start(uib):
    def variant(p, cin, cout, *, e, a, k, s):
        out = list(uib(p, cin, cout, e=e, a=a, k=k, s=s))
        if a and k and s > 1:
            out[0], out[2] = out[0]._replace(stride=s), out[2]._replace(stride=1)
        return tuple(out)
    return variant


def _act_after_start(uib):
    def variant(p, cin, cout, *, e, a, k, s):
        out = list(uib(p, cin, cout, e=e, a=a, k=k, s=s))
        if a:
            out[0] = out[0]._replace(relu=True)
        return tuple(out)
    return variant


@pytest.mark.parametrize("control", [_stride_on_start, _act_after_start],
                         ids=["stride-on-start-dw", "relu-after-start-dw"])
@pytest.mark.oracle
@pytest.mark.slow
def test_wrong_nets_fail_timm_parity(control, monkeypatch):
    """Two plausible misreadings of the UIB: the parity check must see each of them."""
    res, n, masked = SHAPES[1]
    params, buffers = weights()
    x = batch(res, n, masked)[0]
    monkeypatch.setattr(mobilenetv4, "_uib", control(mobilenetv4._uib))
    wrong = mobilenetv4.MobileNetV4("mnv4")
    assert wrong.param_shapes(K) == SHAPES_K  # same tensors: only the wiring differs
    z = jax.jit(lambda p, b, x: wrong.forward(p, b, x, TRAIN)[0], compiler_options=_fast())(
        params, buffers, x)
    assert logit_err(z, theirs(res, n, masked, "ce")[0]) > CONTROL_MIN_ERR


# ------------------------------------------------------------- the other tables against timm

# Conv-S (its cn blocks: a second table) in `make test`; Conv-L and the other shapes in test-all.
# Conv-L at 32², N = 4 is the worst conditioned: 28 blocks down to a 1 x 1 grid amplify f64's
# rounding to a gradient error of 2.2e-9 (its dw_start convs of stage 3), 3.4e-11 at 64², N = 2.
OTHER_PARITY = [pytest.param("mnv4s", 32, 4, "ce"),
                *(pytest.param(*c, marks=pytest.mark.all)
                  for c in (("mnv4s", 64, 2, "bce"), ("mnv4l", 32, 4, "ce"),
                            ("mnv4l", 64, 2, "bce")))]


@pytest.mark.parametrize("name,res,n,kind", OTHER_PARITY)
@pytest.mark.oracle
@pytest.mark.slow
def test_other_tables_match_timm(name, res, n, kind):
    """`twinstep parity` (f64): train and eval logits, every gradient, the running buffers."""
    table = NETS[name]
    r = parity.run_parity(table, res=res, batch=n, precision="f64", loss=kind, num_classes=K,
                          seed=1, fast_compile=True)
    assert len(r.grad_errs) == len(table.param_shapes(K))
    assert r.logits_train_err <= TOL_LOGITS and r.logits_eval_err <= TOL_LOGITS
    assert r.worst_grad[1] <= TOL_GRAD and r.buffer_err <= TOL_BUF and r.ok


@pytest.mark.oracle
@pytest.mark.slow
def test_a_misread_small_table_fails_timm_parity(monkeypatch):
    """Conv-S's cn blocks read as conv -> BN without the ReLU: same tensors, another net."""
    block_layers = mobilenetv4._block_layers

    def no_act_in_cn(kind, *args, **kw):
        out = block_layers(kind, *args, **kw)
        return tuple(la._replace(relu=False) for la in out) if kind == "cn" else out

    monkeypatch.setattr(mobilenetv4, "_block_layers", no_act_in_cn)
    wrong = mobilenetv4.MobileNetV4("mnv4s")
    assert wrong.param_shapes(K) == NETS["mnv4s"].param_shapes(K)
    r = parity.run_parity(wrong, res=32, batch=4, precision="f64", loss="ce", num_classes=K,
                          seed=1, fast_compile=True)
    assert not r.ok and r.logits_train_err > CONTROL_MIN_ERR
