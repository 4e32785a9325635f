"""Recipe names (docs/recipes.md): the reference set decodes field by field, every name round-trips,
malformed names are rejected naming the offending token, the presets and the CLI print."""

import dataclasses
import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinstep import recipes
from twinstep.cli import main
from twinstep.cli.recipe import describe
from twinstep.nets import NETS
from twinstep.optimizers import OPTIMIZERS
from twinstep.presets import IMAGENET_TRAIN_IMAGES, REFERENCE_NAMES
from twinstep.recipes import PRESETS, Recipe, UsageError, parse

# name -> the fields it must decode to (the rest: the dataclass defaults)
EXPECTED = {
    "resnet50in160_lambaccdp4x128wxclipbcebf16": dict(
        net="resnet50", res=160, optimizer="lamb", accum=4, dp=True, batch=128, wx=True,
        clip=True, bce=True, bf16=True),
    "resnet50in160_lambaccdp8x64wxclipbce": dict(
        net="resnet50", res=160, optimizer="lamb", accum=8, dp=True, batch=64, wx=True,
        clip=True, bce=True),
    "resnet50in_lambaccdp4x128wxclipdropbce": dict(
        net="resnet50", optimizer="lamb", accum=4, dp=True, batch=128, wx=True, clip=True,
        drop=True, bce=True),
    "resnet50in_emalambaccdp4x128wxclipdropbce": dict(
        net="resnet50", optimizer="lamb", accum=4, dp=True, batch=128, wx=True, clip=True,
        drop=True, bce=True, ema=True),
    "resnet50in_momdp64": dict(net="resnet50", optimizer="momentum", dp=True, batch=64),
    "mnv4in_emaaccdp8x128wxdowd005bf16": dict(
        net="mnv4", optimizer="adamw", accum=8, dp=True, batch=128, wx=True, dropout=True,
        weight_decay=0.05, bf16=True, ema=True),
    "mnv4in_accdp8x128wxdropdowd01bf16": dict(
        net="mnv4", optimizer="adamw", accum=8, dp=True, batch=128, wx=True, drop=True,
        dropout=True, weight_decay=0.1, bf16=True),
    "mnv4in_adamdp64": dict(net="mnv4", optimizer="adamw", dp=True, batch=64),
}


def test_reference_names_decode_and_round_trip():
    assert set(REFERENCE_NAMES) == set(EXPECTED)
    for name in REFERENCE_NAMES:
        r = parse(name)
        assert r == Recipe(**EXPECTED[name]), name
        assert r.name == name


def test_explicit_fields():
    r = parse("resnet50in160_lambaccdp4x128wxclipbcebf16")
    assert (r.res, r.train_res, r.optimizer, r.accum, r.dp, r.batch) == (160, 160, "lamb", 4,
                                                                         True, 128)
    assert r.wx and r.clip and r.bce and r.bf16 and not (r.drop or r.dropout or r.ema)
    assert r.loss == "bce" and r.effective_label_smoothing == 0.0
    assert r.effective_batch(8) == 8 * 128 * 4
    r = parse("mnv4in_accdp8x128wxdropdowd01bf16")
    assert (r.optimizer, r.accum, r.drop, r.dropout, r.weight_decay) == ("adamw", 8, True, True,
                                                                        0.1)
    assert r.train_res == 256 and r.res is None and r.loss == "ce"
    assert r.effective_weight_decay == 0.1 and r.effective_label_smoothing == 0.1
    assert r.lr == 4e-3 and r.drop_path_rate == 0.075


def test_defaults_and_decimals():
    r = parse("resnet50in_lamb")  # omitted N is 32, no dp: a single device
    assert (r.batch, r.dp, r.accum, r.effective_batch(1)) == (32, False, 1, 32)
    assert (r.lr, r.effective_weight_decay, r.drop_path_rate) == (5e-3, 0.02, 0.05)
    assert parse("resnet50in_sgd").optimizer == "sgd"
    assert parse("resnet50in_sgd").effective_weight_decay == 1e-4
    assert parse("resnet50in_lamb128").batch == 128  # N without dp
    assert parse("resnet50in_lambacc2x").accum == 2
    for digits, value in (("005", 0.05), ("01", 0.1), ("1", 1.0), ("0", 0.0), ("00001", 1e-4),
                          ("25", 2.5)):
        assert parse(f"mnv4in_adamwd{digits}").weight_decay == value
    assert parse("mnv4in_adamls01").label_smoothing == 0.1
    assert parse("mnv4in_adamls0").effective_label_smoothing == 0.0
    assert parse("resnet50in224_mom").res == 224  # explicit default res is kept, and printed
    assert parse("resnet50in224_mom").name == "resnet50in224_mom"


