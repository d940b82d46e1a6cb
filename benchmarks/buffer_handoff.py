"""GPU buffer hand-off to another process: gpu_serde vs cuda.core's multiprocessing path vs a copy
through host memory, at 1 MiB, 64 MiB, 1 GiB and 4 GiB, from one run (needs a real GPU and CuPy).

    python benchmarks/buffer_handoff.py [--json PATH]

The time runs from the sender's call to the receiver holding the data: the receiver's clock after
it has mapped the buffer and read from it on the GPU (sender and receiver share the host's clock).
gpu_serde and cuda.core send the buffer on a ``multiprocessing.Queue`` to a warm spawned child (the
first hand-off of a pool, which imports it, is timed apart); "host copy" copies the buffer to
pinned host memory and back to a new device buffer in one process. Each path runs with a pool at
cuda.core's default release threshold (0: memory the exporter frees goes back to the driver at its
next synchronisation) and with a pool that keeps its memory (threshold = its size). The receiver
synchronises only for its read, before it frees the buffer, so in both the memory usually comes
back to it still mapped (``buffer_task.py`` times new memory). Target (issue 5): flat in size,
<= 2 ms at 1 GiB, >= 100x faster than the copy at 1 GiB.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
from typing import Any

from _common import ipc_pool, machine, parser, result, times, write_json

SIZES = [("1 MiB", 1 << 20), ("64 MiB", 64 << 20), ("1 GiB", 1 << 30), ("4 GiB", 4 << 30)]
REPEATS = 5
PATHS = [  # (name, gpu_serde installed, the pool keeps its freed memory)
    ("gpu_serde", True, False),
    ("cuda.core", False, False),
    ("gpu_serde kept", True, True),
    ("cuda.core kept", False, True),
]
SERIES = {  # the names in the JSON results (benchmarks/results/README.md)
    "gpu_serde": "gpu_serde.default",
    "cuda.core": "cuda_core.mp",
    "gpu_serde kept": "gpu_serde.kept",
    "cuda.core kept": "cuda_core.mp.kept",
}


def receiver(inbox, outbox) -> None:
    import cupy as cp
    from cuda.core import Device

    import gpu_serde

    Device(0).set_current()  # start CUDA (and CuPy) before the first hand-off is timed
    int(cp.zeros(1, dtype=cp.uint8).sum())
    outbox.put("ready")
    while True:
        item = inbox.get()
        if item is None:
            return
        buf = gpu_serde.resolve(item)
        first = int(cp.from_dlpack(buf)[:1].get()[0])  # read it on the GPU
        outbox.put((time.time(), first))
        buf.close()  # both paths: done with it
        del buf, item


def handoffs(mr, dev, size: int, install: bool, inbox, outbox) -> tuple[float, list[float]]:
    import gpu_serde

    (gpu_serde.install if install else gpu_serde.uninstall)()
    assert outbox.get(timeout=300) == "ready"
    took = []
    for _ in range(REPEATS + 1):
        deadline = time.monotonic() + 5
        while mr.attributes.used_mem_current and time.monotonic() < deadline:
            time.sleep(0.005)  # the last buffer is freed: its free does not overlap the next timing
        buf = mr.allocate(size, stream=dev.default_stream)
        buf.fill(7, stream=dev.default_stream)
        dev.default_stream.sync()
        t0 = time.time()
        inbox.put(buf)
        t1, first = outbox.get(timeout=300)
        assert first == 7
        took.append(t1 - t0)
        del buf
    return took[0], took[1:]  # the first one imports the pool


def host_copy(dev, size: int) -> list[float]:
    from cuda.core import LegacyPinnedMemoryResource

    pinned = LegacyPinnedMemoryResource()
    src = dev.allocate(size, stream=dev.default_stream)
    took = []
    for _ in range(REPEATS):
        t0 = time.time()
        host = pinned.allocate(size, stream=dev.default_stream)
        src.copy_to(host, stream=dev.default_stream)
        dst = dev.allocate(size, stream=dev.default_stream)
        host.copy_to(dst, stream=dev.default_stream)
        dev.default_stream.sync()
        took.append(time.time() - t0)
        host.close()
        dst.close()
    return took


def run() -> list[dict[str, Any]]:
    """Measure, print the table, and return the results as JSON rows."""
    from cuda.core import Device

    import gpu_serde
    from gpu_serde.memory import lifetime as handoff

    handoff.RELEASE_GRACE_S = 0.0
    dev = Device(0)
    dev.set_current()
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for label, size in SIZES:
        row = {"size": label}
        for name, install, keep in PATHS:
            # a new pool and a new child per size and path: each first hand-off imports the pool
            mr = ipc_pool(dev, (REPEATS + 2) * size, keep=keep)
            inbox, outbox = ctx.Queue(), ctx.Queue()
            child = ctx.Process(target=receiver, args=(inbox, outbox))
            gpu_serde.install()
            child.start()
            first, rest = handoffs(mr, dev, size, install, inbox, outbox)
            inbox.put(None)
            child.join(60)
            row[name] = statistics.median(rest)
            print(
                f"{label} {name}: {[round(t * 1e3, 2) for t in rest]} ms",
                file=sys.stderr,
                flush=True,
            )
            row[name + " first"] = first
        row["host copy"] = statistics.median(host_copy(dev, size))
        rows.append(row)
    gpu_serde.install()
    from gpu_serde.memory.broker import broker

    time.sleep(1)
    print(f"buffers still held for importers after the run: {broker().held()}", file=sys.stderr)
    print(f"# GPU buffer hand-off to another process ({dev.name}; {machine()})")
    print(
        "| size | gpu_serde | cuda.core mp | gpu_serde, pool keeps memory | cuda.core mp, pool "
        "keeps memory | host copy | copy / gpu_serde | first (pool import) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["host copy"] / r["gpu_serde"]
        cells = " | ".join(f"{r[name] * 1e3:.2f} ms" for name, _, _ in PATHS)
        print(
            f"| {r['size']} | {cells} | {r['host copy'] * 1e3:.1f} ms | {times(ratio)} | "
            f"{r['gpu_serde first'] * 1e3:.1f} ms |"
        )
    out = []
    for r in rows:
        size = r["size"]
        for name, _, _ in PATHS:
            series = SERIES[name]
            stat = f"median of {REPEATS}"
            out.append(
                result(
                    "handoff",
                    "multiprocessing",
                    series,
                    r[name],
                    path="queue",
                    size=size,
                    stat=stat,
                )
            )
            out.append(
                result(
                    "handoff_first",
                    "multiprocessing",
                    series,
                    r[name + " first"],
                    path="queue",
                    size=size,
                    stat="the pool's first hand-off",
                )
            )
        out.append(
            result(
                "handoff",
                "multiprocessing",
                "host_copy",
                r["host copy"],
                path="in one process",
                size=size,
                stat=f"median of {REPEATS}",
            )
        )
    return out


def main() -> None:
    args = parser(__doc__).parse_args()
    write_json(args.json, "buffer_handoff", run())


if __name__ == "__main__":
    main()
