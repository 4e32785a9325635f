"""``twinstep pack DIR --out PACKED``: an image folder packed for training — images re-encoded
with their short side at most S, stored with their classes as ArrayRecord shards
(docs/training.md#packed-data)."""

from __future__ import annotations

import sys

from twinstep.cli import options
from twinstep.cli.console import status
from twinstep.data import packed
from twinstep.errors import ExitStatus
from twinstep.processes import disk


def add(p) -> None:
    p.description = ("Pack an image folder (DIR/train/<class>/..., DIR/val/<class>/...) for "
                     "'twinstep train --data PACKED': every image decoded once, its short side "
                     "brought down to at most --max-side, re-encoded as JPEG and stored with its "
                     "class in ArrayRecord shards, with a manifest (counts, sha256 per shard). "
                     "Images that do not decode are reported here and left out "
                     "(docs/training.md#packed-data). "
                     + options.exits({ExitStatus.SUCCESS: "packed"}))
    p.add_argument("folder", metavar="DIR", help="the image folder")
    p.add_argument("--out", required=True, metavar="PACKED", help="a new (or empty) folder")
    options.count(p, "--max-side", packed.MAX_SIDE,
                  f"the short side's bound in pixels (default {packed.MAX_SIDE})", metavar="S")
    p.add_argument("--quality", type=options.int_in(1, 96), default=packed.QUALITY,
                   metavar="Q", help=f"JPEG quality, 1-95 (default {packed.QUALITY})")


def run(args, parser) -> int:
    # what twinstep.pack does, without importing the API: it imports JAX, which pack never needs
    # (cli/main's NO_JAX), and pack answers at once
    disk.check_writable_folder(args.out, "--out")
    with status("packing") as say:
        manifest = packed.pack(args.folder, args.out, max_side=args.max_side,
                               quality=args.quality, progress=lambda split, done, total: say(
                                   f"packing {split}: {done}/{total}"))
    for gone in manifest["left_out"]:
        print(f"warning: {gone['split']} image {gone['path']} does not read "
              f"({gone['reason']}): left out", file=sys.stderr)
    counts = ", ".join(f"{n} {s['count']} images in {len(s['shards'])} shard"
                       + ("s" if len(s["shards"]) != 1 else "")
                       for n, s in manifest["splits"].items())
    size = sum(sh["bytes"] for s in manifest["splits"].values() for sh in s["shards"])
    print(f"packed {args.folder} into {args.out}: {counts}, {size / 2**20:.1f} MiB; "
          f"{len(manifest['left_out'])} left out")
    return ExitStatus.SUCCESS
