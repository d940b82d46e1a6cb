"""Shared helpers: pick real or simulated GPUs, time alternatives interleaved in one run, and save
the results as JSON (``--json PATH``) in the format ``benchmarks/plot.py`` reads."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: What a run on simulated GPUs says about its verdicts.
SIMULATED_VERDICTS = (
    "On simulated GPUs: the targets are set for one real GPU (an H200); here the verdicts only "
    "show that the benchmark runs. A small machine's noise, not gpu_serde, decides most of them."
)


def use_gpus() -> str:
    """Real GPUs when a driver is present, else four simulated ones; returns a description."""
    from gpu_serde import testing
    from gpu_serde.inventory import inventory

    if not testing.real_driver_present():
        testing.activate(testing.make_gpus(4, seed="bench"))
    inv = inventory()
    if not inv.devices:
        raise SystemExit(f"no GPU visible: {inv.reason}")
    kind = "simulated" if inv.simulated else "real"
    return f"{len(inv.devices)} {kind} GPU(s), first {inv.devices[0].name}"


def machine() -> str:
    import cuda.core

    return (
        f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, cuda-core {cuda.core.__version__}"
    )


def interleaved_samples(
    cases: dict[str, Callable[[], None]], *, rounds: int, per_round: int, alternate: bool = False
) -> dict[str, list[float]]:
    """Seconds per call of each case, one sample per round; the cases alternate round by round so
    that machine noise falls on all of them alike (``alternate``: in reverse order every other
    round, so that no case always follows the same one). A case may have a ``setup`` attribute
    run before its round."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        order = list(cases.items())
        for name, fn in order[::-1] if alternate and r % 2 else order:
            setup = getattr(fn, "setup", None)
            if setup:
                setup()
            start = time.perf_counter()
            for _ in range(per_round):
                fn()
            samples[name].append((time.perf_counter() - start) / per_round)
    return samples


def interleaved(
    cases: dict[str, Callable[[], None]], *, rounds: int, per_round: int, alternate: bool = False
) -> dict[str, float]:
    """Median seconds per call of each case, run as :func:`interleaved_samples` runs them."""
    samples = interleaved_samples(cases, rounds=rounds, per_round=per_round, alternate=alternate)
    return {name: statistics.median(v) for name, v in samples.items()}


def paired_ci(
    samples: dict[str, list[float]], case: str, baseline: str
) -> tuple[float, float, float]:
    """The median over rounds of ``case`` minus ``baseline`` in the same round (what ``case`` adds,
    with the drift between rounds taken out), and a distribution-free 95% confidence interval for
    that median (the order statistics at n/2 -+ 0.98 sqrt(n)): ``(median, low, high)``."""
    d = sorted(c - b for c, b in zip(samples[case], samples[baseline], strict=True))
    k = max(0, int((len(d) - 1.96 * len(d) ** 0.5) / 2))
    return statistics.median(d), d[k], d[len(d) - 1 - k]


def times(ratio: float) -> str:
    """A ratio as printed in the tables: one decimal below 10x."""
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def verdict(ratio: float, target: float) -> str:
    return "meets target" if ratio <= target else "MISSES target"


def task_table(title: str, t: dict[str, float], target: float = 1.05) -> None:
    """Print a task round-trip table: int baseline, cuda.core's ordinal pickle, gpu_serde."""
    print(f"# {title}")
    print("| argument | median per task | ratio | target |")
    print("|---|---|---|---|")
    rows = [
        ("int", t["int"], ""),
        ("Device, cuda.core's ordinal pickle (reference)", t["ordinal"], ""),
        ("cuda.core Device (gpu_serde)", t["Device"], None),
    ]
    for name, seconds, note in rows:
        ratio = seconds / t["int"]
        if note is None:
            note = f"<= {target}x: {verdict(ratio, target)}"
        print(f"| {name} | {seconds * 1e3:.3f} ms | {ratio:.3f}x | {note} |")


def task_rows(engine: str, t: dict[str, float], path: str) -> list[dict[str, Any]]:
    """JSON rows of a task round-trip run (:func:`task_table`'s numbers)."""
    series = {"int": "int", "ordinal": "cuda.core.ordinal", "Device": "gpu_serde.device"}
    return [
        result("task_round_trip", engine, series[k], t[k], path=path, stat="median")
        for k in ("int", "ordinal", "Device")
    ]


def ipc_pool(dev, max_size: int, *, keep: bool = False):
    """An IPC-enabled DeviceMemoryResource of ``max_size`` bytes; ``keep=True`` sets its release
    threshold to ``max_size`` (a pool that keeps its freed memory, as a long-running service's
    would; cuda.core's default, 0, gives freed memory back to the driver at each synchronisation).
    """
    from cuda.bindings import driver
    from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

    mr = DeviceMemoryResource(dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=max_size))
    if keep:
        (err,) = driver.cuMemPoolSetAttribute(
            driver.CUmemoryPool(int(mr.handle)),
            driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            driver.cuuint64_t(max_size),
        )
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemPoolSetAttribute(RELEASE_THRESHOLD) failed: {err}")
    return mr