decimals = st.one_of(st.none(), st.sampled_from([0.0, 0.05, 0.1, 1e-4]),
                     st.floats(0, 1, exclude_max=True))


@settings(max_examples=300)
@given(net=st.sampled_from(sorted(NETS)), dataset=st.sampled_from(sorted(recipes.DATASETS)),
       res=st.one_of(st.none(), st.integers(1, 999)),
       optimizer=st.sampled_from(sorted(OPTIMIZERS)), accum=st.integers(1, 64),
       batch=st.integers(1, 4096), flags=st.lists(st.booleans(), min_size=9, max_size=9),
       label_smoothing=decimals,
       weight_decay=st.one_of(decimals, st.floats(0, 10, exclude_max=True)))
def test_random_recipes_round_trip(net, dataset, res, optimizer, accum, batch, flags,
                                   label_smoothing, weight_decay):
    dp, wx, clip, drop, dropout, bce, bf16, ema, _ = flags
    res = res if dataset else None  # your own images: the resolution is train --res's
    r = Recipe(net=net, dataset=dataset, res=res, optimizer=optimizer, accum=accum, dp=dp,
               batch=batch, wx=wx, clip=clip, drop=drop, dropout=dropout, bce=bce,
               label_smoothing=label_smoothing, weight_decay=weight_decay, bf16=bf16, ema=ema)
    assert parse(r.name) == r, r.name
    assert parse(r.name).name == r.name


# (name, a piece of the message: the offending token)
MALFORMED = [
    ("resnet50in_lambfoo", "unknown token 'foo' after 'lamb'"),
    ("resnet50in_lambfoowx", "unknown token 'foo'"),
    ("mnv4in_lambdropout", "unknown token 'out' after 'drop'"),
    ("resnet50in_lambwxdp", "'dp' out of order"),
    ("resnet50in_lambema", "'ema' out of order"),
    ("resnet50in_lambwxwx", "'wx' repeated"),
    ("resnet50in_lambadam", "'adam' repeated"),
    ("resnet50in_acc4x8x", "'8x' repeated"),
    ("resnet50in_lambacc", "'acc' needs '<k>x'"),
    ("resnet50in_lambdp4x128", "'4x' needs 'acc'"),
    ("resnet50in_lambacc1x", "'1x'"),
    ("resnet50in_lambacc04x", "'04x' has a leading zero"),
    ("vgg16in_lamb", "'vgg16in'"),
    ("resnet50im_lamb", "unknown net in 'resnet50im'"),  # not resnet50 on a dataset 'im'
    ("mnv4xin_adam", "unknown net in 'mnv4xin'"),
    ("mnv4-in_adam", "unknown net in 'mnv4-in'"),
    ("mnv4224_adam", "a <res> needs its <data> before it: mnv4in224_"),
    ("resnet18160_mom", "or no <res> and train --res 160"),
    ("resnet50inlamb", "missing '_'"),
    ("", "empty"),
    ("resnet50in_lambwd", "'wd' needs digits"),
    ("resnet50in_lambls", "'ls' needs digits"),
    ("resnet50in_lambls1", "'ls1'"),
    ("resnet50in_lambwd010", "'wd010' is not canonical; write 'wd01'"),
    ("resnet50in_lambdp32", "'32' is the default N"),
    ("resnet50in_lambdp064", "'064' has a leading zero"),
    ("resnet50in_lambdp0", "'0'"),
    ("resnet50in_dp64", "no optimizer"),
    ("resnet50in_", "no optimizer"),
    ("mnv4in_adamacc8x", "'adam' before 'acc'"),
    ("resnet50in160x_lamb", "'160x'"),
    ("resnet50in0_lamb", "'0'"),
    ("resnet50in_lamb_dp", "unknown token '_'"),
    ("rsb-a4", "unknown net in 'rsb-a4'"),
]


