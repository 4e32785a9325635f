"""The ResNet family (v1.5, `twinstep.nets.resnet`): timm's names and shapes for every row, the
explicit chain against jax.grad, parity with timm + torch autograd, the controls that must break
parity, and checkpoints in and out. make test holds ResNet-50 (bottlenecks) and ResNet-18
(basic blocks) — the two kinds of block; test-all every row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle_libs import timm, torch
from timm_handover import masked_timm

from twinstep import dp
from twinstep.checking import cases, oracle, parity
from twinstep.cli import info
from twinstep.nets import NETS, init, layers, resnet
from twinstep.ops import loss, pool
from twinstep.ops.precision import F64
from twinstep.training import state_dict

K = 10
resnet50 = NETS["resnet50"]
# the rows make test holds: one of each block kind; test-all every row
IN_MAKE_TEST = ("resnet18", "resnet50")
FAMILY = [pytest.param(NETS[name], id=name, marks=() if name in IN_MAKE_TEST else pytest.mark.all)
          for name in resnet.VARIANTS]


# tensors, scalars at K = 1000 (timm's parameter counts), BN layers
@pytest.mark.parametrize("name,counts", [
    ("resnet18", (62, 11_689_512, 20)), ("resnet34", (110, 21_797_672, 36)),
    ("resnet50", (161, 25_557_032, 53)), ("resnet101", (314, 44_549_160, 104)),
    ("resnet152", (467, 60_192_808, 155))])
def test_counts(name, counts):
    d = info.describe(NETS[name], 224, 1000)
    assert (d["tensors"], d["scalars"], d["bn_layers"]) == counts
    if name == "resnet50":
        assert (d["one_d_tensors"], d["buffers"]) == (107, 106)
        # convolutions + classifier; timm's table says 4.11 with its profiler's extra ops
        assert round(d["gmacs"], 2) == 4.09


def test_the_blocks_of_a_basic_resnet():
    """ResNet-18: layer1 keeps its width and grid, so it projects nothing; layer2..4's first
    blocks stride on conv1 and project."""
    bs = NETS["resnet18"].blocks()
    assert [(b.cin, b.cout, b.stride, b.projects) for b in bs] == [
        (64, 64, 1, False), (64, 64, 1, False), (64, 128, 2, True), (128, 128, 1, False),
        (128, 256, 2, True), (256, 256, 1, False), (256, 512, 2, True), (512, 512, 1, False)]
    assert NETS["resnet18"].branch_end_bns() == tuple(f"{b.prefix}.bn2" for b in bs)


@pytest.mark.oracle
@pytest.mark.parametrize("net", FAMILY)
def test_names_order_shapes_match_timm(net):
    model = timm.create_model(net.TIMM_NAME, num_classes=K)
    theirs = {k: tuple(v.shape) for k, v in model.named_parameters()}
    ours = net.param_shapes(K)
    assert list(ours.items()) == list(theirs.items())
    buffers = {k: tuple(v.shape) for k, v in model.named_buffers() if "running" in k}
    assert list(layers.buffer_shapes(ours).items()) == list(buffers.items())


def model_state(seed, dtype=jnp.float64, net=resnet50):
    key = jax.random.key(seed)
    shapes = net.param_shapes(K)
    params = init.init_params(key, shapes, dtype=dtype, linear=net.LINEAR_INIT)
    return init.randomize_bn(jax.random.fold_in(key, 1), params,
                               init.init_buffers(shapes, dtype))


def masks(rng, net, batch: int) -> dict:
    """Drop-path masks [sites, N] at rate 0.3 and dropout masks [N, FEATURES] at 0.2, scaled by
    1 / keep as `twinstep.step.draw_masks` draws them, each holding both values."""
    drop_path = (rng.random((len(net.DROP_PATH_SITES), batch)) >= 0.3) / 0.7
    dropout = (rng.random((batch, net.FEATURES)) >= 0.2) / 0.8
    assert all(len(np.unique(m)) == 2 for m in (drop_path, dropout))
    return {"drop_path": jnp.asarray(drop_path), "dropout": jnp.asarray(dropout)}


# (net, res, N, masked): make test's ResNet-18 chain runs with drop-path and dropout masks,
# ResNet-50's without: both chains, each block kind
@pytest.mark.slow
@pytest.mark.parametrize("name,res,batch,masked", [
    pytest.param(n, r, b, m, id=f"{n}-{r}-{b}{'-masked' if m else ''}",
                 marks=() if (n, r, b) in (("resnet50", 32, 4), ("resnet18", 32, 4))
                 else pytest.mark.all)
    for n, r, b, m in [("resnet50", 32, 2, False), ("resnet50", 32, 4, False),
                       ("resnet50", 64, 2, True), ("resnet50", 64, 4, False),
                       ("resnet18", 32, 4, True), ("resnet34", 32, 2, False),
                       ("resnet101", 32, 2, False), ("resnet152", 32, 2, False)]])
def test_explicit_chain_matches_jax_grad(name, res, batch, masked, rng):
    net = NETS[name]
    params, buffers = model_state(res + batch, net=net)
    x = jnp.asarray(rng.standard_normal((batch, res, res, 3)))
    t = cases.soft_targets(rng, batch, K)
    ctx = layers.Ctx(precision=F64)
    kw = masks(rng, net, batch) if masked else {}
    losses = {"ce": lambda z: loss.smoothed_ce(z, t),
              "bce": lambda z: loss.bce(z, loss.bce_targets(t, 0.1, 0.2))}

    def hand(p):
        logits, tape, _ = net.forward(p, buffers, x, ctx, **kw)
        return {k: net.backward(tape, f(logits)[1]) for k, f in losses.items()}

    def autodiff(p):
        return {k: jax.grad(lambda p, f=f: f(net.forward(p, buffers, x, ctx, **kw)[0])[0])(p)
                for k, f in losses.items()}

    ours, ref = dp.jit(hand, True)(params), dp.jit(autodiff, True)(params)  # -O0: same numerics
    for kind in losses:
        errs = {n: oracle.rel_err(ours[kind][n], ref[kind][n]) for n in params}
        assert len(errs) == len(net.param_shapes(K))
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-10, (kind, worst, errs[worst])


# ResNet-50 at three shapes and both losses; every other row at 32², N = 4. Not N = 2: there
# layer4's 1 x 1 grid gives each BN 2 values, whose variance cancels, and 33 or 50 blocks
# amplify f64's rounding to a logits error of 4e-6 (ResNet-101) and 2e-6 (-152) where at
# N = 4 it is 8e-12 (and 9e-13 at 64², N = 2)
PARITY = [pytest.param("resnet50", 64, 2, "ce"), pytest.param("resnet50", 64, 2, "bce"),
          pytest.param("resnet50", 32, 4, "ce", marks=pytest.mark.all),
          *(pytest.param(p.values[0].NAME, 32, 4, "ce", marks=p.marks, id=p.id)
            for p in FAMILY if p.id != "resnet50")]


@pytest.mark.parametrize("name,res,batch,loss_kind", PARITY)
@pytest.mark.oracle
@pytest.mark.slow
def test_parity_with_timm_f64(name, res, batch, loss_kind):
    """Against timm + torch autograd (f64): logits, every gradient, the running buffers after
    one step."""
    net = NETS[name]
    r = parity.run_parity(net, res=res, batch=batch, precision="f64", loss=loss_kind,
                          num_classes=K, seed=1, fast_compile=True)
    assert len(r.grad_errs) == len(net.param_shapes(K))
    assert r.logits_train_err <= 1e-9 and r.logits_eval_err <= 1e-9
    assert r.worst_grad[1] <= 1e-8, r.worst_grad
    assert r.buffer_err <= 1e-9  # running buffers after one step equal timm's
    assert r.ok


@pytest.mark.oracle
@pytest.mark.slow
def test_drop_path_and_dropout_masks_act_where_timms_do():
    """ResNet-18 with drop-path and dropout masks (f64, 32², N = 4, CE) against timm with the
    same masks in place of its draws — each block's ``drop_path`` module, and a pre-hook on
    ``fc`` for forward_head's F.dropout: train logits and every gradient. Controls: timm given
    the dropout mask's rows in another order, or each drop-path mask one block late, is not
    twinstep's."""
    net, batch, rng = NETS["resnet18"], 4, np.random.default_rng(7)
    params, buffers = model_state(3, net=net)
    x = rng.standard_normal((batch, 32, 32, 3))
    q = np.asarray(loss.smooth_targets(jnp.asarray(cases.soft_targets(rng, batch, K)),
                                       loss.LABEL_SMOOTHING))
    kw = masks(rng, net, batch)
    ctx = layers.Ctx(precision=F64)

    def ours(p):  # q smoothed already: smoothing it again would not change the comparison
        logits, tape, _ = net.forward(p, buffers, jnp.asarray(x), ctx, **kw)
        return logits, net.backward(tape, loss.smoothed_ce(logits, q, 0.0)[1])

    logits, grads = dp.jit(ours, True)(params)

    def timms(site_shift: int = 0, row_shift: int = 0):  # shifted: the controls
        model = masked_timm(net, params, buffers, K,
                            np.roll(np.asarray(kw["drop_path"]), site_shift, 0),
                            np.roll(np.asarray(kw["dropout"]), row_shift, 0)).train()
        z = model(torch.tensor(x.transpose(0, 3, 1, 2)))
        (-(torch.tensor(q) * torch.log_softmax(z, -1)).sum(-1).mean()).backward()
        return z.detach().numpy(), {k: v.grad.numpy() for k, v in model.named_parameters()}

    z, theirs = timms()
    assert oracle.rel_err(logits, z) <= 1e-12
    errs = {n: oracle.rel_err(grads[n], theirs[n]) for n in theirs}
    assert len(errs) == 62 and max(errs.values()) <= 1e-10, max(errs.items(), key=lambda e: e[1])
    for control in ({"site_shift": 1}, {"row_shift": 1}):
        assert oracle.rel_err(logits, timms(**control)[0]) > 1e-3, control


