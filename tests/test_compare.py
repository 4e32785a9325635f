"""Runs compared image by image (twinstep.training.stats, .compare; `twinstep compare`): the
interval against scipy's Wilson interval, McNemar's test against scipy's exact binomial test,
the refusals, and two digits runs of another seed (no significant difference) against a run
whose learning rate is 0 (significant).
"""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from twinstep.errors import UsageError
from twinstep.training import compare, run_log
from twinstep.training.stats import ALPHA, interval, mcnemar


@pytest.mark.parametrize("correct,images", [(0, 300), (1, 300), (289, 300), (300, 300),
                                            (37_812, 50_000), (3, 7)])
def test_the_interval_is_wilsons(correct, images):
    """Against scipy's Wilson score interval to 1e-12; the control, the normal-approximation
    (Wald) interval, is at least 1e-3 away wherever it differs in kind (near 0 and 1)."""
    want = scipy_stats.binomtest(correct, images).proportion_ci(method="wilson")
    assert interval(correct, images) == pytest.approx((want.low, want.high), abs=1e-12)
    p = correct / images
    wald = p + 1.959963984540054 * np.sqrt(p * (1 - p) / images) * np.array([-1, 1])
    if correct in (0, 1, images) or images < 10:
        assert max(abs(wald - interval(correct, images))) > 1e-3


def test_mcnemar_is_the_exact_binomial_test_on_the_discordant_images():
    """p against scipy's two-sided exact binomial test of min(b, c) of b + c at 1/2 (to 1e-12,
    b + c up to 5,000), and b, c as counted; a (10, 0) split is 2 / 2^10."""
    rng = np.random.default_rng(0)
    for n, flip in ((300, 0.02), (300, 0.1), (10_000, 0.3), (50, 0.0)):
        a = rng.random(n) < 0.8
        b = a ^ (rng.random(n) < flip)
        only_a, only_b, p = mcnemar(a, b)
        assert (only_a, only_b) == (int((a & ~b).sum()), int((b & ~a).sum()))
        want = 1.0 if only_a + only_b == 0 else scipy_stats.binomtest(
            min(only_a, only_b), only_a + only_b, 0.5).pvalue
        assert p == pytest.approx(want, rel=1e-12, abs=1e-300)
    a, b = np.ones(20, bool), np.ones(20, bool)
    b[:10] = False
    assert mcnemar(a, b) == (10, 0, pytest.approx(2 / 2**10, rel=1e-12))


def _fake_run(run_dir, steps, hits: dict, val="v1"):
    with run_log.RunLog(str(run_dir)) as log:
        for step in steps:
            log.train({"step": step, "epoch": 0.0, "loss": 1.0, "lr": 0.1, "img_per_s": 1.0})
            top1 = float(np.mean(hits["raw"]))
            log.eval(step, {name: {"loss": 1.0, "top1": top1, "top5": 1.0} for name in hits})
            log.correct(step, hits, val)


def test_runs_on_different_val_splits_or_without_a_common_step_are_refused(tmp_path, capsys):
    hits = {"raw": np.arange(10) % 2 == 0}
    _fake_run(tmp_path / "a", [5, 10], hits)
    _fake_run(tmp_path / "b", [5], hits)
    _fake_run(tmp_path / "c", [10], hits, val="v2")
    _fake_run(tmp_path / "d", [7], hits)
    a, b, c, d = (str(tmp_path / x) for x in "abcd")
    assert compare.compare([a, b])["step"] == 5  # the last step both have
    with pytest.raises(UsageError, match="another val split"):
        compare.compare([a, c])
    with pytest.raises(UsageError, match="share no evaluation step"):
        compare.compare([a, d])
    with pytest.raises(UsageError, match="no ema weights"):
        compare.compare([a, b], "ema")
    with pytest.raises(UsageError, match="not a `twinstep train` run"):
        compare.compare([a, str(tmp_path)])
    # the command: the table and the PNG, or one line and exit 2
    from twinstep.cli.main import main

    png = str(tmp_path / "c.png")
    assert main(["compare", a, b, "--out", png]) == 0
    out = capsys.readouterr().out
    assert "B − A: +0.00 points; right only in A: 0, only in B: 0; McNemar exact p = 1" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", a, c]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another val split" in err


@pytest.mark.slow
@pytest.mark.all  # ~2 min: three runs; make test holds a run's hits to its log (test_train.py)
def test_two_seeds_do_not_differ_significantly_and_an_lr_of_0_does(tmp_path, monkeypatch,
                                                                   capsys):
    """Three digits runs (MobileNetV4, 32², R = 1, N = 32, 100 steps of AdamW): seeds 0 and 1,
    and seed 0 with every learning rate 0 (a crippled run, BN statistics still moving). The
    seeds' difference is not significant at 0.05; the crippled run's is, both ways round; the
    CLI prints the table and writes the PNG."""
    import jax.numpy as jnp

    from twinstep import api, optim
    from twinstep.cli.main import main

    common = {"steps": 100, "eval_every": 50, "ckpt_every": 100, "fast_compile": True}
    runs = [str(tmp_path / name) for name in ("seed0", "seed1", "lr0")]
    api.train("mnv4in_adam", runs[0], seed=0, **common)
    api.train("mnv4in_adam", runs[1], seed=1, **common)
    monkeypatch.setattr(optim, "lr_schedule", lambda *a, **k: (
        lambda count: jnp.zeros((), jnp.result_type(float))))
    api.train("mnv4in_adam", runs[2], seed=0, **common)
    seeds, crippled = compare.compare(runs[:2]), compare.compare([runs[0], runs[2]])
    with capsys.disabled():
        print(compare.report(seeds), compare.report(crippled), sep="\n")
    assert seeds["step"] == 100 and seeds["images"] == 300
    assert seeds["pairs"][0]["p"] >= ALPHA
    assert crippled["pairs"][0]["p"] < ALPHA and crippled["pairs"][0]["diff"] < 0
    assert compare.compare([runs[2], runs[0]])["pairs"][0]["p"] < ALPHA
    png = str(tmp_path / "c.png")
    assert main(["compare", *runs, "--out", png]) == 0
    out = capsys.readouterr().out
    assert "McNemar exact p" in out and "significant at 0.05" in out
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
