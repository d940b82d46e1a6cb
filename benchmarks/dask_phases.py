"""Where a Dask task with a GPU Buffer argument spends its time, against the same task with an int
(needs a real GPU, CuPy and distributed).

    python benchmarks/dask_phases.py [--json PATH]

One worker process of a LocalCluster whose scheduler runs in the client's (the exporter's) process.
A 1 MiB Buffer from a pool that keeps its memory, or the int 0, goes to a task that reads the
buffer's first byte and closes it. Each case runs right after the same preparation (the wait for
the last release, a buffer filled on the GPU), either back to back or after 100 ms of quiet, the
int and the Buffer taking turns to go first: Dask's own round trip depends on what ran just before
it. The clocks (the host's, shared by both processes) split each round trip into: submit to the
task's start, the task, the task's end to the result. In the worker, gpu_serde's rebuild of the
Buffer and its broker acquire inside it are timed by wrapping the two functions (``client.run``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from _common import interleaved, ipc_pool, machine, parser, result, write_json

ROUNDS = 15
SIZE = 1 << 20


def warm() -> int:
    import cupy as cp
    from cuda.core import Device

    Device(0).set_current()
    return int(cp.zeros(1, dtype=cp.uint8).sum())


def consume(arg: Any) -> tuple[float, float]:
    """The task: read and close a Buffer (an int comes back at once); its start and end times."""
    start = time.time()
    if not isinstance(arg, int):
        import cupy as cp

        import gpu_serde

        buf = gpu_serde.resolve(arg)
        int(cp.from_dlpack(buf)[:1].get()[0])
        buf.close()
    return start, time.time()


def time_rebuilds(dask_worker: Any) -> None:
    """In the worker: record how long each Buffer rebuild, and the broker acquire in it, take."""
    from gpu_serde import wire
    from gpu_serde.memory import broker, pools
    from gpu_serde.placeholders import define

    record: dict[str, list[float]] = {"rebuild": [], "acquire": []}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record[name].append(time.perf_counter() - t0)

        return wrapper

    broker.acquire = timed("acquire", broker.acquire)  # pools calls it through its module
    define(wire.buf, "Buffer", timed("rebuild", pools.rebuild_buffer))
    dask_worker.gpu_serde_rebuilds = record


def take_rebuild_times(dask_worker: Any) -> dict[str, list[float]]:
    record = dask_worker.gpu_serde_rebuilds
    taken = {k: list(v) for k, v in record.items()}
    for v in record.values():
        v.clear()
    return taken


def main() -> None:
    args = parser(__doc__).parse_args()
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    import dask
    import distributed
    from cuda.core import Device
    from distributed import Client, LocalCluster

    import gpu_serde.dask
    from gpu_serde.inventory import inventory
    from gpu_serde.memory import lifetime as handoff

    inv = inventory()
    if inv.simulated or not inv.devices:
        raise SystemExit(f"dask_phases.py needs a real GPU; this process sees: {inv.describe()}")
    handoff.RELEASE_GRACE_S = 0.0
    dask.config.set({"distributed.admin.low-level-log-length": 0})  # see buffer_task.py
    dev = Device(0)
    dev.set_current()
    mr = ipc_pool(dev, 16 * SIZE, keep=True)
    cluster = LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None
    )
    with cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.submit(warm, pure=False).result()
        client.run(time_rebuilds)
        phases: dict[str, list[tuple[float, float, float]]] = {}
        rebuilds: dict[str, dict[str, list[float]]] = {}

        def prepared() -> Any:
            deadline = time.monotonic() + 5
            while mr.attributes.used_mem_current:
                if time.monotonic() > deadline:
                    raise RuntimeError("the last buffer was not released within 5 s")
                time.sleep(0.002)
            buf = mr.allocate(SIZE, stream=dev.default_stream)
            buf.fill(1, stream=dev.default_stream)
            dev.sync()
            return buf

        def case(name: str, quiet: bool, send_buffer: bool) -> None:
            buf = prepared()
            arg: Any = buf
            if not send_buffer:
                buf.close()
                arg = 0
            if quiet:
                time.sleep(0.1)
            sent = time.time()
            start, end = client.submit(consume, arg, pure=False).result()
            phases.setdefault(name, []).append((start - sent, end - start, time.time() - end))

        for regime, quiet in (("back to back", False), ("after 100 ms quiet", True)):
            pair = {
                f"{what}, {regime}": lambda n=f"{what}, {regime}", q=quiet, b=buffer: case(n, q, b)
                for what, buffer in (("int", False), ("Buffer", True))
            }
            interleaved(pair, rounds=ROUNDS, per_round=1, alternate=True)
            (times,) = client.run(take_rebuild_times).values()  # the Buffer cases' rebuilds
            rebuilds[f"Buffer, {regime}"] = times

    print(f"# Dask {distributed.__version__}: a 1 MiB Buffer vs an int ({dev.name}; {machine()})")
    print(
        "| case | round trip | submit to task start | task | task end to result | "
        "worker: rebuild (broker acquire) |"
    )
    print("|---|---|---|---|---|---|")
    out = []
    for name, rows in phases.items():
        rows = rows[2:]  # warm-up
        cols = [statistics.median(c) * 1e3 for c in zip(*rows, strict=True)]
        got = rebuilds.get(name)
        rebuild = (
            f"{statistics.median(got['rebuild'][2:]) * 1e3:.2f} ms "
            f"({statistics.median(got['acquire'][2:]) * 1e3:.2f} ms)"
            if got and len(got["rebuild"]) > 2
            else "-"
        )
        print(
            f"| {name} | {sum(cols):.2f} ms | {cols[0]:.2f} ms | {cols[1]:.2f} ms | "
            f"{cols[2]:.2f} ms | {rebuild} |"
        )
        parts = ["round trip", "submit to task start", "task", "task end to result"]
        values = [sum(cols), *cols]
        if got and len(got["rebuild"]) > 2:
            parts += ["worker: rebuild", "worker: broker acquire"]
            values += [
                statistics.median(got["rebuild"][2:]) * 1e3,
                statistics.median(got["acquire"][2:]) * 1e3,
            ]
        for part, ms in zip(parts, values, strict=True):
            out.append(
                result(
                    "dask_phase",
                    "dask",
                    name,
                    ms / 1e3,
                    path="task argument",
                    size="1 MiB",
                    phase=part,
                    stat="median",
                )
            )
    write_json(args.json, "dask_phases", out)


if __name__ == "__main__":
    main()
