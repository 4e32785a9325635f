"""The ``twinstep`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from twinstep import __version__


def _enable_x64():
    import jax

    jax.config.update("jax_enable_x64", True)


def cmd_certify(args) -> int:
    """Certify the op library in float64: VJPs, data-parallel facts, negative controls."""
    _enable_x64()
    from twinstep import dp

    dp.ensure_devices(max(args.replicas))
    from twinstep import certify

    t0 = time.perf_counter()
    report = certify.run(args.replicas, seed=args.seed)
    certify.print_report(report, time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="twinstep",
        description="Data-parallel ResNet-50 and MobileNetV4-Conv-M with synchronised BatchNorm, "
                    "checked parameter by parameter against the single-device step at R*N.",
        epilog="Run 'twinstep COMMAND --help' for a command's options.")
    p.add_argument("--version", action="version", version=f"twinstep {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    c = sub.add_parser(
        "certify", help="certify the op library's hand-written VJPs (float64)",
        description="Check every op's hand-written VJP against jax.vjp (<= 1e-12) and central "
                    "finite differences (<= 1e-6); check SPEC §1's four data-parallel facts "
                    "(sharding, collectives, homogeneity, divisor) under jax.shard_map on R "
                    "virtual devices with shifted shards; and check that each negative control "
                    "(unsynced BN, shard-statistics gamma, sum for mean, wrong divisor, the "
                    "E[x^2]-E[x]^2 variance exchange) is caught. Exit 0 when all hold.")
    c.add_argument("--replicas", type=int, nargs="+", default=[2, 4], metavar="R",
                   help="replica counts for the data-parallel facts (default: 2 4)")
    c.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    c.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    c.set_defaults(func=cmd_certify)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if hasattr(args, "replicas") and isinstance(args.replicas, list):
        bad = [r for r in args.replicas if r < 1]
        if bad:
            parser.error(f"--replicas must be >= 1, got {bad}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
