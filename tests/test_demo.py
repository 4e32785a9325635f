"""`make demo`'s ties (the Makefile's demo-ties target): every net and loss is tied, only the
verdict lines are printed, and a tie that is NOT tied (exit 1) or inconclusive (exit 4) fails
the target with one line naming its net, loss and verdict. The ties are run by a fake twinstep
(`TWINSTEP=...`), a shell script, so nothing here needs JAX or a network; `-o` keeps make from
installing into .venv.
"""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIES = [f"tie {net} --loss {loss}" for net in ("resnet50", "mnv4") for loss in ("ce", "bce")]


def _fake_twinstep(tmp_path, failing: str = "", verdict: str = "", status: int = 0) -> str:
    """A twinstep that logs its arguments, prints a report (a table row, then a verdict line)
    and exits 0 with "tied: ..." — except for the tie `failing` ("NET LOSS"), which ends with
    `verdict` and exits `status`."""
    script = tmp_path / "twinstep"
    script.write_text(f"""#!/bin/sh
echo "$*" >> "{tmp_path / 'calls'}"
echo "| table row of $2 $4 |"
if [ "$2 $4" = "{failing}" ]; then echo "{verdict}: 3/130 parameters ($2 $4)"; exit {status}; fi
echo "tied: 130/130 parameters ($2 $4)"
""")
    script.chmod(0o755)
    return str(script)


def _demo_ties(twinstep: str) -> subprocess.CompletedProcess:
    # the outer make's flags and variables (`make test ARGS=...`) stay out of this one
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-s", "--no-print-directory", "-C", ROOT,
                           "-o", ".venv/.installed-base", "demo-ties", f"TWINSTEP={twinstep}"],
                          capture_output=True, text=True, env=env, timeout=60)


def test_demo_ties_print_each_verdict_and_succeed_when_every_tie_is_tied(tmp_path):
    """Every net and loss is tied once, in order; the output is each tie's heading and its
    verdict line, never the report above it; make exits 0. The control for the failures below."""
    done = _demo_ties(_fake_twinstep(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "calls").read_text().splitlines() == TIES
    expected = []
    for tie in TIES:
        _, net, _, loss = tie.split()
        expected += [f"== twinstep {tie}", f"tied: 130/130 parameters ({net} {loss})"]
    assert done.stdout.splitlines() == expected
    assert done.stderr == ""


@pytest.mark.parametrize(("verdict", "status"), [("NOT tied", 1), ("inconclusive", 4)])
def test_demo_ties_fail_naming_the_tie_that_is_not_tied(tmp_path, verdict, status):
    """One tie (MobileNetV4 under BCE) NOT tied or inconclusive: every tie still runs and prints
    its verdict, and make fails with one line naming that net, loss and verdict, and no other.
    Control: the same fake with every tie tied exits 0 (above)."""
    done = _demo_ties(_fake_twinstep(tmp_path, "mnv4 bce", verdict, status))
    assert done.returncode != 0
    assert (tmp_path / "calls").read_text().splitlines() == TIES
    assert f"{verdict}: 3/130 parameters (mnv4 bce)" in done.stdout.splitlines()
    named = [line for line in done.stderr.splitlines() if "mnv4 --loss bce" in line]
    assert len(named) == 1, done.stderr
    assert f"mnv4 --loss bce: {verdict} (exit {status})" in named[0]
    assert "resnet50" not in done.stderr and "--loss ce" not in done.stderr
