"""``gpu-serde demo``: a local cluster whose workers number the GPUs differently, shown working.

Each worker receives the same Device and prints the local ordinal it resolved and the UUID: the
UUID is the same everywhere; so is the GPU of the tasks routed with ``on()`` (rows ``on() ...``:
each lands where that GPU is). Then one worker fills a 64 MiB buffer from an IPC-enabled pool and
every other GPU worker maps it without a copy and reads the pattern back, at its own ordinal.
Last, a worker that cannot see the GPU shows the error it raises. Without a real GPU the demo runs
on simulated GPUs (:mod:`gpu_serde.testing`) and says so; their memory is host memory that the
workers map, so the buffer step runs there too.

Ray and distributed are imported in the functions that use them: each is an optional extra, and
the demo runs one engine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from cuda.core import (
    Buffer,
    Device,
    DeviceMemoryResource,
    DeviceMemoryResourceOptions,
    LegacyPinnedMemoryResource,
)

import gpu_serde
from gpu_serde import testing
from gpu_serde.inventory import inventory, uuid_of

Row = tuple[str, tuple[Any, ...]]  # worker name, what _report returned
Hop = dict[str, Any]  # one buffer hand-off, as _receive returned it plus "from"/"to"

HANDOFF_BYTES = 64 << 20  # the buffer handed from worker to worker
PEEK_BYTES = 4 << 10  # how much of each end of it a receiver reads back
EXPORTER = "worker-1"  # the worker that allocates the buffer (the layout always has it)


def _say(text: str) -> None:
    print(text, flush=True)


def _prepare() -> tuple[list[str], bool]:
    """Return the host's GPU UUIDs (in host order) and whether they are simulated."""
    if not testing.real_driver_present():
        gpus = testing.make_gpus(4)  # the README's, the pytest fixture's, `gpu-serde simulate 4`'s
        testing.activate(gpus)
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        _say("No CUDA driver here: running on 4 SIMULATED GPUs (gpu_serde.testing).")
    inv = inventory()
    if not inv.devices:
        raise SystemExit(f"gpu-serde demo: this process sees no GPU: {inv.reason}")
    return [d.uuid for d in inv.devices], inv.simulated


def _report(device: Any) -> tuple[Any, ...]:
    """Runs on a worker: what it made of the Device it received."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    try:
        d = gpu_serde.resolve(device)
        return ("ok", cvd, d.device_id, uuid_of(d.device_id))
    except gpu_serde.DeviceNotVisibleError as exc:
        return ("error", cvd, None, str(exc))


def _export(device: Any) -> tuple[Any, dict[str, Any]]:
    """Runs on the exporter: a buffer from an IPC-enabled pool on ``device``, filled with a fresh
    4-byte pattern, and what the receivers need to know about it."""
    dev = gpu_serde.resolve(device)
    dev.set_current()
    options = DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * HANDOFF_BYTES)
    pool = DeviceMemoryResource(dev, options)
    buf = pool.allocate(HANDOFF_BYTES, stream=dev.default_stream)
    pattern = os.urandom(4)
    buf.fill(pattern, stream=dev.default_stream)
    dev.default_stream.sync()
    return buf, {"ordinal": dev.device_id, "uuid": uuid_of(dev.device_id), "pattern": pattern}


def _read_ends(buf: Any, n: int) -> bytes:
    """The first and the last ``n`` bytes of device memory ``buf``, through pinned host memory."""
    dev = Device(buf.device_id)
    dev.set_current()  # Dask unpickles in another thread than the task's
    stream = dev.default_stream
    host = LegacyPinnedMemoryResource().allocate(n, stream=stream)
    try:
        seen = b""
        for offset in (0, buf.size - n):
            view = Buffer.from_handle(int(buf.handle) + offset, n, owner=buf)  # no copy, no free
            view.copy_to(host, stream=stream)
            stream.sync()
            seen += ctypes.string_at(int(host.handle), n)
        return seen
    finally:
        host.close()


def _receive(sent: tuple[Any, dict[str, Any]]) -> dict[str, Any]:
    """Runs on a receiver: map the buffer, read both its ends back and compare with the pattern."""
    buf, exporter = sent
    try:
        buf = gpu_serde.resolve(buf)
        n = min(PEEK_BYTES, buf.size)
        seen = _read_ends(buf, n)
        return {
            "exporter": exporter,
            "ordinal": buf.device_id,
            "uuid": uuid_of(buf.device_id),
            "mapped": buf.memory_resource.is_mapped,  # a pool mapped from the exporter
            "verified": seen == exporter["pattern"] * (2 * n // 4),
        }
    except Exception as exc:  # the demo reports any failure, typed ones included
        return {"exporter": exporter, "error": f"{type(exc).__name__}: {exc}"}


class _Exporter:
    """Ray actor: exports the buffer and holds it until the demo has checked every receiver."""

    def make(self, device: Any) -> dict[str, Any]:
        self.sent = _export(device)
        return self.sent[1]

    def send(self) -> tuple[Any, dict[str, Any]]:
        return self.sent  # pickled afresh for each receiver, so each one finds it held


def _gpus(layout: dict[str, str], name: str) -> int:
    """How many GPUs worker ``name`` of ``layout`` has."""
    return len(layout[name].split(",")) if layout[name] else 0


def _receivers(layout: dict[str, str]) -> list[str]:
    """The workers that map the exporter's buffer: every other worker with a GPU."""
    return [n for n, cvd in layout.items() if cvd and n != EXPORTER]


