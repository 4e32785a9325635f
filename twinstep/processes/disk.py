"""Writing results so that they are whole or absent: every file goes to a temporary file in its
folder first and is renamed into place, so an interrupt, a kill or a full disk leaves no
partial file (and a set of files is renamed only once every one of them is written)."""

from __future__ import annotations

import fcntl
import io
import os
import tempfile

from twinstep.errors import UsageError

# An interrupt that arrives while files are being published waits until they are (see
# twinstep.cli.entry, whose SIGINT handler reads these).
publishing = 0
interrupted = False


def publish(blobs: dict[str, bytes], lock: str | None = None) -> None:
    """Write {path: bytes}: all to temporary files, then all renamed into place, in order (put
    the file that vouches for the others last). ``lock``: a file held exclusively meanwhile, so
    that two processes publishing the same set do not interleave."""
    if lock is not None:
        held = _hold(lock)
        try:
            return publish(blobs)
        finally:  # removed while held: nothing is left, and a waiter sees it gone (`_hold`)
            os.unlink(lock)
            held.close()
    global publishing, interrupted
    umask = os.umask(0)
    os.umask(umask)
    temps = {}
    publishing += 1
    try:
        for path, blob in blobs.items():
            fd, temps[path] = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                               prefix=".twinstep-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.chmod(temps[path], 0o666 & ~umask)  # mkstemp's 0600 -> what open() makes
        for path, tmp in temps.items():
            os.replace(tmp, path)
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
        publishing -= 1
    if interrupted and not publishing:
        interrupted = False
        raise KeyboardInterrupt


def _hold(lock: str):
    """``lock`` opened and locked exclusively; retried while the file locked is not the one at
    the path (its holder removed it before releasing it)."""
    while True:
        held = open(lock, "a")
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            if os.stat(lock).st_ino == os.fstat(held.fileno()).st_ino:
                return held
        except FileNotFoundError:
            pass
        held.close()


def check_writable_file(path: str, flag: str) -> None:
    """Refuse, before any work, a file path that cannot be written (UsageError, one line)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path}: not a file in an existing, writable folder")


def check_writable_folder(path: str, flag: str) -> None:
    """Refuse, before any work, a folder that is a file or cannot be created or written."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: a file, not a folder")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise UsageError(f"{flag} {path}: {existing} cannot be written")


def png_figure(path: str, flag: str, size: tuple):
    """A matplotlib Figure of ``size`` inches to be written to ``path`` by `publish_png`, once
    ``path`` (given as ``flag``) is checked a writable .png (UsageError, one line). matplotlib's
    object API with the Agg canvas: no pyplot, so no global backend is switched in a caller's
    process (a notebook's, say)."""
    if not path.lower().endswith(".png"):
        raise UsageError(f"{flag} {path}: a .png file name")
    check_writable_file(path, flag)
    # lazy: matplotlib (~1 s to import) only for a figure; every command imports this module
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size)
    FigureCanvasAgg(fig)
    return fig


def publish_png(fig, path: str) -> str:
    """Write ``fig`` to ``path`` as a PNG, whole or not at all; returns ``path``."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    publish({path: png.getvalue()})
    return path
