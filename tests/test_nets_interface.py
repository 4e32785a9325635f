"""The net interface (`twinstep.nets.Net`): every net provides it, ``MASKS`` names the keyword
masks their forward takes, and ResNet-50's stage table gives timm's 16 bottlenecks. No compiles."""

import inspect
import pathlib
import types

import pytest

from twinstep import nets
from twinstep.nets import NETS, Net, get_net, init, layers, mobilenetv4, resnet
from twinstep.ops import loss

NET_MODULES = list(NETS.values())  # the registry is the list of nets
resnet50 = NETS["resnet50"]
# the init's check against timm in make test: one net of each family and block kind
INIT_IN_MAKE_TEST = ("resnet18", "resnet50", "mnv4", "efficientnet")  # each init kind
# the protocol's members, read off the protocol itself: its constants and its functions
MEMBERS = (*Net.__annotations__, *(name for name, member in vars(Net).items()
                                   if inspect.isfunction(member) and not name.startswith("_")))


def test_every_net_file_is_registered():
    """A net file in twinstep/nets/ that NETS does not list would be a net nothing can use."""
    files = {p.stem for p in pathlib.Path(nets.__file__).parent.glob("*.py")}
    families = {inspect.getmodule(m).__name__.rsplit(".", 1)[1] for m in NET_MODULES}
    assert files - {"__init__", "layers", "init"} == families
    assert {"TRAIN_RES", "DROP_PATH_RATE", "forward", "backward"} <= set(MEMBERS)


@pytest.mark.parametrize("net", NET_MODULES, ids=lambda m: m.NAME)
def test_each_net_is_a_net(net):
    assert isinstance(net, Net)
    assert get_net(net.NAME) is net and NETS[net.NAME] is net


@pytest.mark.parametrize("net", NET_MODULES, ids=lambda m: m.NAME)
def test_masks_are_the_keywords_of_forward(net):
    params = inspect.signature(net.forward).parameters
    assert list(params)[:4] == ["params", "buffers", "x", "ctx"]
    assert net.MASKS == tuple(list(params)[4:])
    assert all(params[m].default is None for m in net.MASKS)  # a net runs without its masks


def test_masks_of_each_net():
    assert resnet50.MASKS == ("drop_path", "dropout")
    assert all(net.MASKS == ("drop_path", "dropout") for net in NET_MODULES)


@pytest.mark.parametrize("missing", MEMBERS)
def test_a_module_missing_a_member_is_not_a_net(missing):
    """The negative control: a copy of ResNet-50's members is a Net, without any one it is not."""
    fake = types.ModuleType("fake_net")
    for name in MEMBERS:
        setattr(fake, name, getattr(resnet50, name))
    assert isinstance(fake, Net)
    delattr(fake, missing)
    assert not isinstance(fake, Net)


def test_get_net_rejects_an_unknown_name():
    with pytest.raises(ValueError) as e:
        get_net("vgg")
    assert str(e.value) == ("unknown net 'vgg'; choose from ['efficientnet', 'mnv4', 'mnv4l', "
                            "'mnv4s', 'mobilenetv2', 'resnet101', 'resnet152', 'resnet18', "
                            "'resnet34', 'resnet50']")