@pytest.mark.parametrize("name,piece", MALFORMED)
def test_malformed_names_name_the_token(name, piece):
    with pytest.raises(UsageError) as e:
        parse(name)
    prefix = f"bad recipe name {name!r}: "
    assert str(e.value).startswith(prefix)
    assert piece in str(e.value)[len(prefix):]


def test_unknown_net_names_the_nets_and_datasets():
    with pytest.raises(UsageError) as e:
        parse("mnv4xin_adam")
    assert str(e.value) == (
        "bad recipe name 'mnv4xin_adam': unknown net in 'mnv4xin'; expected "
        f"<net>[<data>[<res>]] with <net> one of: {', '.join(NETS)} and <data> in or none")


def test_the_seeds_spelling_of_resnet34s_step():
    """The seeds' system names ResNet-34's ImageNet step `resnet34in_momdp128`: here the same
    name is that recipe, at timm's training resolution."""
    r = parse("resnet34in_momdp128")
    assert (r.net, r.dataset, r.optimizer, r.batch, r.train_res) == (
        "resnet34", "in", "momentum", 128, 224)


# issue #67's catalogue in the recipe spelling: some names prefix others (mnv4 of mnv4s)
FUTURE_NETS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "mobilenetv2",
               "efficientnet", "mnv4", "mnv4s", "mnv4l")
PREFIX_PAIRS = [(shorter, longer) for shorter in FUTURE_NETS for longer in FUTURE_NETS
                if longer != shorter and longer.startswith(shorter)]
BY_LENGTH = sorted(FUTURE_NETS, key=len)


def _misread(monkeypatch, nets_in_order) -> list[tuple[str, str]]:
    """(name, its net or the error) for each name of a prefix pair's nets that does not parse
    as that net, with twinstep.recipes.NETS the future catalogue in the given order."""
    monkeypatch.setattr(recipes, "NETS", {n: NETS["mnv4"] for n in nets_in_order})
    wrong = []
    for net in sorted({n for pair in PREFIX_PAIRS for n in pair}):
        for name in (f"{net}in_adam", f"{net}in160_adam", f"{net}_adam"):
            try:
                got = parse(name).net
            except UsageError as e:
                got = str(e)
            if got != net:
                wrong.append((name, got))
    return wrong


@pytest.mark.parametrize("order", [FUTURE_NETS, BY_LENGTH, BY_LENGTH[::-1]],
                         ids=["catalogue", "shorter-first", "longer-first"])
def test_longest_net_name_wins_whatever_the_order(monkeypatch, order):
    assert ("mnv4", "mnv4s") in PREFIX_PAIRS and ("mnv4", "mnv4l") in PREFIX_PAIRS
    assert _misread(monkeypatch, order) == []
    with pytest.raises(UsageError) as e:  # a made-up net that a known one prefixes
        parse("mnv4xin_adam")
    assert "unknown net in 'mnv4xin'; expected <net>[<data>[<res>]] with <net> one of: " in \
        str(e.value)
    assert all(n in str(e.value) for n in FUTURE_NETS)


def test_first_prefix_rule_fails_the_check(monkeypatch):
    """The negative control: the rule before issue #66, the first net in NETS' order that
    prefixes the name, misreads every longer name of a pair when the shorter comes first."""
    monkeypatch.setattr(recipes, "_net_of",
                        lambda head, nets: next((n for n in nets if head.startswith(n)), None))
    wrong = dict(_misread(monkeypatch, BY_LENGTH))
    assert set(wrong) == {f"{longer}{rest}" for _, longer in PREFIX_PAIRS
                          for rest in ("in_adam", "in160_adam", "_adam")}
    assert "unknown net in 'mnv4sin'" in wrong["mnv4sin_adam"]
    assert _misread(monkeypatch, BY_LENGTH[::-1]) == []  # the order hid it


