"""bench/first_hour.py, the README's first hour as a script: its checks against the mutants they
claim to catch (make test), and the walk run whole at a tiny size (make test-all)."""

import copy

import pytest

from bench import first_hour

KILL = 100


def _walked() -> dict:
    """What a correct walk reports: 4 bad files left out at once, the truncated one met at step
    20, the kill after the step-100 checkpoint, timm equal to twinstep, bicubic not."""
    named = [f"train\tleft out\twhy\tdata/train/{n}" for n in first_hour.BAD]
    return {"killed": [(1, 4), (10, 4), (20, 5), (100, 5)],
            "final": [(1, 4), (10, 4), (20, 5), (100, 5), (110, 5), (300, 5)],
            "skipped_txt": [*named, f"train\treplaced\twhy\tdata/train/{first_hour.TRUNCATED}"],
            "log3": ["twinstep train: run already finished at step 300; …"],
            "eval": {"top1": 0.42, "loss": 1.6864208}}


TIMM = {"exported": (0.42, 1.6864210), "bicubic": (0.4133, 1.688640)}


def test_the_first_hours_checks_hold_on_a_correct_walk_and_catch_each_mutant():
    assert first_hour.checks(_walked(), TIMM, KILL) == []
    mutants = {
        # hits counted, not distinct files: the truncated file met again each epoch
        "hits": lambda o, t: o["final"].append((310, 6)),
        # the counter restarted on resume
        "restart": lambda o, t: o["final"].__setitem__(4, (110, 1)),
        "unnamed": lambda o, t: o["skipped_txt"].pop(),
        "finished silently": lambda o, t: o["log3"].clear(),
        "timm disagrees": lambda o, t: t.__setitem__("exported", (0.42, 1.6865)),
        "blind control": lambda o, t: t.__setitem__("bicubic", (0.42, 1.6864209)),
    }
    for name, mutate in mutants.items():
        walked, timm = _walked(), copy.deepcopy(TIMM)
        mutate(walked, timm)
        assert first_hour.checks(walked, timm, KILL), f"mutant {name!r} passed the checks"


@pytest.mark.all
@pytest.mark.slow
@pytest.mark.process
@pytest.mark.oracle
def test_the_first_hour_runs_whole_at_a_tiny_size(tmp_path, capsys):
    assert first_hour.main(["--steps", "12", "--kill-after", "6", "--res", "32",
                            "--no-results", "--dir", str(tmp_path)]) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "| timm, bicubic |" in printed and "already finished" in printed
