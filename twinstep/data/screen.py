"""Images that do not read, each named once with its reason (docs/training.md#bad-images).

Before the first step `screen` reads every image of a folder's splits — its header (Pillow
identifies the format and reads the size: a few KB a file) or, with ``decode``, the whole image,
the test `twinstep pack` makes — and leaves out those that fail: the epoch counts the images
that read. An image that passes its header check yet fails to decode is met by the loader later
and replaced by the next image of its split (`twinstep.data.sources`). Both kinds are lines of
the run's ``skipped.txt`` (`Bad`; `read`, `text`), which a resumed run reads back instead of
screening again: its splits are the first attempt's, index for index, whatever the folder holds
now.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
from typing import NamedTuple

from twinstep.data import folder

# --check-images: how much of each image is read before the first step
CHECKS = {"headers": "each file's header (Pillow identifies it and reads its size)",
          "decode": "every image decoded whole, as 'twinstep pack' does",
          "none": "nothing: an image that fails is replaced where the loader meets it"}
DEFAULT_CHECK = "headers"
FILE = "skipped.txt"  # in RUN_DIR
LEFT_OUT, REPLACED = "left out", "replaced"
_HEADER = "# images that do not read, one a line: split, what was done, why, the image\n"
_THREADS = 16  # reading headers waits on the disk, not on a core
_PROGRESS_S = 10.0  # a long screen says how far it is on stderr this often


class Bad(NamedTuple):
    """An image that does not read: its split ("train", "val"), what was done (`LEFT_OUT` before
    the first step, `REPLACED` by the next image of its split where the loader met it), why,
    and its name (a path; a packed image's record)."""

    split: str
    action: str
    reason: str
    name: str


def screen(splits: tuple, check: str) -> tuple[tuple, list[Bad]]:
    """(``splits`` less the images that fail ``check`` (`CHECKS`), those images); a packed
    folder's splits as they are: packing read every image."""
    if check == "none" or not isinstance(splits[0], folder.Split):
        return splits, []
    decode = check == "decode"
    bad, total, done, last = [], sum(len(s) for s in splits), 0, time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
        for name, split in zip(folder.SPLITS, splits, strict=True):
            for path, why in zip(split.paths, pool.map(
                    lambda p: folder.problem(p, decode), split.paths), strict=True):
                done += 1
                if why is not None:
                    bad.append(Bad(name, LEFT_OUT, why, path))
                if time.monotonic() - last > _PROGRESS_S:
                    last = time.monotonic()
                    print(f"checking images ({check}): {done:,}/{total:,}", file=sys.stderr,
                          flush=True)
    return without(splits, bad), bad


def without(splits: tuple, bad: list[Bad]) -> tuple:
    """``splits`` less the images ``bad`` leaves out."""
    gone = {name: {b.name for b in bad if b.split == name and b.action == LEFT_OUT}
            for name in folder.SPLITS}
    return tuple(split.without(gone[name]) if gone[name] else split
                 for name, split in zip(folder.SPLITS, splits, strict=True))


def read(run_dir: str) -> list[Bad] | None:
    """The images ``run_dir``'s ``skipped.txt`` names, None where it has none (a run not yet
    started, or started by a twinstep that screened nothing)."""
    try:
        with open(os.path.join(run_dir, FILE)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    return [Bad(*line.split("\t", 3)) for line in lines
            if line and not line.startswith("#") and line.count("\t") >= 3]


def text(bad: list[Bad], header: bool = False) -> str:
    """``bad`` as lines of ``skipped.txt`` (tab-separated; ``header``: with the file's first
    line)."""
    return (_HEADER if header else "") + "".join(
        "\t".join(b._replace(reason=b.reason.replace("\t", " "))) + "\n" for b in bad)
