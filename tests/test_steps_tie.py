"""The tie over whole training steps (docs/recipes.md): after the gradient collective every replica
holds the same gradient, so accumulation, clip, optimizer, EMA and running statistics leave the
R replicas in the single device's state at R*N — every parameter, optimizer-state, EMA and
running-statistics tensor, after every one of three steps, float64. And the replicated-masks
bug breaks it.

`make test` ties one ResNet-18 recipe with every step feature that touches the replicas
(EMA, k = 2 accumulation, clip, wx, drop-path, classifier dropout, BCE; AdamW) over two steps and
runs the replicated-masks control on it: what it holds is the step's, not the net's, and
ResNet-18's tie and control took 14 s and 7 s where MobileNetV4's took 91 s and 45 s. LAMB,
and the same features on MobileNetV4, are left to `make test-all`: LAMB's trust ratio reads
only replicated tensors (the all-reduced gradient, the parameters), and it nearly triples the
compile (MNv4's single-device step: 18 s with AdamW, 75 s with LAMB, at -O0). The recipes of
the full matrix, at R = 2 and 4 over three steps, are marked ``all``. How each replica takes
its rows of the global masks, both kinds, is checked below without a network.
"""

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FAST_COMPILE_NETS

from twinstep import dp, recipes, step
from twinstep.checking import tie, trajectory
from twinstep.cli.main import main
from twinstep.nets import get_net

LAMB_ACC = "resnet50in_lambaccdp2x2wxclipbce"  # LAMB, k = 2, clip, wx, BCE
ADAMW_EMA_MASKS = "mnv4in_emaadamdp2wxdropdo"  # AdamW, EMA, drop-path, dropout
# every step feature that touches the replicas; on MobileNetV4, and with LAMB too (test-all)
STEP_FEATURES = "resnet18in_emaaccdp2x2wxclipdropdobce"
MNV4_FEATURES = "mnv4in_emaaccdp2x2wxclipdropdobce"
EVERY_FEATURE = "mnv4in_emalambaccdp2x2wxclipdropdobce"
# EfficientNet-B0's family with RMSProp in TensorFlow's form (test-all)
EFFICIENTNET_FEATURES = "efficientnetin_emarmsaccdp2x2wxclipdropdobce"
# parameter tensors, BN sites
COUNTS = {"resnet18": (62, 20), "mnv4": (233, 77), "efficientnet": (213, 49)}


def run(name: str, replicas: int, steps: int = 3, control: str = "none",
        seed: int = 0) -> trajectory.StepsReport:
    r = recipes.parse(name)
    cfg = tie.TieConfig(net=r.net, replicas=replicas, batch=r.batch, loss=r.loss, recipe=name,
                        control=control, seed=seed, fast_compile=r.net in FAST_COMPILE_NETS)
    return trajectory.run_steps_tie(cfg, r, steps=steps)


def fields(report: trajectory.StepsReport) -> dict:
    out: dict = {}
    for row in report.steps[-1]["rows"]:
        out.setdefault(row["name"].split("/")[0], []).append(row)
    return out


# the control's single-device steps are the tie's, loaded from the run's compilation cache when
# one worker runs both, one after the other (on two workers at once, both compiled them)
@pytest.mark.slow
@pytest.mark.xdist_group("steps-tie")
@pytest.mark.parametrize("name", [STEP_FEATURES,
                                  *(pytest.param(n, marks=pytest.mark.all)
                                    for n in (MNV4_FEATURES, EVERY_FEATURE,
                                              EFFICIENTNET_FEATURES))])
def test_step_features_tie_over_two_steps(name, tmp_path):
    """Two steps: the first at lr(0) = 0 moves the optimizer state, the running statistics and
    the EMA; the second moves the parameters from there. (Its control, in make test too:
    replicated masks break this tie, `test_replicated_masks_break_the_step_features_tie`.)"""
    report = run(name, 2, steps=2)
    assert report.ok, report.verdict()
    assert len(report.steps) == 2
    rows, (tensors, bns) = fields(report), COUNTS[recipes.parse(name).net]
    assert len(rows["params"]) == tensors and len(rows["buffers"]) == 2 * bns
    assert len(rows["opt_state"]) >= 2 * tensors and len(rows["ema"]) == tensors + 2 * bns
    # its picture (`tie --recipe --plot`, `twinstep plot REPORT.json`)
    from twinstep.checking import picture

    png = str(tmp_path / "steps.png")
    assert picture.draw(report.to_json(), png) == png and os.path.getsize(png) > 10_000