HANDOFF_TIMEOUT_S = 120  # the whole buffer step, all receivers together


def _deadline(seconds: float) -> Callable[[], float]:
    """A function giving the seconds left until ``seconds`` from now (at least 1)."""
    end = time.monotonic() + seconds
    return lambda: max(1.0, end - time.monotonic())


def _failed(to: str | None, exc: BaseException) -> Hop:
    """A hand-off that failed: to ``to``, or on the exporter when ``to`` is None."""
    exc = getattr(exc, "cause", None) or exc  # a Ray task's error wraps the original
    return {"from": EXPORTER, "to": to, "error": f"{type(exc).__name__}: {exc}"}


def _result(future: Any, left: Callable[[], float]) -> dict[str, Any]:
    """A Dask receiver's answer, within the time left."""
    return dict(future.result(timeout=left()))


def _ray_result(ref: Any, left: Callable[[], float]) -> dict[str, Any]:
    """A Ray receiver's answer, within the time left."""
    import ray

    return dict(ray.get(ref, timeout=left()))


def _hop(to: str, get: Callable[[], dict[str, Any]]) -> Hop:
    """A receiver's result as a hop; an exception getting it (timeout, lost worker) as a failure."""
    try:
        return {"from": EXPORTER, "to": to, **get()}
    except Exception as exc:
        return _failed(to, exc)


def _layout(uuids: list[str]) -> dict[str, str]:
    """Worker name -> CUDA_VISIBLE_DEVICES: rotated as dask-cuda does (at least two GPU workers,
    so that a buffer can move between them), plus one blind worker."""
    n = len(uuids)
    spec = {f"worker-{i}": ",".join(uuids[i % n :] + uuids[: i % n]) for i in range(max(n, 2))}
    spec["no-gpu"] = ""
    return spec