def test_grammar_is_built_from_the_step_tokens():
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "recipes.md")).read()
    assert recipes.GRAMMAR == ("<net>[<data>[<res>]]_[ema]<opt>[acc][dp][<k>x][<N>][wx][clip]"
                               "[drop][do][bce][ls<a>][wd<d>][bf16]")
    assert f"\n    {recipes.GRAMMAR}\n" in docs


def test_expected_tokens_listed():
    with pytest.raises(ValueError, match="expected one of: acc, dp, <k>x, <N>, wx, clip, drop, "
                                         "do, bce, ls<a>, wd<d>, bf16$"):
        parse("resnet50in_lambfoo")


def test_incoherent_recipes_rejected():
    for bad in (dict(net="vit", optimizer="lamb"), dict(net="mnv4", optimizer="adam"),
                dict(net="mnv4", optimizer="lamb", accum=0),
                dict(net="mnv4", optimizer="lamb", label_smoothing=1.0),
                dict(net="mnv4", optimizer="lamb", weight_decay=10.0),
                dict(net="mnv4", optimizer="lamb", ema_warmup="fast"),
                dict(net="mnv4", optimizer="lamb", warmup_steps=200, total_steps=100)):
        with pytest.raises(UsageError):
            Recipe(**bad)


def test_rmsproptf_names():
    """timm's RMSpropTF is the token 'rms', after 'ema' as every optimizer's: the EfficientNet
    recipes' spelling, efficientnetin_emarmsdp64dropdo."""
    r = parse("resnet50in_rmsdp64")
    assert (r.optimizer, r.dp, r.batch, r.lr, r.effective_weight_decay) == (
        "rmsproptf", True, 64, 0.048, 1e-5)
    r = parse("resnet50in_emarmsdp64dropdo")
    assert r == Recipe(net="resnet50", optimizer="rmsproptf", dp=True, batch=64, drop=True,
                       dropout=True, ema=True)
    r = parse("efficientnetin_emarmsdp64dropdo")
    assert (r.net, r.optimizer, r.ema, r.drop, r.dropout) == ("efficientnet", "rmsproptf", True,
                                                              True, True)
    for name in ("resnet50in_rmsdp64", "resnet50in_emarmsdp64dropdo",
                 "efficientnetin_emarmsdp64dropdo", "mobilenetv2in_rmsdp64wx",
                 "mnv4in_emarmsaccdp2x64wxclipwd00001bf16"):
        assert parse(name).name == name
    with pytest.raises(UsageError, match="'rms' repeated"):
        parse("resnet50in_rmsrms")


def test_step_schedule_fields_are_checked():
    """schedule="step" needs its decay_steps and decay_rate, and the cosine takes neither: one
    line naming the field."""
    base = dict(net="resnet18", optimizer="rmsproptf")
    step = Recipe(**base, schedule="step", decay_steps=2.4, decay_rate=0.97)
    assert (step.decay_steps, step.decay_rate) == (2.4, 0.97)
    assert isinstance(Recipe(**base, schedule="step", decay_steps=3, decay_rate=1).decay_steps,
                      float)
    for fields, message in (
            (dict(schedule="linear"), "schedule 'linear'; expected one of: cosine, step"),
            (dict(schedule="step", decay_rate=0.97), "schedule 'step' needs decay_steps"),
            (dict(schedule="step", decay_steps=2.4), "schedule 'step' needs decay_rate"),
            (dict(decay_steps=2.4), "schedule 'cosine' takes no decay_steps"),
            (dict(decay_rate=0.97), "schedule 'cosine' takes no decay_rate"),
            *((dict(schedule="step", decay_steps=d, decay_rate=r),
               "expected decay_steps > 0 and 0 < decay_rate <= 1")
              for d, r in ((0, 0.97), (-1, 0.97), (float("inf"), 0.97), (float("nan"), 0.97),
                           (2.4, 0.0), (2.4, 1.5), (2.4, float("nan"))))):
        with pytest.raises(UsageError) as e:
            Recipe(**base, **fields)
        assert str(e.value).startswith("bad recipe: ") and message in str(e.value), fields
        assert "\n" not in str(e.value)


