"""The ``gpu-serde`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from gpu_serde.inventory import inventory


def _devices(_: argparse.Namespace) -> int:
    inv = inventory()
    print(f"host {inv.host}, pid {os.getpid()}")
    print(inv.describe())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gpu_serde.demo import run

    return run(args.engine)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpu-serde``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="gpu-serde", description="Send cuda.core GPU objects between processes by GPU UUID."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("devices", help="this process's GPUs: ordinal, UUID, name, PCI id")
    p.set_defaults(func=_devices)
    p = sub.add_parser(
        "demo", help="a local cluster whose workers number GPUs differently, shown working"
    )
    p.add_argument("--engine", choices=["dask", "ray"], default="dask")
    p.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
