"""The exit statuses of every command (`ExitStatus`, the contract's one table) and the one error
type for bad usage or input: the CLI turns a `UsageError` into one line on stderr and
`ExitStatus.USAGE`, the Python API raises it as is. Everything else that goes wrong is an
internal or environment error (`ExitStatus.INTERNAL`)."""

import enum


class ExitStatus(enum.IntEnum):
    """Every command's exit statuses, each with its meaning: the one table. Every command's
    --help is built from it (`twinstep.cli.options.exits`), and docs/cli.md#exit-status gives
    each at length, held to it by tests/test_docs.py."""

    meaning: str

    def __new__(cls, status: int, meaning: str):
        member = int.__new__(cls, status)
        member._value_ = status
        member.meaning = meaning
        return member

    SUCCESS = 0, "success"
    FAILED = 1, "a check failed"
    USAGE = 2, "bad usage or input"
    INTERNAL = 3, "an internal or environment error"
    INCONCLUSIVE = 4, "inconclusive"
    INTERRUPTED = 130, "interrupted"


EXIT_STATUSES = {int(s): s.meaning for s in ExitStatus}  # status -> its meaning
ALWAYS = (ExitStatus.USAGE, ExitStatus.INTERNAL, ExitStatus.INTERRUPTED)  # any command's


class UsageError(ValueError):
    """A request that cannot be done as asked: bad name, option, file or combination."""


class ClusterError(RuntimeError):
    """The multi-process runtime could not be joined (a coordinator port taken, a process that
    never came): an environment error (`ExitStatus.INTERNAL`) in one line."""


class BackendError(RuntimeError):
    """An optional backend (IREE, the [iree] extra) is missing or failed on a program, or XLA
    refuses its flags: an environment error (`ExitStatus.INTERNAL`) in one line."""


class RenderError(UsageError):
    """A render that cannot be made, or read back, as asked (a bad name, resolution or replica
    count; a manifest or file that is not what the set says): `ExitStatus.USAGE` in one line."""
