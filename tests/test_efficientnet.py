"""MobileNetV2 and EfficientNet-B0 (`twinstep.nets.efficientnet`, one block library as timm's):
timm's names, shapes, blocks, drop-path sites and init for both rows; the explicit chain with
drop-path and dropout masks against jax.grad and against timm given the same masks; parity with
timm + torch autograd in f64; and the misreadings that parity must catch. make test holds each
new block kind once — the inverted residual with ReLU6 (MobileNetV2), the MBConv with
squeeze-excite and SiLU (EfficientNet-B0) — test-all the other shapes and losses."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle_libs import timm, torch
from timm_handover import masked_timm

from twinstep import dp
from twinstep.checking import bounds, cases, oracle, parity
from twinstep.nets import NETS, efficientnet, init, layers
from twinstep.ops import loss
from twinstep.ops.precision import F64

K = 10
CONTROL_MIN_ERR = 1e-3
# per row: parameter tensors, scalars at K = 1000, 1-D tensors, BNs, blocks, drop-path sites
# (timm 1.0.31's counts)
COUNTS = {"mobilenetv2": (158, 3_504_872, 105, 52, 17, 10),
          "efficientnet": (213, 5_288_548, 131, 49, 16, 9)}
FAMILY = [pytest.param(NETS[n], id=n) for n in efficientnet.VARIANTS]


def test_the_family_is_its_tables():
    assert set(COUNTS) == set(efficientnet.VARIANTS)
    for name, (tensors, scalars, one_d, bns, blocks, sites) in COUNTS.items():
        net = NETS[name]
        full = net.param_shapes()
        assert (len(full), sum(int(np.prod(s)) for s in full.values()),
                sum(len(s) == 1 for s in full.values()), len(layers.bn_names(full)),
                len(net.blocks()), len(net.DROP_PATH_SITES)) == (
                    tensors, scalars, one_d, bns, blocks, sites), name


@pytest.mark.oracle
@pytest.mark.parametrize("net", FAMILY)
def test_names_shapes_blocks_and_sites_match_timm(net):
    """Every tensor's name, order and shape; every layer's kernel, stride, groups and
    activation, every squeeze-excite's widths and activations, every block's skip; the
    drop-path sites and rates; the init's constants (BN gamma 1, every bias 0)."""
    rate = 0.23
    model = timm.create_model(net.TIMM_NAME, num_classes=K, drop_path_rate=rate)
    shapes = net.param_shapes(K)
    assert list(shapes.items()) == [(k, tuple(v.shape)) for k, v in model.named_parameters()]
    running = [(k, tuple(v.shape)) for k, v in model.named_buffers() if "running" in k]
    assert list(layers.buffer_shapes(shapes).items()) == running
    act = {"relu6": torch.nn.ReLU6, "silu": torch.nn.SiLU}[net.act]
    assert len(net.blocks()) == len([m for s in model.blocks for m in s])
    for b in net.blocks():
        block = model.get_submodule(b.prefix)
        assert block.has_skip == b.skip, b.prefix
        for la in b.layers:
            conv = model.get_submodule(la.conv)
            assert (conv.kernel_size, conv.stride, conv.padding, conv.groups, conv.bias) == (
                (la.k, la.k), (la.stride, la.stride), ((la.k - 1) // 2, (la.k - 1) // 2),
                la.cin if la.depthwise else 1, None), la.conv
            bn_act = model.get_submodule(la.bn).act
            assert isinstance(bn_act, act if la.act else torch.nn.Identity), la.bn
        if b.se_after:
            assert isinstance(block.se.act1, act) and isinstance(block.se.gate, torch.nn.Sigmoid)
            assert block.se.conv_reduce.out_channels == b.se_width
        else:
            assert isinstance(getattr(block, "se", torch.nn.Identity()), torch.nn.Identity)
    assert isinstance(model.bn2.act, act) and model.conv_head.bias is None
    sites = [f"blocks.{i}.{j}" for i, s in enumerate(model.blocks) for j, m in enumerate(s)
             if m.has_skip]
    assert list(net.DROP_PATH_SITES) == sites
    np.testing.assert_allclose(net.drop_path_rates(rate),
                               [model.get_submodule(s).drop_path.drop_prob for s in sites],
                               rtol=1e-15)
    assert net.zero_init_bns() == ()
    for bn in layers.bn_names(shapes):
        assert bool(torch.all(model.get_submodule(bn).weight == 1)), bn
    for name, p in model.named_parameters():
        if name.endswith(".bias") and name != "classifier.bias":
            assert bool(torch.all(p == 0)), name


def model_state(net, seed: int):
    key = jax.random.key(seed)
    shapes = net.param_shapes(K)
    params = init.init_params(key, shapes, dtype=jnp.float64, linear=net.LINEAR_INIT)
    params, buffers = init.randomize_bn(jax.random.fold_in(key, 1), params,
                                          init.init_buffers(shapes, jnp.float64))
    # squeeze-excite's biases start at 0: draw them, so that a misplaced bias cannot hide
    rng = np.random.default_rng(seed)
    params.update({k: jnp.asarray(0.2 * rng.standard_normal(s)) for k, s in shapes.items()
                   if ".se." in k and k.endswith(".bias")})
    return params, buffers


def masks(rng, net, batch: int) -> dict:
    """Drop-path masks [sites, N] at rate 0.3 and dropout masks [N, FEATURES] at 0.2, scaled by
    1 / keep, each holding both values."""
    drop_path = (rng.random((len(net.DROP_PATH_SITES), batch)) >= 0.3) / 0.7
    dropout = (rng.random((batch, net.FEATURES)) >= 0.2) / 0.8
    assert all(len(np.unique(m)) == 2 for m in (drop_path, dropout))
    return {"drop_path": jnp.asarray(drop_path), "dropout": jnp.asarray(dropout)}


# EfficientNet-B0 (squeeze-excite, SiLU) with masks in make test; MobileNetV2 in test-all
@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("efficientnet"),
                                  pytest.param("mobilenetv2", marks=pytest.mark.all)])