def test_train_keeps_a_step_decays_share_of_the_run(tmp_path):
    """`twinstep train` runs a recipe over its own length, the warmup its share of it: a step
    decay's interval likewise (decay_steps x steps / total_steps)."""
    from twinstep.training.config import TrainConfig

    cfg = TrainConfig("resnet18in_rms", str(tmp_path), steps=50)
    recipe = Recipe(net="resnet18", optimizer="rmsproptf", warmup_steps=100, total_steps=1000,
                    schedule="step", decay_steps=24.0, decay_rate=0.97)
    resolved = cfg._resolve(recipe)
    assert (resolved.total_steps, resolved.warmup_steps) == (50, 5)
    assert resolved.decay_steps == pytest.approx(1.2) and resolved.decay_rate == 0.97
    assert cfg.parsed_recipe().decay_steps is None  # a cosine's recipe keeps none


def test_a_run_recorded_before_the_schedule_fields_resumes(tmp_path):
    """A run's config.json from before `Recipe.schedule` (and its decay fields) had the
    defaults: it resumes; one recorded with another schedule does not."""
    import json

    from twinstep.training.config import TrainConfig, check_run_dir

    cfg = TrainConfig("resnet18in_rms", str(tmp_path / "run"), steps=20)
    assert check_run_dir(cfg) is False
    recipe = dataclasses.asdict(cfg.parsed_recipe())
    for recorded, resumes in (({k: v for k, v in recipe.items() if k not in (
            "schedule", "decay_steps", "decay_rate")}, True),
            ({**recipe, "schedule": "step", "decay_steps": 2.0, "decay_rate": 0.5}, False)):
        with open(tmp_path / "run" / "config.json", "w") as f:
            json.dump({**dataclasses.asdict(cfg), "resolved_recipe": recorded}, f)
        if resumes:
            assert check_run_dir(cfg) is True
        else:
            with pytest.raises(UsageError, match="recipe field schedule = 'step', not 'cosine'"):
                check_run_dir(cfg)


