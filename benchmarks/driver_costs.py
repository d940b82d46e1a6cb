"""The driver's own cost of handing a pool buffer to another process, by size (needs a real GPU).

    python benchmarks/driver_costs.py [--json PATH]

No gpu_serde protocol here (the pool reaches a spawned child once, through gpu_serde; then only
cuda.core's 64-byte descriptors travel, timed apart from the driver calls), so these are the floor
any implementation on CUDA's pool IPC pays:

- export: ``buf.ipc_descriptor`` of a new buffer (``cuMemPoolExportPointer``), from a pool at
  cuda.core's default release threshold (0: freed memory goes back to the driver, so each buffer
  is new memory), and from a pool that keeps its memory;
- map: the receiver's ``Buffer.from_ipc_descriptor`` (``cuMemPoolImportPointer``) of new memory,
  and of memory it mapped before, freed, and has not synchronised since (the driver still has it
  mapped);
- unmap: the receiver's first synchronisation after it freed the buffer (the driver unmaps freed
  imported memory then; an event wait does not).
"""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import time

from _common import ipc_pool, machine, parser, result, write_json

SIZES = [("1 MiB", 1 << 20), ("64 MiB", 64 << 20), ("1 GiB", 1 << 30), ("4 GiB", 4 << 30)]
REPEATS = 6


def receiver(inbox, outbox) -> None:
    from cuda.core import Buffer, Device
    from cuda.core._memory._ipc import IPCBufferDescriptor

    import gpu_serde  # noqa: F401 - the pool's payload names gpu_serde's reconstructor

    dev = Device(0)
    dev.set_current()
    stream = dev.default_stream
    idle = dev.create_stream()
    pools = {}
    outbox.put("ready")
    while (item := inbox.get()) is not None:
        if item[0] == "pool":
            pools[item[1]] = pickle.loads(item[2])
            outbox.put("ok")
            continue
        _, name, reserved, size, unmap = item
        t0 = time.perf_counter()
        buf = Buffer.from_ipc_descriptor(
            pools[name], IPCBufferDescriptor._init(reserved, size), stream=stream
        )
        t1 = time.perf_counter()
        buf.close(stream)
        stream.record().sync()  # the free has completed; the mapping may stay
        t2 = time.perf_counter()
        if unmap:
            idle.sync()  # any synchronisation lets the driver unmap it
        outbox.put((t1 - t0, time.perf_counter() - t2))


def rounds(dev, size, name, mr, unmap, inbox, outbox) -> tuple[float, float, float]:
    """Median export, map and unmap seconds of REPEATS hand-offs (after one warm-up)."""
    times = []
    for _ in range(REPEATS + 1):
        buf = mr.allocate(size, stream=dev.default_stream)
        dev.sync()
        t0 = time.perf_counter()
        reserved, sz = buf.ipc_descriptor.__reduce__()[1]
        export = time.perf_counter() - t0
        inbox.put(("buf", name, bytes(reserved), int(sz), unmap))
        t_map, t_unmap = outbox.get(timeout=60)
        buf.close(dev.default_stream)  # after the receiver's free completed
        dev.sync()  # a pool at threshold 0 gives the memory back here
        times.append((export, t_map, t_unmap))
    return tuple(statistics.median(c) for c in zip(*times[1:], strict=True))


STEPS = ("export.new", "export.kept", "map.new", "map.mapped", "unmap.new")


def main() -> None:
    args = parser(__doc__).parse_args()
    from cuda.core import Device

    import gpu_serde

    gpu_serde.install()
    out = []
    dev = Device(0)
    dev.set_current()
    ctx = multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=receiver, args=(inbox, outbox), daemon=True)
    child.start()
    assert outbox.get(timeout=120) == "ready"
    print(f"# The driver's cost of a pool buffer hand-off ({dev.name}; {machine()})")
    print(
        "| size | export, new memory | export, pool keeps memory | map, new memory | "
        "map, still mapped | unmap (next sync) |"
    )
    print("|---|---|---|---|---|---|")
    try:
        for label, size in SIZES:
            cells = {}
            for name, keep, unmap in (("new", False, True), ("kept", True, False)):
                mr = ipc_pool(dev, 2 * size, keep=keep)
                inbox.put(("pool", name + label, pickle.dumps(mr)))
                assert outbox.get(timeout=60) == "ok"
                cells[name] = rounds(dev, size, name + label, mr, unmap, inbox, outbox)
            (e_new, m_new, u_new), (e_kept, m_kept, _) = cells["new"], cells["kept"]
            row = [e_new, e_kept, m_new, m_kept, u_new]
            print(f"| {label} | " + " | ".join(f"{t * 1e3:.3f} ms" for t in row) + " |")
            for step, t in zip(STEPS, row, strict=True):
                out.append(
                    result(
                        "driver",
                        "multiprocessing",
                        step,
                        t,
                        size=label,
                        stat=f"median of {REPEATS}",
                    )
                )
        write_json(args.json, "driver_costs", out)
    finally:
        inbox.put(None)
        child.join(30)


if __name__ == "__main__":
    main()