def test_masked_chain_matches_jax_grad_and_timm(name):
    """f64, 32², N = 4, CE, drop-path and dropout masks: every gradient of the explicit chain
    against jax.grad of the same forward (1e-10) and against timm given the same masks — each
    block's ``drop_path`` module and a pre-hook on ``classifier`` (1e-8, its logits 1e-10).
    Structural zeros (the docstring of `twinstep.nets.efficientnet`) are held to zero on their
    BN's scale (`bounds.grad_err`). Controls: timm given each drop-path mask one block late, or
    the dropout mask's rows in another order, is not twinstep's."""
    net, batch, rng = NETS[name], 4, np.random.default_rng(7)
    params, buffers = model_state(net, 3)
    x = rng.standard_normal((batch, 32, 32, 3))
    q = np.asarray(loss.smooth_targets(jnp.asarray(cases.soft_targets(rng, batch, K)),
                                       loss.LABEL_SMOOTHING))
    kw = masks(rng, net, batch)
    ctx = layers.Ctx(precision=F64)

    def ours(p):  # q smoothed already: smoothing it again would not change the comparison
        logits, tape, _ = net.forward(p, buffers, jnp.asarray(x), ctx, **kw)
        ref = jax.grad(lambda p: loss.smoothed_ce(
            net.forward(p, buffers, jnp.asarray(x), ctx, **kw)[0], q, 0.0)[0])(p)
        return logits, net.backward(tape, loss.smoothed_ce(logits, q, 0.0)[1]), ref

    logits, grads, reference = dp.jit(ours, True)(params)
    errs = {n: bounds.grad_err(n, grads, reference) for n in params}
    worst = max(errs, key=errs.get)
    assert len(errs) == COUNTS[name][0] and errs[worst] <= 1e-10, (worst, errs[worst])

    def timms(site_shift: int = 0, row_shift: int = 0):  # shifted: the controls
        model = masked_timm(net, params, buffers, K,
                            np.roll(np.asarray(kw["drop_path"]), site_shift, 0),
                            np.roll(np.asarray(kw["dropout"]), row_shift, 0)).train()
        z = model(torch.tensor(x.transpose(0, 3, 1, 2)))
        (-(torch.tensor(q) * torch.log_softmax(z, -1)).sum(-1).mean()).backward()
        return z.detach().numpy(), {k: v.grad.numpy() for k, v in model.named_parameters()}

    z, theirs = timms()
    assert oracle.rel_err(logits, z) <= 1e-10
    errs = {n: bounds.grad_err(n, grads, theirs) for n in theirs}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-8, (worst, errs[worst])
    for control in ({"site_shift": 1}, {"row_shift": 1}):
        assert oracle.rel_err(logits, timms(**control)[0]) > CONTROL_MIN_ERR, control


# Each row at 32², N = 4 under CE in make test; 64², N = 2 under BCE in test-all
PARITY = [*(pytest.param(n, 32, 4, "ce") for n in efficientnet.VARIANTS),
          *(pytest.param(n, 64, 2, "bce", marks=pytest.mark.all) for n in efficientnet.VARIANTS)]


@pytest.mark.parametrize("name,res,batch,kind", PARITY)
@pytest.mark.oracle
@pytest.mark.slow
def test_parity_with_timm_f64(name, res, batch, kind):
    """`twinstep parity` (f64): train and eval logits, every gradient, the running buffers."""
    net = NETS[name]
    r = parity.run_parity(net, res=res, batch=batch, precision="f64", loss=kind,
                          num_classes=K, seed=1, fast_compile=True)
    assert len(r.grad_errs) == len(net.param_shapes(K))
    assert r.logits_train_err <= 1e-9 and r.logits_eval_err <= 1e-9
    assert r.worst_grad[1] <= 1e-8, r.worst_grad
    assert r.buffer_err <= 1e-9 and r.ok


def _act_after_the_projection(net):
    """Every block's last 1x1 conv followed by the activation: the linear bottleneck missed."""
    net._blocks = tuple(b._replace(layers=(*b.layers[:-1], b.layers[-1]._replace(act=True)))
                        for b in net._blocks)


def _relu_in_squeeze_excite(monkeypatch):
    """squeeze-excite's inner activation ReLU (timm's SqueezeExcite default) where timm's
    EfficientNet passes the block's SiLU."""
    forward = layers.squeeze_excite_forward
    monkeypatch.setattr(layers, "squeeze_excite_forward",
                        lambda *a, act, **kw: forward(*a, act="relu", **kw))


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("misreading", ["mobilenetv2-linear-bottleneck-activated",
                                        "efficientnet-relu-in-squeeze-excite"])
def test_misread_nets_fail_parity(misreading, monkeypatch):
    """Plausible misreadings, same tensors, another net: MobileNetV2 whose projections end in
    ReLU6, EfficientNet-B0 whose squeeze-excite uses ReLU. Parity must fail each."""
    name = misreading.split("-")[0]
    wrong = efficientnet.EfficientNet(name)
    if name == "mobilenetv2":
        _act_after_the_projection(wrong)
    else:
        _relu_in_squeeze_excite(monkeypatch)
    assert wrong.param_shapes(K) == NETS[name].param_shapes(K)
    r = parity.run_parity(wrong, res=32, batch=4, precision="f64", loss="ce", num_classes=K,
                          seed=1, fast_compile=True)
    assert not r.ok and r.logits_train_err > CONTROL_MIN_ERR, r.logits_train_err