# --- results as JSON (``--json PATH``), the format benchmarks/plot.py reads ---------------------
#
# One file per run of one command: what ran, when, on which machine and versions, and a list of
# results. Each result is one number: ``metric`` (what is measured: "handoff", "round_trip",
# "task_round_trip", "payload_bytes", ...), ``engine`` ("multiprocessing", "ray", "dask", or
# "pickle"), ``series`` (the case, e.g. "gpu_serde.kept"), ``path`` (how it travelled: "queue",
# "task argument", ...), ``size_bytes`` where sizes vary, ``value`` with its ``unit`` ("s",
# "bytes" or "x"), and optionally ``low``/``high`` (a 95% confidence interval) and ``stat``.
# benchmarks/results/README.md describes every field.

FORMAT = "gpu_serde-benchmark-results/1"
SIZES_BYTES = {"1 MiB": 1 << 20, "64 MiB": 64 << 20, "1 GiB": 1 << 30, "4 GiB": 4 << 30}


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the ``--json PATH`` option every benchmark takes."""
    first = (doc or "").strip().split("\n\n")[0]  # the first paragraph: a whole sentence
    p = argparse.ArgumentParser(description=" ".join(first.split()))
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results to PATH as JSON (benchmarks/results/README.md), for "
        "benchmarks/plot.py",
    )
    return p


def rounds_args(
    doc: str | None,
    rounds: tuple[int, str],
    per_round: tuple[int, str],
    more: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """The arguments of a benchmark run in rounds: ``--json``, ``--rounds`` and ``--per-round``
    (each ``(default, help)``), both checked to be positive, and what ``more`` adds."""
    p = parser(doc)
    p.add_argument("--rounds", type=int, default=rounds[0], help=rounds[1])
    p.add_argument("--per-round", type=int, default=per_round[0], help=per_round[1])
    if more is not None:
        more(p)
    args = p.parse_args()
    if args.rounds < 1 or args.per_round < 1:
        p.error("--rounds and --per-round take a positive number")
    return args


def result(
    metric: str,
    engine: str,
    series: str,
    value: float,
    unit: str = "s",
    *,
    path: str = "",
    size: str | None = None,
    low: float | None = None,
    high: float | None = None,
    stat: str = "",
    **extra: Any,
) -> dict[str, Any]:
    """One result row (``size``: "1 MiB", "64 MiB", "1 GiB" or "4 GiB")."""
    row: dict[str, Any] = {"metric": metric, "engine": engine, "series": series}
    if path:
        row["path"] = path
    if size is not None:
        row["size"] = size
        row["size_bytes"] = SIZES_BYTES[size]
    row["value"] = value
    row["unit"] = unit
    if low is not None:
        row["low"], row["high"] = low, high
    if stat:
        row["stat"] = stat
    row.update(extra)
    return row


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in (
        "gpu-serde",
        "cuda-core",
        "cuda-bindings",
        "ray",
        "distributed",
        "dask",
        "cupy-cuda13x",
        "cupy-cuda12x",
        "torch",
        "numpy",
    ):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _driver() -> dict[str, Any]:
    """The GPU and driver this process sees (for the results' header)."""
    from gpu_serde.inventory import inventory

    inv = inventory()
    info: dict[str, Any] = {"simulated": inv.simulated, "gpu_count": len(inv.devices)}
    if inv.devices:
        info["gpu"] = inv.devices[0].name
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        if err == driver.CUresult.CUDA_SUCCESS:
            info["cuda_driver_api"] = f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # no driver: the inventory says so
        pass
    try:
        with open("/proc/driver/nvidia/version") as f:
            info["driver"] = f.readline().strip()
    except OSError:
        pass
    return info


def write_json(path: str | None, benchmark: str, rows: list[dict[str, Any]], **notes: Any) -> None:
    """Write ``rows`` with what ran, when and where, to ``path`` (nothing when ``path`` is None)."""
    if not path:
        return
    doc = {
        "format": FORMAT,
        "benchmark": benchmark,
        "command": " ".join(
            ["python", "benchmarks/" + os.path.basename(sys.argv[0]), *sys.argv[1:]]
        ),
        "date": datetime.date.today().isoformat(),
        "source": "written by the command's --json option",
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            **_driver(),
        },
        "versions": _versions(),
        **notes,
        "results": rows,
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(f"results written to {path}", file=sys.stderr)