@pytest.mark.oracle
@pytest.mark.slow
def test_parity_with_timm_f32_logits():
    """f32 logits within F32_ORACLE_FACTOR = 3 times timm's own f32 error against its f64
    logits (parity.py): under 3e-4 in train mode, 1e-5 in eval, where a wrong net errs by
    1e-3 and more (test_controls_fail_parity)."""
    r = parity.run_parity(resnet50, res=64, batch=4, precision="f32", loss="ce", num_classes=K,
                          seed=2, fast_compile=True)
    assert r.logits_bounds[0] < 3e-4 and r.logits_bounds[1] < 1e-5
    assert r.logits_train_err <= r.logits_bounds[0] and r.logits_eval_err <= r.logits_bounds[1]
    assert r.ok


def swap_gammas(params):
    p = dict(params)
    a, b = "layer1.0.bn1.weight", "layer1.1.bn1.weight"  # the same shape in every row
    p[a], p[b] = params[b], params[a]
    return p


def same_padded_maxpool(x):
    y = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    return y, pool.MaxPoolRes(x, y)


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.parametrize("net", [NETS["resnet50"], NETS["resnet18"]], ids=lambda n: n.NAME)
def test_controls_fail_parity(net, monkeypatch):
    swapped = parity.run_parity(net, res=64, batch=2, precision="f64", loss="ce",
                                num_classes=K, seed=1, tamper=swap_gammas, fast_compile=True)
    assert not swapped.ok and swapped.logits_train_err > 1e-3
    monkeypatch.setattr(pool, "maxpool_forward", same_padded_maxpool)
    same = parity.run_parity(net, res=64, batch=2, precision="f64", loss="ce",
                             num_classes=K, seed=1, fast_compile=True)
    assert not same.ok and same.logits_train_err > 1e-3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_init_keeps_the_dtype_under_x64(dtype):
    """Every initialised tensor of a ResNet and an EfficientNet (squeeze-excite's conv biases)
    in the asked dtype (tests run under x64, where a NumPy scalar factor would silently promote
    f32 weights to f64)."""
    for net in (resnet50, NETS["efficientnet"]):
        shapes = net.param_shapes(10)
        params = init.init_params(jax.random.key(0), shapes, dtype=dtype,
                                    linear=net.LINEAR_INIT)
        params, buffers = init.randomize_bn(jax.random.key(1), params,
                                              init.init_buffers(shapes, dtype))
        assert {a.dtype for a in (*params.values(), *buffers.values())} == {jnp.dtype(dtype)}


