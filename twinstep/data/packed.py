"""A packed image folder (``twinstep pack``; docs/training.md#packed-data): every image of
``DIR/train`` and ``DIR/val`` decoded once, its short side brought down to at most ``max_side``
and re-encoded as JPEG (the approach FFCV takes), stored with its class as ArrayRecord shards —
the random-access format grain reads natively. Reading one back decodes fewer pixels than the
original and opens no file per image.

A packed folder holds, per split, ``<split>-NNNNN.array_record`` shards (one record per image:
its class as a little-endian int32, then the JPEG) and ``manifest.json``: the format, the
settings, the classes, each split's count, labels and shards with their bytes and sha256, and
the images left out because they do not decode (reported when packing, so training never meets
one). Images keep the folder's order (`twinstep.data.folder`), so a packed split's image i is
the folder's i-th decodable image of that split.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct

import numpy as np
from array_record.python.array_record_data_source import ArrayRecordDataSource
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image

from twinstep.data import folder
from twinstep.errors import UsageError
from twinstep.processes import disk

FORMAT = "twinstep-packed/1"
MANIFEST = "manifest.json"
MAX_SIDE = 320  # the short side's bound (FFCV's ImageNet copies store 256-320)
QUALITY = 90
SHARD_RECORDS = 4096  # images per shard
_LABEL = struct.Struct("<i")


def is_packed(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def shrink(img: Image.Image, max_side: int) -> Image.Image:
    """``img`` with its short side at most ``max_side`` (Lanczos), aspect kept."""
    short = min(img.size)
    if short <= max_side:
        return img
    w, h = img.size
    size = (max_side, round(h * max_side / w)) if w <= h else (round(w * max_side / h), max_side)
    return img.resize(size, Image.Resampling.LANCZOS)


def encode(img: Image.Image, label: int, quality: int) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    return _LABEL.pack(label) + buf.getvalue()


def pack(root: str, out: str, *, max_side: int = MAX_SIDE, quality: int = QUALITY,
         shard_records: int = SHARD_RECORDS, progress=None) -> dict:
    """Pack the image folder ``root`` into the new folder ``out``; returns the manifest.
    ``progress(split, done, total)`` is told of every image. The manifest is written last:
    a folder without one is not a packed folder (an interrupted pack is refused, not read)."""
    if not 1 <= quality <= 95:
        raise UsageError(f"--quality must be in [1, 95], got {quality}")
    if max_side < 1 or shard_records < 1:
        raise UsageError("--max-side and the records per shard must be >= 1")
    if not os.path.isdir(root):
        raise UsageError(f"{root}: no such directory (an image folder: DIR/train/<class>/..., "
                         f"DIR/val/<class>/...)")
    splits = folder.scan_both(root)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--out {out}: exists and is not an empty folder")
    os.makedirs(out, exist_ok=True)
    manifest = {"format": FORMAT, "source": os.path.abspath(root), "max_side": max_side,
                "quality": quality, "classes": list(splits[0].classes), "splits": {},
                "left_out": []}
    for name, split in zip(folder.SPLITS, splits, strict=True):
        labels, shards, writer, count = [], [], None, 0
        for i, (path, label) in enumerate(zip(split.paths, split.labels, strict=True)):
            img = folder.load(path)
            if img is None:
                manifest["left_out"].append({"split": name, "path": path,
                                             "reason": folder.problem(path) or "unreadable"})
                continue
            if writer is None or count == shard_records:
                if writer is not None:
                    writer.close()
                shards.append(f"{name}-{len(shards):05d}.array_record")
                writer, count = ArrayRecordWriter(os.path.join(out, shards[-1]),
                                                  "group_size:1"), 0
            writer.write(encode(shrink(img, max_side), int(label), quality))
            labels.append(int(label))
            count += 1
            if progress is not None:
                progress(name, i + 1, len(split))
        if writer is not None:
            writer.close()
        if not labels:
            raise UsageError(f"--data {root}: no image of {name}/ decodes")
        np.save(os.path.join(out, f"{name}-labels.npy"), np.asarray(labels, np.int32))
        manifest["splits"][name] = {
            "count": len(labels), "labels": f"{name}-labels.npy",
            "shards": [{"file": f, "bytes": os.path.getsize(os.path.join(out, f)),
                        "sha256": _sha256(os.path.join(out, f))} for f in shards]}
    disk.publish({os.path.join(out, MANIFEST): json.dumps(manifest, indent=1).encode()})
    return manifest


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Split:
    """A packed split as `twinstep.data.folder.Split` reads: ``classes``, ``labels``,
    ``len()``, ``image(i)``. Its shards open on first use, in each process that reads them."""

    def __init__(self, root: str, classes: tuple, entry: dict, split: str):
        self.root, self.classes, self.split = root, classes, split
        self.labels = np.load(os.path.join(root, entry["labels"]))
        self.shards = [os.path.join(root, s["file"]) for s in entry["shards"]]
        self._source = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def encoded(self, i: int) -> bytes:
        """Image i's JPEG as packed."""
        if self._source is None:
            self._source = _records(self.shards)
        return self._source[i][_LABEL.size:]

    def image(self, i: int) -> Image.Image | None:
        """Image i in RGB, or None when its record does not decode (a shard damaged since)."""
        try:
            return _decoded(self.encoded(i))
        except folder.UNDECODABLE:
            return None

    def name(self, i: int) -> str:
        """Image i as a user finds it: its record in the packed folder."""
        return f"{self.root}: {self.split} image {i}"

    def problem(self, i: int, decode: bool = True) -> str | None:
        """Why image i does not decode, None when it does (``decode``: always decoded; a
        packed image's header was read when it was packed)."""
        try:
            _decoded(self.encoded(i))
            return None
        except folder.UNDECODABLE as e:
            return folder.reason(e)


def _decoded(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img if img.mode == "RGB" else img.convert("RGB")


def _records(shards: list[str]):
    """The shards as one random-access sequence of records: array_record's own source (what
    grain's wraps), whose import is a twentieth of grain's — a loader worker starts on it."""
    return ArrayRecordDataSource(shards)


def open_splits(root: str, verify: bool = False,
                val_split: float | None = None) -> tuple[Split, Split]:
    """(train, val) of the packed folder ``root`` (UsageError, one line, when it is not one;
    ``verify``: every shard's sha256 against the manifest's too). A packed folder has its val
    split: a ``val_split`` is refused."""
    if val_split is not None:
        raise UsageError(f"--val-split holds images out of a folder's train/; --data {root} "
                         f"is packed, with its val split")
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, not {FORMAT!r}")
        classes = tuple(manifest["classes"])
        splits = tuple(Split(root, classes, manifest["splits"][s], s) for s in folder.SPLITS)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--data {root}: not a packed folder ({e})") from None
    for split, name in zip(splits, folder.SPLITS, strict=True):
        entry = manifest["splits"][name]
        try:
            records = len(_records(split.shards))
        except Exception as e:  # noqa: BLE001 - a missing or unreadable shard, in one line
            raise UsageError(f"--data {root}: {name}'s shards cannot be read "
                             f"({type(e).__name__})") from None
        if not len(split) == records == entry["count"]:
            raise UsageError(f"--data {root}: {name} holds {records} images and {len(split)} "
                             f"labels; its manifest says {entry['count']}")
        for shard in entry["shards"] if verify else ():
            if _sha256(os.path.join(root, shard["file"])) != shard["sha256"]:
                raise UsageError(f"--data {root}: {shard['file']} differs from its manifest's "
                                 f"sha256")
    return splits
