"""An image folder in torchvision's ImageFolder layout: ``DIR/train/<class>/<image>`` and
``DIR/val/<class>/<image>``, any depth below the class folder.

Classes are the class folders' names sorted as Python sorts strings, and files are listed as
torchvision's `ImageFolder` lists them (folders walked in sorted order, files sorted, an
extension from `EXTENSIONS` in any case), so label k means what it means to a timm user of the
same folder. Other files are ignored. A class folder with no image is refused, as torchvision
refuses it.

An image that cannot be decoded (corrupt, truncated, not an image behind an image extension) is
not fatal: `problem` says why, the trainer leaves it out before its first step
(`twinstep.data.screen`), and one found only later — `load` returns None for it — is replaced by
the next image of its split (`twinstep.data.sources`). A folder without ``val/`` can hold one
out of ``train/`` instead (`scan_both`'s ``val_split``: by a hash of each file's path).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings

import numpy as np
from PIL import Image

from twinstep.errors import UsageError

# what Pillow raises for a file it cannot read or decode
UNDECODABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """One split: ``paths[i]`` is an image of class ``labels[i]`` (an index into ``classes``)."""

    classes: tuple[str, ...]
    paths: tuple[str, ...]
    labels: np.ndarray  # [n] int32

    def __len__(self) -> int:
        return len(self.paths)

    def image(self, i: int) -> Image.Image | None:
        """Image i in RGB, or None when it does not decode (`load`)."""
        return load(self.paths[i])

    def encoded(self, i: int) -> bytes:
        """Image i's file as stored (what a decoder other than Pillow, nvImageCodec's, reads)."""
        with open(self.paths[i], "rb") as f:
            return f.read()

    def name(self, i: int) -> str:
        """Image i as a user finds it: its path."""
        return self.paths[i]

    def problem(self, i: int, decode: bool = True) -> str | None:
        """Why image i does not read (`problem`), None when it does."""
        return problem(self.paths[i], decode)

    def without(self, names: set[str]) -> Split:
        """This split less the images named ``names``, in the same order."""
        keep = [i for i, path in enumerate(self.paths) if path not in names]
        return Split(self.classes, tuple(self.paths[i] for i in keep), self.labels[keep])


def _images_under(folder: str) -> list[str]:
    found = []
    for root, _, names in sorted(os.walk(folder, followlinks=True)):
        found += [os.path.join(root, n) for n in sorted(names)
                  if n.lower().endswith(EXTENSIONS)]
    return found


def scan(root: str, split: str) -> Split:
    """The images of ``root/split`` (UsageError, one line, when the layout is wrong)."""
    where = os.path.join(root, split)
    if not os.path.isdir(where):
        raise UsageError(f"--data {root}: no {split}/ folder (expected {root}/train/<class>/ "
                         f"and {root}/val/<class>/ holding images)")
    classes = sorted(e.name for e in os.scandir(where) if e.is_dir())
    if not classes:
        raise UsageError(f"--data {root}: {where} has no class folders")
    paths, labels = [], []
    for k, name in enumerate(classes):
        found = _images_under(os.path.join(where, name))
        if not found:
            raise UsageError(f"--data {root}: class {name!r} of {split}/ has no images "
                             f"({', '.join(EXTENSIONS)})")
        paths += found
        labels += [k] * len(found)
    return Split(tuple(classes), tuple(paths), np.asarray(labels, np.int32))


def scan_both(root: str, val_split: float | None = None) -> tuple[Split, Split]:
    """(train, val) of ``root``; both must hold the same classes. ``val_split`` f: ``root`` has
    ``train/`` only, and the images whose path below it hashes under f (`held_out`) are the
    val split — the same images on every machine, whatever else the folder holds."""
    if not os.path.isdir(root):
        raise UsageError(f"--data {root}: no such directory (or 'digits', the embedded set)")
    if val_split is not None:
        return _held_out(root, val_split)
    for split in SPLITS:  # both folders first: the likelier mistake than an empty class
        if not os.path.isdir(os.path.join(root, split)):
            if split == "val" and os.path.isdir(os.path.join(root, "train")):
                raise UsageError(f"--data {root}: no val/ folder (expected {root}/val/<class>/ "
                                 f"beside train/; or hold images out of train/ with "
                                 f"--val-split, e.g. 0.1)")
            scan(root, split)
    train, val = (scan(root, s) for s in SPLITS)
    if train.classes != val.classes:
        only = sorted(set(train.classes) ^ set(val.classes))
        raise UsageError(f"--data {root}: train/ and val/ must hold the same classes; "
                         f"{len(only)} differ, e.g. {only[0]!r}")
    return train, val


def held_out(relative_path: str, fraction: float) -> bool:
    """Whether the image at ``relative_path`` (below train/, '/'-separated) is in the val split
    ``--val-split fraction`` holds out: its path's SHA-256, read as a number in [0, 1), is below
    ``fraction``."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _held_out(root: str, fraction: float) -> tuple[Split, Split]:
    if os.path.isdir(os.path.join(root, "val")):
        raise UsageError(f"--val-split: {root} has a val/ folder already; drop --val-split to "
                         f"evaluate on it")
    whole = scan(root, "train")
    base = os.path.join(root, "train")
    out = np.asarray([held_out(os.path.relpath(p, base).replace(os.sep, "/"), fraction)
                      for p in whole.paths])
    if out.all() or not out.any():
        raise UsageError(f"--val-split {fraction:g}: holds out {int(out.sum())} of "
                         f"{len(whole)} images of {root}/train/; choose a fraction that leaves "
                         f"both splits some")
    pick = [np.flatnonzero(~out), np.flatnonzero(out)]
    return tuple(Split(whole.classes, tuple(whole.paths[i] for i in idx), whole.labels[idx])
                 for idx in pick)


def kind(split) -> str:
    """What kind of split ``split`` is (a folder's or a packed folder's, which share it): its
    class names, for pairing runs image by image (`twinstep.data.sources.Source.val_kind`)."""
    return "folder:" + "/".join(split.classes)


def problem(path: str, decode: bool = True) -> str | None:
    """Why the image at ``path`` cannot be read, in a few words, or None when it can: its
    header only (Pillow identifies the format and reads the size; no pixels), or with
    ``decode`` the whole image as `load` decodes it."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as img:
                if decode:
                    img.load()
                    img.convert("RGB")
                elif min(img.size) < 1:
                    return f"a header of size {img.size[0]}x{img.size[1]}"
        return None
    except Image.UnidentifiedImageError:
        if os.path.getsize(path) == 0:
            return "an empty file"
        return "not an image Pillow can identify"
    except UNDECODABLE as e:
        return reason(e, path)


def reason(e: BaseException, path: str | None = None) -> str:
    """Pillow's error ``e`` in a few words: its first line, without ``path``, else its type."""
    text = (str(e).splitlines() or [""])[0]
    if path:
        text = text.replace(repr(path), "").replace(path, "")
    return text.strip() or type(e).__name__


def load(path: str) -> Image.Image | None:
    """The image at ``path`` in RGB (any mode converted, as torchvision's loader does), or None
    when it cannot be decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Pillow's warnings on odd but readable files
            with Image.open(path) as img:
                img.load()
                # convert() copies even an RGB image: a third of a decode's time, saved
                return img if img.mode == "RGB" else img.convert("RGB")
    except UNDECODABLE:
        return None
