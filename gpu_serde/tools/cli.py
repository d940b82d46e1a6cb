"""The ``gpu-serde`` command line (also ``python -m gpu_serde``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import textwrap
from collections.abc import Callable
from typing import Any

PROG = "gpu-serde"
EXTRAS = {"ray": "ray", "distributed": "dask", "dask": "dask"}  # module -> the extra that brings it

DEVICES_EXAMPLES = """\
examples:
  gpu-serde devices
  CUDA_VISIBLE_DEVICES=1,0 gpu-serde devices --json
"""
DOCTOR_EXAMPLES = """\
examples:
  gpu-serde doctor --scheduler tcp://127.0.0.1:8786 --expect 4
  gpu-serde doctor --ray 127.0.0.1:6379 --expect 3 --timeout 60 --json

exit status: 0 when every expected worker answered and nothing was flagged; 1 on a problem
(no worker, fewer than --expect, gpu_serde missing somewhere, a GPU claimed twice); 2 when the
cluster cannot be reached or an extra is missing.
"""
SIMULATE_EXAMPLES = """\
examples:
  eval "$(gpu-serde simulate 4)"          # this shell and what it starts: four simulated GPUs
  gpu-serde devices                       # ... now lists them
  dask worker tcp://127.0.0.1:8786 --preload gpu_serde.dask   # ... and so does this worker
  eval "$(gpu-serde simulate --off)"      # back to the shell as it was
  gpu-serde simulate 2 -- python -m pytest tests/   # one command only

The GPUs are the same ones on every call with the same count (the UUIDs that the README, the
demo and the pytest fixture show). CUDA_VISIBLE_DEVICES is left as it is: set it per command to
let one process see fewer GPUs, or a different order.
"""
DEMO_EXAMPLES = """\
examples:
  gpu-serde demo
  gpu-serde demo --engine ray
