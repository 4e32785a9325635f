"""The one error type for bad usage or input: the CLI turns it into one line on stderr and exit
status 2, the Python API raises it as is. Everything else that goes wrong is an internal or
environment error (exit 3)."""


# The exit statuses of every command, the contract's one table (README's "Exit status" gives
# each at length; every command's --help is built from this, `twinstep.cli.options.exits`)
EXIT_STATUSES = {0: "success", 1: "a check failed", 2: "bad usage or input",
                 3: "an internal or environment error", 4: "inconclusive", 130: "interrupted"}
ALWAYS = (2, 3, 130)  # what any command may end with


class UsageError(ValueError):
    """A request that cannot be done as asked: bad name, option, file or combination."""


class ClusterError(RuntimeError):
    """The multi-process runtime could not be joined (a coordinator port taken, a process that
    never came): an environment error, exit 3 in one line."""


class BackendError(RuntimeError):
    """An optional backend (IREE, the [iree] extra) is missing or failed on a program, or XLA
    refuses its flags: an environment error, exit 3 in one line."""


class RenderError(UsageError):
    """A render that cannot be made, or read back, as asked (a bad name, resolution or replica
    count; a manifest or file that is not what the set says): exit 2 in one line."""
