"""Shared helpers: pick real or simulated GPUs, and time alternatives interleaved in one run."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
