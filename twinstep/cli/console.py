"""What every command prints with: rich on stdout for reports (the verdict last, on one line,
which scripts read), and on stderr, only on a terminal, what a long command is doing now."""

from __future__ import annotations

import contextlib

from rich.console import Console

COLOURS = {"tied": "green", "NOT tied": "red", "inconclusive": "yellow"}  # a tie's status


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
