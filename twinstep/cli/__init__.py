"""The ``twinstep`` command line: one module per command (``add`` fills its parser, ``run`` does
it through `twinstep.api`), the shared options, and `main` (the command table, the exit status
contract)."""

from twinstep.cli.main import entry, main

__all__ = ["entry", "main"]