def _table(rows: list[Row]) -> None:
    shown = [
        (name, ",".join(e[:12] for e in cvd.split(",")) if cvd != "unset" else cvd, ordinal, what)
        for name, (status, cvd, ordinal, what) in rows
        if status == "ok"
    ]
    head = "CUDA_VISIBLE_DEVICES (abbreviated)"
    wide = max([len(head), *(len(short) for _, short, _, _ in shown)])  # columns line up
    named = max([len("worker"), *(len(name) for name, _, _, _ in shown)])
    _say(f"\n{'worker':<{named}} {head:<{wide}} {'ordinal':>7}  UUID received")
    for name, short, ordinal, what in shown:
        _say(f"{name:<{named}} {short:<{wide}} {ordinal:>7}  {what}")
    routed = [name for name, (status, *_) in rows if name.startswith("on() ") and status == "ok"]
    if routed:
        _say(
            f"({routed[0]}: {routed[0].split()[1][:-1]} of the {ROUTED_TASKS} tasks routed with "
            "on() ran there, which is where that GPU is, and each resolved the Device to it)"
        )


def _errors(rows: list[Row]) -> None:
    for name, (status, cvd, _, what) in rows:
        if status == "error":
            _say(f"\n{name} (CUDA_VISIBLE_DEVICES={cvd!r}) cannot see it, and says so:\n")
            _say("  " + what.replace("\n", "\n  "))


def _hop_line(h: Hop) -> tuple[bool, str]:
    """One line for one hand-off, and whether it proved what it should."""
    mib = HANDOFF_BYTES >> 20
    if "error" in h:
        where = f"{h['from']} -> {h['to']}" if h["to"] else f"on {h['from']}"
        return False, f"buffer {mib} MiB {where}: FAILED: {h['error']}"
    e = h["exporter"]
    line = (
        f"buffer {mib} MiB from {h['from']} (GPU {e['ordinal']} there) -> "
        f"{h['to']} (GPU {h['ordinal']} there): "
    )
    problems = []
    if h["uuid"] != e["uuid"]:
        problems.append(f"ANOTHER GPU ({h['uuid']}, sent {e['uuid']})")
    if not h["verified"]:
        problems.append("pattern NOT found")
    if not h["mapped"]:
        problems.append("not mapped from the exporter")
    if problems:
        return False, line + "FAILED: " + "; ".join(problems)
    return True, line + f"same GPU {h['uuid']}, pattern verified, no copy"


def _handoff(hops: list[Hop] | None) -> str:
    """Print the buffer hand-offs; return the verdict's words for them ("" when they failed)."""
    if hops is None:
        _say("\nbuffer hand-off: skipped.")
        return "buffer hand-off skipped"
    patterns = {h["exporter"]["pattern"].hex(" ") for h in hops if "exporter" in h}
    filled = f", filled with bytes {patterns.pop()}" if len(patterns) == 1 else ""
    _say(
        f"\nbuffer hand-off ({HANDOFF_BYTES >> 20} MiB from an IPC-enabled pool on {EXPORTER}"
        f"{filled}; each receiver reads its first and last {PEEK_BYTES >> 10} KiB back):"
    )
    results = [_hop_line(h) for h in hops]
    for _, line in results:
        _say("  " + line)
    good = bool(results) and all(ok for ok, _ in results)
    n = len(results)
    return f"buffer verified on {n} worker{'s' if n != 1 else ''}" if good else ""


def _handoff_dask(
    client: Any, by_name: dict[str, str], layout: dict[str, str], send: Any
) -> list[Hop]:
    """The exporter's task result stays on it; each receiver's task fetches it from there."""
    _say(f"Handing a GPU buffer from {EXPORTER} to the other GPU workers ...")
    left = _deadline(HANDOFF_TIMEOUT_S)
    made = client.submit(_export, send, workers=[by_name[EXPORTER]], pure=False)
    try:
        failure = made.exception(timeout=left())  # waits; the buffer never comes here
    except Exception as exc:  # timed out
        return [_failed(None, exc)]
    if failure is not None:
        return [_failed(None, failure)]
    checks = {
        n: client.submit(_receive, made, workers=[by_name[n]], pure=False)
        for n in _receivers(layout)
    }
    return [_hop(n, functools.partial(_result, f, left)) for n, f in checks.items()]


