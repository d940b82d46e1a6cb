"""Where the time of a GPU buffer hand-off goes, by phase and size (needs a real GPU and CuPy).

    python benchmarks/buffer_breakdown.py [--json PATH]

A spawned receiver unpickles each payload itself, so the phases are timed apart: the sender's
pickle (cuda.core's export of the pointer, the broker's hold), the receiver's unpickle (a
round trip to the exporter's broker, then the driver's import and mapping), a first read on the
GPU, and the receiver's close (the free queued on its stream; the driver unmaps lazily, and
gpu_serde's release thread tells the exporter once the free has completed). The bare broker round
trip (acquire + release, same process) is printed first as the baseline of the fixed cost. A task
round trip on Ray pays the close too when Ray drops the argument before it answers.
"""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import time

from _common import machine, parser, result, write_json

SIZES = [("1 MiB", 1 << 20), ("64 MiB", 64 << 20), ("1 GiB", 1 << 30), ("4 GiB", 4 << 30)]
REPEATS = 6


def receiver(inbox, outbox) -> None:
    import cupy as cp
    from cuda.core import Device

    import gpu_serde  # noqa: F401 - payloads name gpu_serde's reconstructors

    Device(0).set_current()
    int(cp.zeros(1).sum())
    outbox.put("ready")
    while (blob := inbox.get()) is not None:
        t0 = time.perf_counter()
        buf = pickle.loads(blob)
        t1 = time.perf_counter()
        int(cp.from_dlpack(buf)[:1].get()[0])
        t2 = time.perf_counter()
        buf.close()  # queues the free; gpu_serde's release thread waits for it on the GPU
        t3 = time.perf_counter()
        outbox.put((t1 - t0, t2 - t1, t3 - t2))
        del buf


def broker_round_trip() -> float:
    from gpu_serde.memory import broker

    b = broker.broker()
    times = []
    for _ in range(50):
        token = b.hold("x", lambda _: None, grace=0)
        t0 = time.perf_counter()
        broker.acquire(b.address, token)
        broker.release(b.address, token)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


PHASES = ("pickle", "unpickle", "first_read", "close")


def main() -> None:
    args = parser(__doc__).parse_args()
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    import gpu_serde
    from gpu_serde.memory import lifetime as handoff

    gpu_serde.install()
    handoff.RELEASE_GRACE_S = 0.0
    dev = Device(0)
    dev.set_current()
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receiver, args=(inbox, outbox), daemon=True)
    child.start()
    try:
        assert outbox.get(timeout=300) == "ready"
        print(f"# GPU buffer hand-off by phase ({dev.name}; {machine()})")
        bare = broker_round_trip()
        print(f"broker round trip (acquire + release): {bare * 1e3:.3f} ms\n")
        out = [result("broker_round_trip", "multiprocessing", "gpu_serde", bare, stat="median")]
        print("| size | pickle | unpickle (broker + map) | first read | close | total |")
        print("|---|---|---|---|---|---|")
        for label, size in SIZES:
            mr = DeviceMemoryResource(
                dev, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=(REPEATS + 2) * size)
            )
            rows = []
            for _ in range(REPEATS + 1):
                buf = mr.allocate(size, stream=dev.default_stream)
                buf.fill(3, stream=dev.default_stream)
                dev.sync()
                t0 = time.perf_counter()
                blob = pickle.dumps(buf)
                rows.append((time.perf_counter() - t0, *_send(inbox, outbox, blob)))
                del buf, blob
                deadline = time.monotonic() + 5
                while mr.attributes.used_mem_current and time.monotonic() < deadline:
                    time.sleep(0.005)
            timed = rows[1:]  # the first one also imports the pool
            med = [statistics.median(col) * 1e3 for col in zip(*timed, strict=True)]
            cells = " | ".join(f"{m:.2f} ms" for m in med)
            print(f"| {label} | {cells} | {sum(med):.2f} ms |")
            for phase, m in zip(PHASES, med, strict=True):
                out.append(
                    result(
                        "phase",
                        "multiprocessing",
                        "gpu_serde.default",
                        m / 1e3,
                        path="queue",
                        size=label,
                        phase=phase,
                        stat=f"median of {REPEATS}",
                    )
                )
        write_json(args.json, "buffer_breakdown", out)
    finally:
        inbox.put(None)
        child.join(30)


def _send(inbox, outbox, blob: bytes) -> tuple[float, float, float]:
    inbox.put(blob)
    return outbox.get(timeout=300)


if __name__ == "__main__":
    main()
