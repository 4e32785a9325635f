"""The command line: help, version, usage errors, and the certification end to end."""

import json
import subprocess
import sys

import pytest

from twinstep import __version__
from twinstep.cli import main, options
from twinstep.cli.main import COMMANDS
from twinstep.errors import ExitStatus


def run(*args):
    return subprocess.run([sys.executable, "-m", "twinstep.cli", *args], capture_output=True,
                          text=True, timeout=600)


def test_help_lists_commands(capsys):
    assert main([]) == 2
    assert "certify" in capsys.readouterr().out


def test_version():
    r = run("--version")
    assert r.returncode == 0 and __version__ in r.stdout


def test_bad_usage_exits_2():
    assert run("certify", "--replicas", "0").returncode == 2
    assert run("no-such-command").returncode == 2


@pytest.mark.process
def test_certify_end_to_end(tmp_path):
    png = tmp_path / "r.png"
    r = run("certify", "--replicas", "3", "--json", str(tmp_path / "r.json"), "--plot", str(png))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "certified" in r.stdout
    assert f"picture: {png}" in r.stdout and png.read_bytes()[:4] == b"\x89PNG"
    again = run("plot", str(tmp_path / "r.json"), "--out", str(tmp_path / "again.png"))
    assert again.returncode == 0 and (tmp_path / "again.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and all(c["caught"] for c in report["controls"])
    assert {c["check"] for c in report["checks"]} >= {
        "vjp vs jax.vjp", "vjp vs finite differences", "sharding", "collectives", "homogeneity",
        "divisor"}


def test_every_commands_help_gives_the_exit_statuses_of_the_one_table(capsys):
    """`twinstep.errors.ExitStatus` is the exit contract: every command's --help states what
    success means for it and bad usage, an internal error and an interrupt in that table's words,
    or its own (`twinstep.cli.options.exits`); tie's gives each verdict its status
    (`twinstep.checking.bounds.EXIT_CODES`). The docs' table is held to it in test_docs.py."""
    from twinstep.checking.bounds import EXIT_CODES

    for name in COMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        interrupted = ExitStatus.INTERRUPTED
        assert f"Exit {ExitStatus.SUCCESS:d} " in text, name
        assert f"{interrupted:d} {interrupted.meaning}" in text, name
        assert all(f", {s:d} " in text for s in (ExitStatus.USAGE, ExitStatus.INTERNAL)), name
        if name == "tie":
            assert all(f"{status} {verdict.lower()}" in text
                       for verdict, status in EXIT_CODES.items()), text


def test_a_status_outside_the_one_table_is_refused():
    """The control: a command's --help cannot give a status the table lacks."""
    assert options.exits({0: "done"}).startswith("Exit 0 done, 2 bad usage or input")
    with pytest.raises(ValueError):
        options.exits({0: "done", 5: "something else"})