#: Ray tasks and actors keep their node's CUDA_VISIBLE_DEVICES (each node numbers the GPUs its
#: own way): Ray would set each task's to the GPUs it assigns, in one order on every node.
NOSET = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}


def _handoff_ray(layout: dict[str, str], send: Any) -> list[Hop]:
    """An actor exports the buffer (a GPU task's worker may exit when the task ends) and holds it
    until every receiving task has checked it."""
    import ray

    _say(f"Handing a GPU buffer from an actor on {EXPORTER} to the other GPU nodes ...")
    # each node's own order, as in the table above: "GPU n there" is the same numbering
    where = {"num_gpus": _gpus(layout, EXPORTER), "resources": {EXPORTER: 1}, "runtime_env": NOSET}
    actor = ray.remote(_Exporter).options(**where).remote()
    left = _deadline(HANDOFF_TIMEOUT_S)
    try:
        try:
            ray.get(actor.make.remote(send), timeout=left())
        except Exception as exc:
            return [_failed(None, exc)]
        check = ray.remote(max_retries=0)(_receive)
        checks = {}
        for n in _receivers(layout):
            on_n = check.options(num_gpus=_gpus(layout, n), resources={n: 1}, runtime_env=NOSET)
            checks[n] = on_n.remote(actor.send.remote())
        return [_hop(n, functools.partial(_ray_result, r, left)) for n, r in checks.items()]
    finally:
        ray.kill(actor)  # only now: every receiver has checked


# ---- routing: the same Device sent to tasks routed with on() lands on its GPU ----
# Each function returns rows for the demo's table ((label, (status, CUDA_VISIBLE_DEVICES, ordinal,
# UUID or error))), one per distinct outcome of the routed tasks (the label says how many had it),
# so the demo's verdict checks them as well.
ROUTED_TASKS = 8


def _where(device: Any, place: str) -> tuple[str, tuple[Any, ...]]:
    """Runs in a routed task: where it ran, and what it made of the Device (as the demo reports)."""
    if place == "dask":
        from distributed import get_worker

        place = str(get_worker().name)
    else:
        import ray

        place = "node " + ray.get_runtime_context().get_node_id()[:8]
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    try:
        d = gpu_serde.resolve(device)
        return place, ("ok", cvd, d.device_id, uuid_of(d.device_id))
    except gpu_serde.DeviceNotVisibleError as exc:
        return place, ("error", cvd, None, str(exc))


def _rows(results: list[tuple[str, tuple[Any, ...]]]) -> list[Row]:
    """One row per distinct outcome, labelled with how many routed tasks had it, and where."""
    counts = Counter(results)
    return [(f"on() {n}x {place}", report) for (place, report), n in counts.items()]


def dask_rows(client: Any, send: Any) -> list[Row]:
    """Send ``send`` to :data:`ROUTED_TASKS` tasks routed with ``gpu_serde.dask.on(send)``."""
    import gpu_serde.dask

    where = gpu_serde.dask.on(send, client)
    print(
        f"Sending the Device to {ROUTED_TASKS} tasks routed with gpu_serde.dask.on(): {where} ...",
        flush=True,
    )
    futures = client.map(_where, [send] * ROUTED_TASKS, place="dask", pure=False, **where)
    return _rows(client.gather(futures))


def ray_rows(send: Any) -> list[Row]:
    """Send ``send`` to :data:`ROUTED_TASKS` tasks routed with ``gpu_serde.ray.on(send)``."""
    import ray

    import gpu_serde.ray

    where = gpu_serde.ray.on(send)
    node = where["scheduling_strategy"].node_id[:8]
    gpu = where["runtime_env"]["env_vars"]["CUDA_VISIBLE_DEVICES"]
    print(
        f"Sending the Device to {ROUTED_TASKS} tasks routed with gpu_serde.ray.on(): node {node}, "
        f"CUDA_VISIBLE_DEVICES={gpu} ...",
        flush=True,
    )
    task = ray.remote(max_retries=0)(_where).options(**where)
    return _rows(ray.get([task.remote(send, "ray") for _ in range(ROUTED_TASKS)], timeout=300))


