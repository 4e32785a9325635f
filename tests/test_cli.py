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


@pytest.mark.process
def test_every_commands_help_ends_with_an_example_that_parses(capsys):
    """Each command's --help ends with its example (`main.EXAMPLES`), and `twinstep --help` with
    the three commands to run first (`main.FIRST`); each parses as written. Its control: a
    made-up option in an example is refused by the parser (exit 2)."""
    import importlib
    import shlex

    cli = importlib.import_module("twinstep.cli.main")  # `main` here is its function

    def argv(line: str) -> list[str]:
        words = shlex.split(line.split("#")[0])
        assert words[0] == "twinstep", line
        return words[1:]

    assert set(cli.EXAMPLES) == set(COMMANDS)
    for name, example in cli.EXAMPLES.items():
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert capsys.readouterr().out.rstrip().endswith(f"example: {example}"), name
        words = argv(example)
        cli.build_parser(words).parse_args(words)  # exits 2 on a bad example
        with pytest.raises(SystemExit) as e:
            cli.build_parser(words).parse_args([words[0], "--no-such-option", *words[1:]])
        assert e.value.code == ExitStatus.USAGE
    assert main([]) == ExitStatus.USAGE
    out = capsys.readouterr().out
    for cmd, what in cli.FIRST:
        assert f"  {cmd}\n      {what}" in out
        cli.build_parser(argv(cmd)).parse_args(argv(cmd))


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


def test_training_progress_without_a_terminal_is_a_plain_line_every_s_seconds():
    """`train` under nohup or SLURM (stderr not a terminal): a plain line on stdout at the first
    step, then at most every S seconds, and at the last step; ETA from the steps since the
    first. Controls: S = 0 prints nothing, and steps within S of the last line print nothing."""
    import io

    from twinstep.cli.train import plain_progress

    clock = iter([100.0, 110.0, 131.0, 140.0, 150.0])
    out = io.StringIO()
    update = plain_progress(50, 30.0, out, clock=lambda: next(clock))
    m = {"epoch": 0.5, "loss": 2.25, "lr": 1e-3, "img_per_s": 64.0}
    for step in (1, 5, 12, 20):
        update(step, m)
    update(50, {**m, "phase": "evaluating"})  # an evaluation starting: no line
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/50", "12/50"]
    assert lines[1] == "step 12/50  epoch 0.50  loss 2.25  lr 0.001  64 img/s  ETA 0:01:47"
    last = io.StringIO()
    update = plain_progress(3, 30.0, last, clock=iter([0.0, 1.0, 2.0]).__next__)
    for step in (1, 2, 3):
        update(step, m)
    assert [line.split()[1] for line in last.getvalue().splitlines()] == ["1/3", "3/3"]
    first = io.StringIO()  # the first step of a run or a resumed one has no rate yet
    plain_progress(3, 30.0, first, clock=lambda: 0.0)(1, {**m, "img_per_s": 0.0})
    assert "lr 0.001  - img/s  ETA -" in first.getvalue(), first.getvalue()
    silent = io.StringIO()
    plain_progress(3, 0, silent, clock=lambda: 0.0)(1, m)
    assert silent.getvalue() == ""


@pytest.mark.process
def test_a_piped_report_keeps_its_lines_whole():
    """Where stdout is not a terminal (a log, a pipe) a report is `console.REPORT_WIDTH` columns
    wide, not rich's 80: a table row keeps every word on one line. Control: COLUMNS=70, which
    the user may set, wraps the same row."""
    import os

    line = ("rmsproptf (RMSProp (TF): α 0.9, ε 1e-3 inside the square root, momentum 0.9, lr in "
            "the momentum, square average from 1)")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    for columns, whole in ((None, True), ("70", False)):
        r = subprocess.run([sys.executable, "-m", "twinstep.cli", "recipe",
                            "efficientnetin_emarmsdp64dropdo"], capture_output=True, text=True,
                           env={**env, **({"COLUMNS": columns} if columns else {}),
                                "PYTHONIOENCODING": "utf-8"}, timeout=120)
        assert r.returncode == 0 and (line in r.stdout) == whole, r.stdout