def test_zero_init_last_gamma():
    shapes = resnet50.param_shapes(K)
    params = init.init_params(jax.random.key(0), shapes, resnet50.zero_init_bns(),
                                linear=resnet50.LINEAR_INIT)
    assert all(float(jnp.abs(params[f"{b}.weight"]).max()) == 0 for b in resnet50.zero_init_bns())
    assert len(resnet50.zero_init_bns()) == 16 and float(params["bn1.weight"][0]) == 1.0


@pytest.mark.oracle
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_checkpoints_round_trip_through_timm(suffix, tmp_path, rng):
    """A timm checkpoint runs in twinstep, and twinstep's weights load back into timm."""
    model = timm.create_model("resnet50", num_classes=K).double().eval()
    path = tmp_path / f"timm{suffix}"
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if suffix == ".pth":
        torch.save(model.state_dict(), path)
    else:
        state_dict.save(path, state)
    params, buffers, k = state_dict.to_net(resnet50, state_dict.load(path), np.float64)
    assert k == K
    x = rng.standard_normal((2, 64, 64, 3))
    ours = resnet50.forward(params, buffers, jnp.asarray(x), layers.Ctx(precision=F64,
                                                                        train=False))[0]
    with torch.no_grad():
        theirs = model(torch.tensor(x.transpose(0, 3, 1, 2))).numpy()
    assert oracle.rel_err(ours, theirs) < 1e-12

    back = tmp_path / f"ours{suffix}"
    state_dict.save(back, {**params, **buffers})
    loaded = (torch.load(back, weights_only=True) if suffix == ".pth" else
              {k: torch.tensor(v) for k, v in state_dict.load(back).items()})
    fresh = timm.create_model("resnet50", num_classes=K).double()
    missing, unexpected = fresh.load_state_dict(loaded, strict=False)
    assert unexpected == [] and all(m.endswith("num_batches_tracked") for m in missing)
    for name, v in fresh.state_dict().items():
        if name in state:
            np.testing.assert_array_equal(v.numpy(), state[name])


def test_wrong_checkpoint_is_rejected():
    state = {k: np.zeros(s) for k, s in resnet50.param_shapes(K).items()}
    with pytest.raises(ValueError, match="running_mean"):
        state_dict.to_net(resnet50, state)
