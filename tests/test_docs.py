"""The docs held to the code: command lines parse, cited measurements are where they point, the
exit statuses are the code's."""

import contextlib
import glob
import io
import os
import re
import shlex

from twinstep.cli.main import COMMANDS, build_parser
from twinstep.errors import EXIT_STATUSES, ExitStatus

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT)
                             for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# a synopsis's placeholders, as values its options take (the others are any string)
PLACEHOLDERS = {"R": "2", "N": "2", "S": "2", "K": "10", "P": "2", "Q": "90", "I": "0",
                "NET": "resnet50", "NAME": "resnet50in_lambdp", "RECIPE": "resnet50in_lambdp",
                "C": "sum", "HOST:PORT": "localhost:1234"}


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def command_lines(text: str) -> list[str]:
    """The ``twinstep ...`` command lines of a Markdown text: lines of its code blocks and its
    inline code spans, continuation lines joined."""
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("twinstep "):
                lines.append(line)
    lines += [" ".join(m.split()) for m in re.findall(r"`(twinstep [^`]+)`", text)]
    return lines


def argv_of(line: str) -> list[str] | None:
    """The argument list a command line (or a synopsis: [optional] parts taken, the first of
    A|B, placeholders as values) stands for; None for one that is not a command (an error
    message quoted, a placeholder command). Options a line leaves out are not asked for."""
    line = line.replace("\\|", "|").replace("[", " ").replace("]", " ")
    line = re.sub(r"\s(\.\.\.|…)(?=\s|$)", " ", line)
    words = shlex.split(line, comments=True)[1:]
    if not words or words[0].endswith(":") or words[0] in ("COMMAND", "--debug"):
        return None
    return [PLACEHOLDERS.get(w.split("|")[0], w.split("|")[0]) for w in words]


def refused(argv: list[str]) -> str | None:
    """Why the CLI's parser refuses ``argv`` (its one line), or None. A command named alone is a
    mention in prose: only its name is checked."""
    if len(argv) == 1:
        return None if argv[0] in COMMANDS else f"no command {argv[0]!r}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            build_parser(argv).parse_args(argv)
    except SystemExit:
        line = said.getvalue().strip()
        # a fragment in prose leaves out what it does not discuss
        return None if "arguments are required" in line else line
    return None


def test_every_command_line_in_the_docs_parses(capsys):
    """Every ``twinstep ...`` line of the README and docs/ (a code block's line or an inline
    span; a synopsis with its optional parts and placeholders filled) parses as the CLI parses
    it: the command and its options exist and take those values."""
    wrong, checked = [], 0
    for path in DOCS:
        for line in command_lines(_read(path)):
            argv = argv_of(line)
            if argv is not None:
                checked += 1
                why = refused(argv)
                if why:
                    wrong.append(f"{path}: {line!r}: {why}")
    capsys.readouterr()
    assert checked > 80 and not wrong, "\n".join(wrong)


def test_a_command_line_the_cli_refuses_fails_here(capsys):
    """The control: a retired option and a bad value do not parse."""
    for line in ("twinstep tie resnet50 --artifact x.jaxexport", "twinstep tie NET --replicas x",
                 "twinstep export RUN_DIR", "twinstep export"):
        assert refused(argv_of(line)), line
    assert refused(argv_of("twinstep tie NET [--replicas R]")) is None
    capsys.readouterr()