def _run_dask(
    layout: dict[str, str], send: Any, handoff: bool
) -> tuple[list[Row], list[Hop] | None]:
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # quiet workers too
    from distributed import Client, SpecCluster

    import gpu_serde.dask

    _say(f"Starting a Dask cluster: 1 scheduler, {len(layout)} workers on 127.0.0.1 ...")
    with (
        SpecCluster(**testing.spec_cluster_options(layout), silence_logs=40) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        client.wait_for_workers(len(layout), timeout=120)
        by_name = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        _say("Sending the Device to every worker ...")
        futures = {
            n: client.submit(_report, send, workers=[by_name[n]], pure=False) for n in layout
        }
        rows = [(n, f.result(timeout=120)) for n, f in futures.items()]
        rows += dask_rows(client, send)
        hops = _handoff_dask(client, by_name, layout, send) if handoff else None
        _say("Shutting the cluster down ...")
        return rows, hops


def _run_ray(
    layout: dict[str, str], send: Any, handoff: bool
) -> tuple[list[Row], list[Hop] | None]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    import gpu_serde.ray

    _say(f"Starting a Ray cluster: a head and {len(layout)} worker nodes on 127.0.0.1 ...")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for name, cvd in layout.items():
            cluster.add_node(
                num_cpus=1,
                num_gpus=_gpus(layout, name),
                resources={name: 1},
                object_store_memory=80 * 1024 * 1024,
                env_vars={"CUDA_VISIBLE_DEVICES": cvd},
            )
        gpu_serde.ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        task = ray.remote(max_retries=0)(_report)
        _say(
            "Sending the Device to a task on every node (num_gpus = all of the node's GPUs, in "
            "the node's own order: RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, as RL stacks "
            "set it) ..."
        )
        refs = {}
        for name in layout:
            count = _gpus(layout, name)
            options = {"num_gpus": count, "resources": {name: 1}, "runtime_env": NOSET}
            refs[name] = task.options(**options).remote(send)
        rows = [(n, ray.get(r, timeout=120)) for n, r in refs.items()]
        rows += ray_rows(send)
        hops = _handoff_ray(layout, send) if handoff else None
        _say("Shutting the cluster down ...")
        return rows, hops
    finally:
        ray.shutdown()
        cluster.shutdown()


def run(engine: str = "dask") -> int:
    """Run the demo on ``engine`` (``"dask"`` or ``"ray"``); returns the exit status."""
    runners: dict[str, Callable[..., tuple[list[Row], list[Hop] | None]]] = {
        "dask": _run_dask,
        "ray": _run_ray,
    }
    started = time.monotonic()
    uuids, simulated = _prepare()  # simulated GPUs keep memory too: the buffer step runs on both
    gpu_serde.install()
    layout = _layout(uuids)
    send = Device(0)
    kind = "simulated GPU" if simulated else "GPU"
    _say(f"The driver sends Device(0) = {kind} {uuids[0]}.")
    try:
        rows, hops = runners[engine](layout, send, True)
    except KeyboardInterrupt:
        _say("Interrupted: the cluster was torn down.")
        return 130
    _table(rows)
    buffers = _handoff(hops)
    _errors(rows)
    same = {what for _, (status, _, _, what) in rows if status == "ok"}
    devices_ok = same == {uuids[0]} and any(r[1][0] == "error" for r in rows)
    verdict = "the same UUID everywhere" if devices_ok else "MISMATCH"
    verdict += f"; {buffers or 'buffer hand-off FAILED'}"
    ok = devices_ok and bool(buffers)
    _say(f"\n{engine}: {verdict}; {time.monotonic() - started:.1f} s.")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else "dask"))
