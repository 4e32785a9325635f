"""The command line: help, version, usage errors, and the certification end to end."""

import json
import os
import subprocess
import sys

import pytest

from twinstep import __version__
from twinstep.cli import main
from twinstep.cli.main import COMMANDS
from twinstep.errors import EXIT_STATUSES


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
    """`twinstep.errors.EXIT_STATUSES` is the exit contract: every command's --help states what
    0 means for it and 2, 3, 130 in that table's words, or its own (`twinstep.cli.options
    .exits`), and the README's table gives each status with its meaning first."""
    for name in COMMANDS:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Exit 0 " in text and f"130 {EXIT_STATUSES[130]}" in text, name
        assert all(f", {s} " in text for s in (2, 3)), name
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    rows = {int(line.split("|")[1]): line.split("|")[2].strip() for line in readme.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert set(rows) == set(EXIT_STATUSES)
    assert all(rows[s].startswith(meaning) for s, meaning in EXIT_STATUSES.items()), rows
