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


def _doctor(args: argparse.Namespace) -> int:
    from gpu_serde import doctor

    if args.ray:
        reports = doctor.survey_ray(args.ray, args.node_ip_address)
    else:
        reports = doctor.survey_dask(args.scheduler)
    print(doctor.render(reports))
    return 1 if any(r.problems for r in reports) else 0


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
    p = sub.add_parser("doctor", help="what every worker of a running cluster sees")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--ray", metavar="ADDRESS", help="a Ray cluster (host:port of the GCS)")
    target.add_argument("--scheduler", metavar="ADDRESS", help="a Dask scheduler (tcp://...)")
    p.add_argument(
        "--node-ip-address",
        help="Ray only: this machine's address as the cluster knows it (loopback clusters)",
    )
    p.set_defaults(func=_doctor)
    p = sub.add_parser(
        "demo", help="a local cluster whose workers number GPUs differently, shown working"
    )
    p.add_argument("--engine", choices=["dask", "ray"], default="dask")
    p.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