def sections(text: str) -> dict[str, str]:
    """A Markdown text's ## and ### sections by their GitHub anchor."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", parts[i].lstrip("#").strip().lower()).replace(" ", "-"):
            parts[i + 1] for i in range(1, len(parts), 2)}


# a measurement cited in prose: a number with its unit
MEASURED = re.compile(r"(?<![\w.−-])(\d[\d,]*(?:\.\d+)?)\s*(img/s|×|%|ms\b|s\b|GiB|MiB)")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def found_in(cited: str, unit: str, section: str) -> bool:
    """Whether the section holds ``cited`` (as written, or rounded to its digits; a % also as a
    ratio's distance from 1)."""
    digits = len(cited.split(".")[1]) if "." in cited else 0
    x = float(cited.replace(",", ""))
    values = [float(v.replace(",", "")) for v in NUMBER.findall(section)]
    if unit == "%":
        values += [abs(v - 1) * 100 for v in values if v < 10]
    if unit == "GiB":  # from a table in MiB
        values += [v / 1024 for v in values]
    return any(round(v, digits) == x for v in values)


def citations(text: str):
    """(section link, number, unit) for each measurement in a paragraph that links exactly one
    RESULTS.md section."""
    for para in re.split(r"\n\s*\n", text):
        links = set(re.findall(r"((?:bench/)?(?:probes/)?RESULTS\.md)#([\w\-]+)", para))
        if len(links) == 1:
            (results, anchor), = links
            for m in MEASURED.finditer(para):
                yield results, anchor, m.group(1), m.group(2)


def test_every_measurement_the_docs_cite_is_in_the_section_they_cite():
    """A number with a unit (img/s, ×, %, ms, s, GiB, MiB) in a paragraph of the README or
    docs/ that links one section of bench/RESULTS.md or bench/probes/RESULTS.md is in that
    section (rounded to the digits cited): a table re-run and a paragraph left behind fails,
    as does a number moved to its section's history (`bench/history/`), where the paragraph
    should then point."""
    results = {"bench": sections(_read("bench/RESULTS.md")),
               "probes": sections(_read("bench/probes/RESULTS.md"))}
    wrong = []
    for path in DOCS:
        for link, anchor, cited, unit in citations(_read(path)):
            table = results["probes" if "probes" in link or "probes" in path else "bench"]
            if anchor not in table:
                wrong.append(f"{path}: #{anchor} is not a section")
            elif not found_in(cited, unit, table[anchor]):
                wrong.append(f"{path}: {cited} {unit} is not in #{anchor}")
    assert not wrong, "\n".join(wrong)


def test_a_number_not_in_its_section_fails_here():
    """The control: a cited number its section lacks, and one off by a digit, are caught; a
    rounding and a ratio's percent are not."""
    section = "| a | 1.036 | 3.88x | 6,110 |"
    assert found_in("3.9", "×", section) and found_in("3.6", "%", section)
    assert found_in("6,110", "img/s", section) and found_in("5.97", "GiB", section)
    assert not found_in("6,111", "img/s", section) and not found_in("4.1", "×", section)
    para = "On a GPU, 7,950 img/s ([x](bench/RESULTS.md#gpu))."
    assert list(citations(para)) == [("bench/RESULTS.md", "gpu", "7,950", "img/s")]


def table_rows(section: str) -> list[list[str]]:
    """The cells of a Markdown section's table rows, its header and rule left out."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    return rows[2:]


def exit_table_wrong(text: str) -> list[str]:
    """How docs/cli.md's table of exit statuses (``text``, the page) differs from
    `twinstep.errors.ExitStatus`: each status, its name and its meaning in the code's order; the
    last column is the docs' own."""
    section = sections(text).get("exit-status", "")
    said = [tuple(r[:3]) for r in table_rows(section)]
    code = [(str(int(s)), f"`{s.name}`", s.meaning) for s in ExitStatus]
    wrong = [f"docs/cli.md: row {r} is not the code's" for r in said if r not in code]
    wrong += [f"docs/cli.md: no row {c}" for c in code if c not in said]
    if not wrong and said != code:
        wrong.append("docs/cli.md: the rows are not the code's, one each in its order")
    return wrong


def test_the_docs_table_of_exit_statuses_is_the_codes():
    """docs/cli.md#exit-status is the one table of exit statuses in prose, and it says what
    `twinstep.errors.ExitStatus` says (status, name, meaning, in order); the README and
    docs/tie.md point to it instead of restating it: no other page has a table of statuses,
    and the README links it."""
    wrong = exit_table_wrong(_read("docs/cli.md"))
    assert not wrong, "\n".join(wrong)
    tables = [path for path in DOCS if re.search(r"^\| status \|", _read(path), re.M)]
    assert tables == [os.path.join("docs", "cli.md")], tables
    assert "(docs/cli.md#exit-status)" in _read("README.md")
    assert "(cli.md#exit-status)" in sections(_read("docs/tie.md"))["exit-status"]


def test_the_ties_statuses_in_the_docs_are_its_verdicts():
    """docs/tie.md#exit-status gives each verdict the status `twinstep tie` exits with
    (`twinstep.checking.bounds.EXIT_CODES`), and each is in the one table."""
    from twinstep.checking.bounds import EXIT_CODES

    rows = table_rows(sections(_read("docs/tie.md"))["exit-status"])
    said = {re.sub(r"\[(.*?)\]\(.*?\)", r"\1", verdict): int(status) for verdict, status in rows}
    assert said == EXIT_CODES and set(said.values()) <= set(EXIT_STATUSES), said


def test_an_exit_table_that_is_not_the_codes_fails_here():
    """The control: a row with another meaning, a status missing, a status renamed and two rows
    swapped are each caught; the table as the code has it is not."""
    rows = [f"| {s:d} | `{s.name}` | {s.meaning} | more |" for s in ExitStatus]
    page = "## Exit status\n\n| status | `ExitStatus` | meaning | more |\n|---|---|---|---|\n"
    assert not exit_table_wrong(page + "\n".join(rows))
    for wrong in (rows[:1] + ["| 1 | `FAILED` | a test failed | more |"] + rows[2:], rows[:-1],
                  [r.replace("`USAGE`", "`BAD_USAGE`") for r in rows],
                  [rows[1], rows[0], *rows[2:]]):
        assert exit_table_wrong(page + "\n".join(wrong)), wrong