def test_presets():
    assert set(PRESETS) == {"rsb-a1", "rsb-a2", "rsb-a3", "mnv4-conv-m"}
    a1, a2, a3, m = (PRESETS[k] for k in ("rsb-a1", "rsb-a2", "rsb-a3", "mnv4-conv-m"))
    assert [p.effective_batch(8) for p in (a1, a2, a3, m)] == [2048, 2048, 2048, 4096]
    assert [p.epochs for p in (a1, a2, a3, m)] == [600, 300, 100, 500]
    assert [p.train_res for p in (a1, a2, a3, m)] == [224, 224, 160, 256]
    assert [(p.optimizer, p.lr, p.effective_weight_decay) for p in (a1, a2, a3, m)] == [
        ("lamb", 5e-3, 0.01), ("lamb", 5e-3, 0.02), ("lamb", 8e-3, 0.02), ("adamw", 4e-3, 0.1)]
    assert [p.loss for p in (a1, a2, a3, m)] == ["bce", "bce", "bce", "ce"]
    assert [p.bce_threshold for p in (a1, a2, a3)] == [0.2, 0.2, None]
    assert [p.effective_label_smoothing for p in (a1, a2, a3, m)] == [0.1, 0.0, 0.0, 0.1]
    assert a1.drop and a2.drop and not a3.drop and m.drop and m.dropout
    assert m.drop_path_rate == 0.075 and m.dropout_rate == 0.2
    assert not any(p.ema for p in (a1, a2, a3, m))
    assert a3.total_steps == 100 * (IMAGENET_TRAIN_IMAGES // 2048)
    for key, p in PRESETS.items():
        assert parse(key) is p
        q = parse(p.name)  # the name is lossy for lr, epochs, ...: only its fields survive
        assert q.name == p.name
        assert all(getattr(q, f) == getattr(p, f) for f in
                   ("net", "res", "optimizer", "accum", "dp", "batch", "wx", "bce",
                    "label_smoothing", "weight_decay"))


def test_describe_covers_every_field():
    rows = dict(describe(PRESETS["rsb-a3"], replicas=8))
    assert {f.name for f in dataclasses.fields(Recipe)} <= set(rows)
    assert rows["name"] == "resnet50in160_lambdp256wxbcewd002"
    assert rows["effective batch"].endswith("= 2048")
    assert "effective batch" not in dict(describe(PRESETS["rsb-a3"], None))


def test_cli_table(capsys):
    assert main(["recipe", "resnet50in160_lambaccdp4x128wxclipbcebf16", "--replicas", "8"]) == 0
    out = capsys.readouterr().out
    for piece in ("resnet50in160_lambaccdp4x128wxclipbcebf16", "lamb", "N = 128", "k = 4",
                  "4096", "BCE"):
        assert piece in out
    assert main(["recipe", "rsb-a2"]) == 0
    out = capsys.readouterr().out
    assert "resnet50in_lambdp256wxdropbcewd002" in out and "rand-m6-mstd0.5-inc1" in out


def test_cli_json(capsys):
    assert main(["recipe", "mnv4in_accdp8x128wxdropdowd01bf16", "--replicas", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["name"] == "mnv4in_accdp8x128wxdropdowd01bf16"
    assert (d["optimizer"], d["accum"], d["batch"], d["weight_decay"]) == ("adamw", 8, 128, 0.1)
    assert d["effective_batch"] == 2 * 128 * 8 and d["loss"] == "ce"


def test_cli_bad_name(capsys):
    assert main(["recipe", "resnet50in_lambfoo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("twinstep recipe: bad recipe name 'resnet50in_lambfoo': unknown token "
                          "'foo'")
    assert err.count("\n") == 1


def test_cli_help_lists_grammar_and_presets(capsys):
    with pytest.raises(SystemExit) as e:
        main(["recipe", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert recipes.GRAMMAR in out and all(k in out for k in PRESETS)
    with pytest.raises(SystemExit) as e:
        main(["recipe", "rsb-a1", "--replicas", "0"])
    assert e.value.code == 2


def test_each_optimizer_is_one_row_that_the_grammar_and_the_docs_follow():
    """twinstep.optimizers.OPTIMIZERS is the catalogue: each row's token parses to it and back, its
    default lr and weight decay are a recipe's, `twinstep recipe` prints its text, and the
    docs' tables (docs/recipes.md: the <opt> token, the defaults) name its token and values."""
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "recipes.md")).read()
    rows: dict = {}  # a table's rows by their first cell (the grammar's table first)
    for line in docs.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    for kind, row in OPTIMIZERS.items():
        r = parse(f"resnet50in_{row.token}")
        assert r.optimizer == kind and r.name == f"resnet50in_{row.token}"
        assert (r.lr, r.effective_weight_decay) == (row.lr, row.weight_decay)
        assert dict(describe(r))["optimizer"] == f"{kind} ({row.text})"
        assert f"`{row.token}`" in rows["`<opt>`"], row.token
        assert row.lr in _numbers(rows["learning rate"]), (kind, row.lr)
        assert row.weight_decay in _numbers(rows["weight decay (when there is no `wd` token)"])


def _numbers(text: str) -> set[float]:
    return {float(x) for x in re.findall(r"\d[\d.]*(?:e-?\d+)?", text)}


def test_a_recipe_for_your_own_images_needs_no_imagenet_token():
    """`<data>` may be left out (your own images, `--data`'s classes): `mnv4_adamdp16` is its own
    canonical name, and the seeds' `in` spellings still parse. A resolution then comes from
    `train --res`: in the name it would read as part of the net's ('resnet18224'), and a
    `Recipe` holding one refuses itself (its name could not say it)."""
    own = parse("mnv4_adamdp16")
    assert (own.net, own.dataset, own.name) == ("mnv4", "", "mnv4_adamdp16")
    assert parse("mnv4in_adamdp16").dataset == "in" and parse("mnv4sin_adam").net == "mnv4s"
    assert parse("mnv4s_adam").net == "mnv4s" and parse("efficientnet_rmsdp2").net == "efficientnet"
    with pytest.raises(UsageError, match="res 64 needs the dataset 'in'"):
        Recipe(net="mnv4", dataset="", res=64, optimizer="adamw")
