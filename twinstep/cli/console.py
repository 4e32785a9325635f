"""What every command prints with: rich on stdout for reports (the verdict last, on one line,
which scripts read), and on stderr, only on a terminal, what a long command is doing now."""

from __future__ import annotations

import codecs
import contextlib
import os
import sys

from rich.console import Console

COLOURS = {"tied": "green", "NOT tied": "red", "inconclusive": "yellow"}  # a tie's status
# a report's width where stdout is not a terminal (a log, a pipe), unless COLUMNS says: rich's
# default there, 80 columns, cut a tie's numbers and names to "5.3e…"
REPORT_WIDTH = 200


def report_console() -> Console:
    """The console a command's report prints on: stdout, as wide as the terminal; where stdout
    is not one, `REPORT_WIDTH` columns (or COLUMNS), so piped tables keep every digit."""
    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(width=REPORT_WIDTH)


# what a report's non-ASCII characters become on a console that cannot show them (any other: ?)
ASCII = {"β": "beta", "λ": "lambda", "ε": "eps", "²": "^2", "³": "^3", "×": "x", "·": ".",
         "—": "-", "–": "-", "−": "-", "…": "...", "≤": "<=", "≥": ">=", "≈": "~", "±": "+/-",
         "→": "->", "√": "sqrt", "⌈": "ceil(", "⌉": ")", "⌊": "floor(", "⌋": ")", "°": " deg"}


def _spell(error: UnicodeEncodeError):
    bad = error.object[error.start:error.end]
    return "".join(ASCII.get(c, "?") for c in bad), error.end


def ascii_fallback() -> None:
    """Let stdout and stderr print what they cannot encode (PYTHONIOENCODING=ascii, a C locale)
    in ASCII spellings (`ASCII`) instead of failing: a report reads the same, plainer."""
    codecs.register_error("twinstep-ascii", _spell)
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "β²×—".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors="twinstep-ascii")


def mark(ok: bool) -> str:
    return "[green]ok[/]" if ok else "[red]FAIL[/]"


def verdict_line(console: Console, status: str, verdict: str, seconds: float | None) -> None:
    """The last line of a tie's report: its verdict in its status's colour, unwrapped."""
    took = f" ({seconds:.0f} s)" if seconds is not None else ""
    console.print(f"[{COLOURS[status]}]{verdict}[/]{took}", soft_wrap=True)


@contextlib.contextmanager
def status(first: str, quiet: bool = False):
    """A spinner on stderr saying what runs now; yields ``say(text)`` to change it (a no-op
    when ``quiet`` or stderr is not a terminal, so logs and pipes stay clean)."""
    console = Console(stderr=True)
    if quiet or not console.is_terminal:
        yield lambda text: None
        return
    with console.status(first) as spinner:
        yield lambda text: spinner.update(text)