@pytest.mark.slow
@pytest.mark.xdist_group("steps-tie")
def test_replicated_masks_break_the_step_features_tie():
    """The whole-step tie's control, one step of the recipe above (its single-device steps come
    from the run's compilation cache): every replica taking the first replica's drop-path and
    dropout masks fails the tie after one step, where the masks reach at lr(0) = 0: the
    optimizer's moments (the gradients) and the running statistics (the forward, which only
    drop-path reaches: ResNet-18's dropout acts after its last BN). At ResNet-18's rates, at
    most 0.05, seed 1 is the first whose first step drops a branch (seed 0's drops none)."""
    seed, r = 1, recipes.parse(STEP_FEATURES)
    key, rows = jax.random.fold_in(jax.random.key(seed), 0), 2 * r.batch  # as the tie draws
    dropped = [step.draw_masks(get_net(r.net), r, jax.random.fold_in(key, i), rows,
                               jnp.float64)["drop_path"] for i in range(r.accum)]
    assert np.any(np.asarray(dropped) == 0)  # else the forward's half could not fire
    broken = run(STEP_FEATURES, 2, steps=1, control="replicated-masks", seed=seed)
    last = broken.steps[-1]["rows"]
    assert not broken.ok and broken.verdict().startswith(
        f"NOT tied over 1 step: {sum(not r['ok'] for r in last)} of {len(last)} state tensors "
        f"outside their bounds")
    failing = {row["name"].split("/")[0] for row in broken.steps[-1]["rows"] if not row["ok"]}
    assert {"opt_state", "buffers"} <= failing, failing  # seen: buffers, ema, opt_state


@pytest.mark.parametrize("control", ["none", "replicated-masks"])
def test_each_replica_takes_its_rows_of_the_global_masks(control):
    """Masks are drawn once for the global batch of R N rows (drop-path [sites, R N], dropout
    [R N, features]) and each replica keeps its own N rows of both; under the replicated-masks
    bug every replica gets the first replica's rows."""
    net, recipe = get_net("mnv4"), recipes.parse(ADAMW_EMA_MASKS)
    count, n, key = 2, 8, jax.random.key(5)
    whole = step.draw_masks(net, recipe, key, count * n, jnp.float64)
    assert set(whole) == {"drop_path", "dropout"}
    rep = dp.replicas(count, control)

    def replica(rows):  # rows [N]: only there to give the map a batch
        return step.shard_masks(step.draw_masks(net, recipe, key, count * n, jnp.float64), rep)

    specs = {"drop_path": dp.MICRO_BATCH, "dropout": dp.BATCH}
    gathered = dp.replica_map(replica, count, (dp.BATCH,), specs)(jnp.zeros(count * n))
    for kind, axis in step.MASK_BATCH_AXIS.items():
        first, second = np.split(np.asarray(whole[kind]), count, axis)
        assert not np.array_equal(first, second), kind  # else the control could not fire
        ours = np.asarray(gathered[kind])
        if control == "none":
            assert np.array_equal(ours, whole[kind]), kind
        else:
            assert np.array_equal(ours, np.concatenate([first, first], axis)), kind


@pytest.mark.slow
@pytest.mark.all
@pytest.mark.parametrize("replicas", [2, 4])
def test_resnet50_lamb_accumulation_clip_ties_over_three_steps(replicas):
    report = run(LAMB_ACC, replicas)
    assert report.ok, report.verdict()
    assert len(report.steps) == 3
    rows = fields(report)
    assert len(rows["params"]) == 161 and len(rows["buffers"]) == 2 * 53
    assert len(rows["opt_state"]) >= 2 * 161  # Adam's mu and nu for every tensor
    # 32² at R N = 4 is ill-conditioned (layer4's BNs reduce 4 rows), so after three steps
    # most bounds come from the single device's own sensitivity — still far below any bug's
    assert max(r["bound"] for s in report.steps for r in s["rows"]) <= 1e-6


@pytest.mark.slow
@pytest.mark.all
@pytest.mark.parametrize("replicas", [2, 4])
def test_mnv4_adamw_ema_masks_ties_over_three_steps(replicas):
    report = run(ADAMW_EMA_MASKS, replicas)
    assert report.ok, report.verdict()
    rows = fields(report)
    assert len(rows["params"]) == 233 and len(rows["ema"]) == 233 + 2 * 77


@pytest.mark.slow
@pytest.mark.all
def test_replicated_masks_break_the_tie():
    report = run(ADAMW_EMA_MASKS, 2, steps=1, control="replicated-masks")
    assert not report.ok and "NOT tied" in report.verdict()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "2"], "--steps needs --recipe"),
    (["--control", "replicated-masks"], "needs --recipe"),
    (["--recipe", "mnv4in_adamdp64"], "is for mnv4, not resnet50"),
    (["--recipe", "resnet50in_lambdp2foo"], "unknown token 'foo'"),
    (["--recipe", LAMB_ACC, "--precision", "f32"], "run in f64"),
    (["--recipe", LAMB_ACC, "--control", "replicated-masks"], "drop-path or dropout"),
    (["--recipe", LAMB_ACC, "--control", "unsynced"], "tie it without --recipe"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    """The CLI's main in this process (each refusal comes before any compile; a process of its
    own took 1.6 s a case): exit 2, from main or from its argument parser."""
    try:
        status = main(["tie", "resnet50", *argv])
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and message in err, (status, err)


def test_a_net_without_classifier_dropout_refuses_do():
    """Every net of the catalogue takes dropout masks; one whose `MASKS` has none refuses `do`
    (with check_recipe's other refusals, exit 2 through the CLI above)."""
    net = types.SimpleNamespace(NAME="resnet50", MASKS=("drop_path",))
    step.check_recipe(net, recipes.parse("resnet50in_lambdp2"))
    with pytest.raises(ValueError, match="resnet50 has no classifier dropout; drop 'do'"):
        step.check_recipe(net, recipes.parse("resnet50in_lambdp2do"))
