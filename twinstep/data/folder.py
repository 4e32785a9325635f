"""An image folder in torchvision's ImageFolder layout: ``DIR/train/<class>/<image>`` and
``DIR/val/<class>/<image>``, any depth below the class folder.

Classes are the class folders' names sorted as Python sorts strings, and files are listed as
torchvision's `ImageFolder` lists them (folders walked in sorted order, files sorted, an
extension from `EXTENSIONS` in any case), so label k means what it means to a timm user of the
same folder. Other files are ignored. A class folder with no image is refused, as torchvision
refuses it.

An image that cannot be decoded (corrupt, truncated, not an image behind an image extension) is
not fatal: `load` returns None for it and the loader takes the next image of the split in its
place, counting it (`twinstep.data.sources`).
"""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
from PIL import Image

from twinstep.errors import UsageError

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


def scan_both(root: str) -> tuple[Split, Split]:
    """(train, val) of ``root``; both must hold the same classes."""
    if not os.path.isdir(root):
        raise UsageError(f"--data {root}: no such directory (or 'digits', the embedded set)")
    for split in SPLITS:  # both folders first: the likelier mistake than an empty class
        if not os.path.isdir(os.path.join(root, split)):
            scan(root, split)
    train, val = (scan(root, s) for s in SPLITS)
    if train.classes != val.classes:
        only = sorted(set(train.classes) ^ set(val.classes))
        raise UsageError(f"--data {root}: train/ and val/ must hold the same classes; "
                         f"{len(only)} differ, e.g. {only[0]!r}")
    return train, val


def kind(split) -> str:
    """What kind of split ``split`` is (a folder's or a packed folder's, which share it): its
    class names, for pairing runs image by image (`twinstep.data.sources.Source.val_kind`)."""
    return "folder:" + "/".join(split.classes)


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
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