def test_resnet50_blocks_follow_the_stage_table():
    depths = (3, 4, 6, 3)
    bs = resnet50.blocks()
    assert len(bs) == sum(depths) == 16
    assert [b.prefix for b in bs] == [f"layer{i + 1}.{j}" for i, d in enumerate(depths)
                                      for j in range(d)]
    assert [b.cout for b in bs] == [256] * 3 + [512] * 4 + [1024] * 6 + [2048] * 3
    assert [b.cin for b in bs] == ([64, 256, 256] + [256, 512, 512, 512]
                                   + [512] + [1024] * 5 + [1024, 2048, 2048])
    assert all(b.mid == b.cout // 4 for b in bs)
    assert [b.stride for b in bs] == [1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 1, 1, 2, 1, 1]
    assert [i for i, b in enumerate(bs) if b.projects] == [0, 3, 7, 13]
    assert resnet50.FEATURES == 2048 and resnet50.DROP_PATH_SITES == tuple(b.prefix for b in bs)


def test_loss_dispatch(monkeypatch):
    monkeypatch.setattr(loss, "smoothed_ce", lambda z, t, alpha, d: ("ce", alpha, d))
    monkeypatch.setattr(loss, "bce", lambda z, t, d: ("bce", d))
    assert loss.KINDS == ("ce", "bce")
    assert loss.value_and_cotangent("ce", None, None, 4) == ("ce", loss.LABEL_SMOOTHING, 4)
    assert loss.value_and_cotangent("ce", None, None, 4, 0.0) == ("ce", 0.0, 4)
    assert loss.value_and_cotangent("bce", None, None, 40, 0.3) == ("bce", 40)
    with pytest.raises(ValueError, match=r"^unknown loss 'mse'; choose ce or bce$"):
        loss.value_and_cotangent("mse", None, None, 4)


@pytest.mark.parametrize("net", NET_MODULES, ids=lambda m: m.NAME)
def test_branch_ends_are_the_last_bn_of_every_residual_branch(net):
    ends = net.branch_end_bns()
    if isinstance(net, resnet.ResNet):  # every block's last BN (bn3, bn2), which timm zero-inits
        assert ends == net.zero_init_bns() and len(ends) == len(net.blocks())
        assert len(resnet50.branch_end_bns()) == 16
    else:  # the identity-skip blocks' last BN (their drop-path sites): MobileNetV4's pw_proj.bn
        assert ends == tuple(b.layers[-1].bn for b in net.blocks() if b.skip)
        assert tuple(e.rsplit(".", 1)[0] for e in ends) == tuple(
            f"{p}.pw_proj" if isinstance(net, mobilenetv4.MobileNetV4) else p
            for p in net.DROP_PATH_SITES)
    assert len(NETS["mnv4"].branch_end_bns()) == 18


def test_near_init_is_timms_start_nudged():
    """near-init: gammas 1 + 0.01 N, betas 0.01 N, branch ends 1e-3 N (the f32 tie widens its
    betas to 0.1 N: inputs.NEAR_INIT_BETA, docs/tie.md)."""
    import jax
    import numpy as np


    shapes = resnet50.param_shapes(10)
    params = init.near_init_bn(jax.random.key(0), init.init_params(jax.random.key(1), shapes,
                                                                    linear="fan_in"),
                                 resnet50.branch_end_bns())
    gammas = np.concatenate([np.asarray(params[f"{b}.weight"]) for b in layers.bn_names(shapes)
                             if b not in resnet50.branch_end_bns()])
    ends = np.concatenate([np.asarray(params[f"{b}.weight"]) for b in resnet50.branch_end_bns()])
    betas = np.concatenate([np.asarray(params[f"{b}.bias"]) for b in layers.bn_names(shapes)])
    assert abs(gammas.mean() - 1) < 1e-3 and 0.008 < gammas.std() < 0.012
    assert abs(ends).max() < 0.01 and 0.0008 < ends.std() < 0.0012
    assert abs(betas.mean()) < 1e-3 and 0.008 < betas.std() < 0.012
    assert np.array_equal(params["conv1.weight"], init.init_params(
        jax.random.key(1), shapes, linear="fan_in")["conv1.weight"])


INIT_SEEDS = 3
INIT_ALPHA = 1e-6  # a tensor differs when the two samples' KS p-value is below this
INIT_SAMPLE = 20_000  # elements per tensor and side the KS test reads (every k-th)


def _init_mismatches(net, linear: str, zero_init: tuple, classes: int = 10) -> list[str]:
    """The parameters and buffers whose initialisation differs from `timm.create_model`'s over
    INIT_SEEDS seeds each: a constant of timm's (BN's 1 and 0, a zeroed bias or gamma) must be
    the same constant here; anything timm draws must be drawn here from the same distribution
    — family and scale — by a two-sample Kolmogorov-Smirnov test."""
    import jax
    import numpy as np
    from oracle_libs import timm, torch
    from scipy import stats

    shapes = net.param_shapes(classes)
    ours, theirs = [], []
    for seed in range(INIT_SEEDS):
        ours.append({**init.init_params(jax.random.key(seed), shapes, zero_init, np.float32,
                                          linear=linear),
                     **init.init_buffers(shapes, np.float32)})
        torch.manual_seed(seed)
        model = timm.create_model(net.TIMM_NAME, num_classes=classes)
        theirs.append({k: v.detach().numpy() for k, v in [*model.named_parameters(),
                                                          *model.named_buffers()]
                       if not k.endswith("num_batches_tracked")})
    assert set(ours[0]) == set(theirs[0])
    bad = []
    for name in theirs[0]:
        a, b = (np.concatenate([np.asarray(d[name]).ravel() for d in side])
                for side in (ours, theirs))
        if np.all(b == b[0]):
            same = bool(np.all(a == b[0]))
        else:
            step = max(1, b.size // INIT_SAMPLE)
            same = not np.all(a == a[0]) and stats.ks_2samp(
                a[::step], b[::step]).pvalue >= INIT_ALPHA
        if not same:
            bad.append(name)
    return bad


@pytest.mark.oracle
@pytest.mark.parametrize("net", [pytest.param(m, id=m.NAME, marks=() if m.NAME in INIT_IN_MAKE_TEST
                                              else pytest.mark.all) for m in NET_MODULES])
def test_each_net_starts_as_timm_starts_it_and_the_controls_are_seen(net):
    """Every parameter and buffer, over three seeds, as timm.create_model initialises it
    (`_init_mismatches`). The controls, each a tensor-exact set of mismatches: the other
    linear initialisation flags the classifier (MobileNetV4's weight U(+-1/sqrt(K)) and bias 0
    against ResNet's U(+-1/sqrt(D)) both), and ResNet-50 without zero_init_last its 16 bn3
    gammas."""
    assert _init_mismatches(net, net.LINEAR_INIT, net.zero_init_bns()) == []
    other = next(k for k in init.LINEAR_INITS if k != net.LINEAR_INIT)
    head = list(net.param_shapes(10))[-2:]
    assert _init_mismatches(net, other, net.zero_init_bns()) == head
    if net.zero_init_bns():
        assert _init_mismatches(net, net.LINEAR_INIT, ()) == [
            f"{b}.weight" for b in net.zero_init_bns()]
