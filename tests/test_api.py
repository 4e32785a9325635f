"""The Python API: README's examples run as written, in a fresh process; a bad configuration is
refused before anything compiles, with the CLI's one-line message; and a process whose JAX has
already started with too few devices gets a one-line error, never a silently smaller tie."""

import os
import re
import subprocess
import sys

import pytest

import twinstep
from twinstep import cli

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _fresh_env():
    """A child process that starts JAX itself (no inherited device count or x64)."""
    env = dict(os.environ)
    for name in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS", "JAX_ENABLE_X64"):
        env.pop(name, None)
    return env


def python_api_examples() -> list[str]:
    text = open(README).read()
    section = text.split("## Python API", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_readme_has_a_python_api_example():
    (example,) = python_api_examples()
    assert "twinstep.tie(" in example and len(example.strip().splitlines()) <= 10


@pytest.mark.slow
def test_readme_python_api_example_runs():
    """The example ties ResNet-18 at R = 2 and shows the unsynced control caught (its asserts
    are the claims)."""
    (example,) = python_api_examples()
    p = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                       env=_fresh_env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert p.stdout.startswith("tied: 62/62 parameters, 20/20 BN sites")


@pytest.mark.parametrize("config, argv, message", [
    ({"res": 30}, ["--res", "30"], "multiple of 32"),
    ({"precision": "bf16", "replicas": 3}, ["--precision", "bf16", "--replicas", "3"],
     "power of two"),
    ({"control": "replicated-masks"}, ["--control", "replicated-masks"], "needs --recipe"),
    ({"classes": 1}, ["--classes", "1"], "--classes must be >= 2"),
])
def test_api_and_cli_refuse_alike_before_compiling(config, argv, message, capsys):
    with pytest.raises(twinstep.UsageError, match=re.escape(message)) as e:
        twinstep.tie("resnet50", **config)
    assert cli.main(["tie", "resnet50", *argv]) == 2
    assert capsys.readouterr().err == f"twinstep tie: {e.value}\n"


def test_too_few_devices_is_one_line_not_a_smaller_tie():
    code = ("import jax; jax.devices()\n"  # JAX starts first, with one CPU device
            "import twinstep\n"
            "try:\n"
            "    twinstep.tie('resnet50', replicas=2)\n"
            "except twinstep.UsageError as e:\n"
            "    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=_fresh_env(), timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("2 replicas need 2 devices and JAX has 1")
    assert "JAX_NUM_CPU_DEVICES=2" in p.stdout and p.stdout.count("\n") == 1


def test_unknown_names_are_usage_errors():
    with pytest.raises(twinstep.UsageError, match="unknown net"):
        twinstep.get_net("vgg")
    with pytest.raises(twinstep.UsageError, match="unknown token 'foo'"):
        twinstep.parse_recipe("resnet50in_lambfoo")
    with pytest.raises(twinstep.UsageError, match="--replicas must be >= 1"):
        twinstep.render("rsb-a1", replicas=0)


def test_a_recipe_is_parsed_once_per_tie(monkeypatch, capsys):
    """`twinstep tie --recipe` reads its recipe name once: the tie's config parses it on
    construction and every later reader takes that (`TieConfig.parsed_recipe`), its net
    included. Control: a config made twice, as the tie once rebuilt it, parses twice."""
    from twinstep import recipes
    from twinstep.checking import tie, trajectory

    parsed = []
    real = recipes.parse
    monkeypatch.setattr(recipes, "parse", lambda name: parsed.append(name) or real(name))
    seen = {}

    def stand_in(cfg, steps, progress=None, **_):  # the steps' tie, as far as its recipe goes
        seen.update(net=cfg.net, recipe=cfg.parsed_recipe())
        raise KeyboardInterrupt  # stop here: nothing compiles

    monkeypatch.setattr(trajectory, "run_steps_tie", stand_in)
    assert cli.main(["tie", "--recipe", "mnv4in_adamdp2", "--replicas", "2"]) == 130
    assert parsed == ["mnv4in_adamdp2"] and seen["net"] == "mnv4"
    assert seen["recipe"] == real("mnv4in_adamdp2")
    parsed.clear()
    tie.TieConfig(recipe="mnv4in_adamdp2"), tie.TieConfig(recipe="mnv4in_adamdp2")
    assert len(parsed) == 2
    capsys.readouterr()