"""


# Each command imports what it needs when it runs: `gpu-serde --help` starts fast, and a command
# needs only its own extra (doctor --ray: Ray; doctor --scheduler: distributed).
def _devices(args: argparse.Namespace) -> int:
    from gpu_serde.inventory import inventory

    inv = inventory()
    if args.json:
        doc = {
            "host": inv.host,
            "pid": os.getpid(),
            "cuda_visible_devices": inv.cuda_visible_devices,
            "simulated": inv.simulated,
            "reason": inv.reason,
            "devices": [
                {"ordinal": d.ordinal, "uuid": d.uuid, "name": d.name, "pci_bus_id": d.pci_bus_id}
                for d in inv.devices
            ],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"host {inv.host}, pid {os.getpid()}")
    print(inv.describe())
    if not inv.devices and inv.reason.startswith("no CUDA driver"):
        print(
            f'no GPU here? simulated ones need no driver: eval "$({PROG} simulate 4)", then run '
            f"this again (docs/testing.md)"
        )
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from gpu_serde.text import quoted, safe
    from gpu_serde.tools import doctor

    if args.scheduler and args.node_ip_address is not None:
        return _fail("doctor: --node-ip-address is for --ray only (a Dask client needs none)")
    where = args.ray if args.ray is not None else args.scheduler
    try:
        if args.ray is not None:
            survey = doctor.survey_ray(
                args.ray, args.node_ip_address, timeout=args.timeout, expect=args.expect
            )
        else:
            survey = doctor.survey_dask(args.scheduler, timeout=args.timeout, expect=args.expect)
    except (ConnectionError, OSError, TimeoutError, asyncio.TimeoutError) as exc:  # 3.10: two kinds
        why = _LONG_SECONDS.sub(lambda m: f"{float(m.group()):.1f}", safe(str(exc)))
        return _fail(f"doctor: cannot reach the cluster at {quoted(where)}: {why}")
    except doctor.AddressError as exc:
        return _fail(f"doctor: {quoted(where)} is not a cluster's address: {exc}")
    if args.json:
        print(json.dumps(survey.to_json(), indent=2))
    else:
        print(doctor.render(survey))
    return 0 if survey.ok else 1


def _demo(args: argparse.Namespace) -> int:
    from gpu_serde.tools.demo import run

    return run(args.engine)


def _simulate(args: argparse.Namespace) -> int:
    import shlex

    from gpu_serde import testing

    kept = [
        p
        for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
        if p and not testing.is_driver_dir(p)
    ]
    if args.off:
        if args.command_line or args.ends_with_dashes:
            return _fail("simulate --off runs no command")
        if args.count is not None:
            return _fail("simulate --off takes no COUNT: it undoes whatever was set up")
        print("# gpu_serde: no simulated GPUs in this shell any more")
        print(
            f"export LD_LIBRARY_PATH={shlex.quote(':'.join(kept))}"
            if kept
            else "unset LD_LIBRARY_PATH"
        )
        print(f"unset {testing.SPEC_ENV}")
        return 0
    if args.command_line and not args.after_dashes:  # "simulate 4 app": '--' left out
        return _fail(
            f"simulate: a command goes after '--' ({PROG} simulate {args.count or 4} -- "
            f"{shlex.join(args.command_line)[:200]})"
        )
    count = 4 if args.count is None else args.count
    base = {**os.environ, "LD_LIBRARY_PATH": ":".join(kept)}
    try:
        env = testing.child_env(
            testing.make_gpus(count),
            os.environ.get("CUDA_VISIBLE_DEVICES"),  # left as it is
            base=base,
            allow_real_driver=args.allow_real_driver,
        )
    except testing.SimulatedDriverError as exc:
        return _fail(f"simulate: {exc}")
    command = args.command_line
    if not command and args.ends_with_dashes:  # a command meant, none given
        return _fail(
            f"simulate: nothing to run after '--': give a command ({PROG} simulate 4 -- python "
            f"app.py), or leave out '--' to set up this shell (eval \"$({PROG} simulate 4)\")"
        )
    if command:
        sys.stdout.flush()
        try:
            os.execvpe(command[0], command, env)  # this process becomes the command
        except OSError as exc:  # as a shell says it: 127 not found, 126 not runnable
            _fail(f"simulate: cannot run {command[0]!r}: {exc.strerror or exc}")
            return 127 if isinstance(exc, FileNotFoundError) else 126
    print(f"# gpu_serde: {count} simulated GPUs for this shell and what it starts")
    print(f'# (undo: eval "$({PROG} simulate --off)"; docs/testing.md)')
    for key in ("LD_LIBRARY_PATH", testing.SPEC_ENV):
        print(f"export {key}={shlex.quote(env[key])}")
    return 0


def _fail(text: str) -> int:
    print(f"{PROG}: {text}", file=sys.stderr)
    return 2


#: A number with many decimals in an engine's message ("after 2.9999862929980736 s"), not an IP.
_LONG_SECONDS = re.compile(r"(?<![\d.])\d+\.\d{4,}(?![\d.])")


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number, 0 or more, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _positive_count(text: str) -> int:
    if not (text.isascii() and text.strip().isdecimal()):  # int() takes other scripts' digits
        raise argparse.ArgumentTypeError(f"a number of GPUs, 1 to 64, not {text!r}")
    value = int(text)
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"must be 1 to 64 GPUs, not {value}")
    return value


#: The longest ``--timeout`` the doctor takes (a day): more is no wait a user means, and the
#: engines' clocks refuse far larger ones.
MAX_WAIT_S = 86_400


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, not {text!r}") from None
    if not 0 < value <= MAX_WAIT_S:
        raise argparse.ArgumentTypeError(
            f"must be more than 0 seconds and at most {MAX_WAIT_S:,} (a day), not {text}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Send cuda.core GPU objects between processes by GPU UUID: inspect this "
        "process's GPUs, check a running Ray or Dask cluster, watch a demo, or simulate GPUs.",
        epilog="run 'gpu-serde COMMAND --help' for each command's options and examples",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    formatter = argparse.RawDescriptionHelpFormatter

    def command(name: str, summary: str, description: str, examples: str) -> Any:
        return sub.add_parser(
            name,
            help=summary,
            description=textwrap.fill(description, 88),
            epilog=examples,
            formatter_class=formatter,
        )

    p = command(
        "devices",
        "this process's GPUs: ordinal, UUID, name, PCI id",
        "List the GPUs this process sees (after CUDA_VISIBLE_DEVICES), in ordinal order, with "
        "their UUIDs: what a Device pickled here would be sent as.",
        DEVICES_EXAMPLES,
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_devices)

    p = command(
        "doctor",
        "what every worker of a running cluster sees, and what is wrong",
        "Ask every worker of a running cluster (and the Dask scheduler) which GPUs it sees, by "
        "ordinal and UUID, and whether gpu_serde is set up there. Flags processes where it is "
        "not, GPUs that two workers compute on, and fewer workers than --expect.",
        DOCTOR_EXAMPLES,
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--ray", metavar="ADDRESS", help="a Ray cluster (host:port of the GCS)")
    target.add_argument("--scheduler", metavar="ADDRESS", help="a Dask scheduler (tcp://...)")
    p.add_argument(
        "--expect",
        type=_non_negative,
        default=0,
        metavar="N",
        help="wait for N Dask workers or N Ray nodes (head included); fewer is a problem",
    )
    p.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait to connect and for --expect (default 60)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--node-ip-address",
        help="Ray only: this machine's address as the cluster knows it (loopback clusters)",
    )
    p.set_defaults(func=_doctor)

    p = command(
        "demo",
        "a local cluster whose workers number GPUs differently, shown working",
        "Start a local cluster whose workers see the GPUs in different orders (simulated GPUs "
        "where there is no CUDA driver), send them one Device, and show each worker resolve it "
        "to the same UUID; a worker that cannot see it raises DeviceNotVisibleError.",
        DEMO_EXAMPLES,
    )
    p.add_argument("--engine", choices=["dask", "ray"], default="dask")
    p.set_defaults(func=_demo)

    p = command(
        "simulate",
        "simulated GPUs for a shell, a CLI cluster or a test run (no GPU needed)",
        "Print shell commands that give this shell, and every process it starts (gpu-serde "
        "devices, dask worker, ray start, pytest), COUNT simulated GPUs: gpu_serde's stand-in "
        "CUDA driver and NVML (built with the C compiler on first use). With a command after "
        "'--', run only that command on them. Refuses where a real CUDA driver is found.",
        SIMULATE_EXAMPLES,
    )
    p.add_argument(
        "count",
        type=_positive_count,
        nargs="?",
        default=None,
        metavar="COUNT",
        help="how many simulated GPUs (default 4)",
    )
    p.add_argument("--off", action="store_true", help="print the commands that undo it")
    p.add_argument(
        "--allow-real-driver",
        action="store_true",
        help="shadow a real CUDA driver found here (refused by default)",
    )
    p.add_argument(
        "command_line",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="run this command on the simulated GPUs instead of printing",
    )
    p.set_defaults(func=_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpu-serde``; returns the exit status (2 for a missing extra or an
    unreachable cluster, with one line on stderr)."""
    given = sys.argv[1:] if argv is None else list(argv)
    # what follows the first "--" is a command (simulate's), never read as options or COUNT
    dashes = given.index("--") if "--" in given else len(given)
    args = _parser().parse_args(given[:dashes])
    args.after_dashes = dashes < len(given)
    args.ends_with_dashes = given[dashes + 1 :] == [] and args.after_dashes  # a command meant
    if args.after_dashes:
        if getattr(args, "command_line", None) is None:
            return _fail(f"{args.command} runs no command: nothing goes after '--'")
        args.command_line = given[dashes + 1 :]
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        status = func(args)
        sys.stdout.flush()  # a reader that went away (`| head`) is found here, not at exit
        return status
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # another pipe (a connection): a real failure
        # what is left to print has no reader: say nothing more, as a SIGPIPE'd command would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        return _fail(
            f"{args.command} needs {top}, which is not installed here: "
            f"pip install {_extra_requirements(EXTRAS[top])} (gpu_serde's [{EXTRAS[top]}] extra)"
        )


def _stdout_gone() -> bool:
    """True when this process's standard output is a pipe with no reader left."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = select.POLLERR | select.POLLHUP  # a pipe's reader left; a socket's peer
        return any(events & gone for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd (a replaced stdout), no poll
        return False


def _extra_requirements(extra: str) -> str:
    """What gpu_serde's ``extra`` brings, quoted for a shell (from the installed metadata)."""
    import shlex
    from importlib import metadata

    try:
        requires = metadata.requires("gpu-serde") or []
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        requires = []
    marker = f'extra == "{extra}"'
    found = [r.split(";")[0].strip() for r in requires if marker in r.replace("'", '"')]
    return " ".join(shlex.quote(r.replace(" ", "")) for r in found) or extra


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
