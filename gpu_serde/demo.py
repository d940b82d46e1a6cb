"""``gpu-serde demo``: a local cluster whose workers number the GPUs differently, shown working.

Each worker receives the same Device and prints the local ordinal it resolved and the UUID: the
UUID is the same everywhere. Then a worker that cannot see the GPU shows the error it raises.
Without a real GPU the demo runs on simulated GPUs (:mod:`gpu_serde.testing`) and says so.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from gpu_serde import testing


def _say(text: str) -> None:
    print(text, flush=True)


def _prepare() -> tuple[list[str], bool]:
    """Return the host's GPU UUIDs (in host order) and whether they are simulated."""
    from gpu_serde.inventory import inventory

    if not testing.real_driver_present():
        gpus = testing.make_gpus(4, seed="demo")
        testing.activate(gpus)
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        _say("No CUDA driver here: running on 4 SIMULATED GPUs (gpu_serde.testing).")
    inv = inventory()
    if not inv.devices:
        raise SystemExit(f"gpu-serde demo: this process sees no GPU: {inv.reason}")
    return [d.uuid for d in inv.devices], inv.simulated


def _report(device: Any) -> tuple:
    """Runs on a worker: what it made of the Device it received."""
    import gpu_serde

    cvd = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    try:
        d = gpu_serde.resolve(device)
        return ("ok", cvd, d.device_id, "GPU-" + d.uuid)
    except gpu_serde.DeviceNotVisibleError as exc:
        return ("error", cvd, None, str(exc))


def _layout(uuids: list[str]) -> dict[str, str]:
    """Worker name -> CUDA_VISIBLE_DEVICES: rotated as dask-cuda does, plus one blind worker."""
    spec = {f"worker-{i}": ",".join(uuids[i:] + uuids[:i]) for i in range(len(uuids))}
    spec["no-gpu"] = ""
    return spec


def _table(rows: list[tuple[str, tuple]]) -> None:
    _say(
        f"\n{'worker':<10} {'CUDA_VISIBLE_DEVICES (abbreviated)':<44} {'ordinal':>7}  UUID received"
    )
    for name, (status, cvd, ordinal, what) in rows:
        if status != "ok":
            continue
        short = ",".join(e[:12] for e in cvd.split(",")) if cvd != "unset" else cvd
        _say(f"{name:<10} {short:<44} {ordinal:>7}  {what}")
    for name, (status, cvd, _, what) in rows:
        if status == "error":
            _say(f"\n{name} (CUDA_VISIBLE_DEVICES={cvd!r}) cannot see it, and says so:\n")
            _say("  " + what.replace("\n", "\n  "))


def _run_dask(layout: dict[str, str], send: Any) -> list[tuple[str, tuple]]:
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # quiet workers too
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import gpu_serde.dask

    workers = {
        name: {
            "cls": Nanny,
            "options": {"nthreads": 1, "host": "127.0.0.1", "env": {"CUDA_VISIBLE_DEVICES": cvd}},
        }
        for name, cvd in layout.items()
    }
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": ":0"}}
    _say(f"Starting a Dask cluster: 1 scheduler, {len(layout)} workers on 127.0.0.1 ...")
    with (
        SpecCluster(workers=workers, scheduler=scheduler, silence_logs=40) as cluster,
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
        _say("Shutting the cluster down ...")
        return rows


def _run_ray(layout: dict[str, str], send: Any) -> list[tuple[str, tuple]]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    import gpu_serde.ray

    _say(f"Starting a Ray cluster: a head and {len(layout)} worker nodes on 127.0.0.1 ...")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    try:
        for name, cvd in layout.items():
            count = len(cvd.split(",")) if cvd else 0
            cluster.add_node(
                num_cpus=1,
                num_gpus=count,
                resources={name: 1},
                object_store_memory=80 * 1024 * 1024,
                env_vars={"CUDA_VISIBLE_DEVICES": cvd},
            )
        gpu_serde.ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        task = ray.remote(max_retries=0)(_report)
        _say("Sending the Device to a task on every node (num_gpus = all of the node's GPUs) ...")
        refs = {}
        for name, cvd in layout.items():
            count = len(cvd.split(",")) if cvd else 0
            refs[name] = task.options(num_gpus=count, resources={name: 1}).remote(send)
        rows = [(n, ray.get(r, timeout=120)) for n, r in refs.items()]
        _say("Shutting the cluster down ...")
        return rows
    finally:
        ray.shutdown()
        cluster.shutdown()


def run(engine: str = "dask") -> int:
    """Run the demo on ``engine`` (``"dask"`` or ``"ray"``); returns the exit status."""
    from cuda.core import Device

    import gpu_serde

    runners: dict[str, Callable[[dict[str, str], Any], list]] = {"dask": _run_dask, "ray": _run_ray}
    started = time.monotonic()
    uuids, simulated = _prepare()
    gpu_serde.install()
    layout = _layout(uuids)
    send = Device(0)
    kind = "simulated GPU" if simulated else "GPU"
    _say(f"The driver sends Device(0) = {kind} {uuids[0]}.")
    try:
        rows = runners[engine](layout, send)
    except KeyboardInterrupt:
        _say("Interrupted: the cluster was torn down.")
        return 130
    _table(rows)
    same = {what for _, (status, _, _, what) in rows if status == "ok"}
    ok = same == {uuids[0]} and any(r[1][0] == "error" for r in rows)
    verdict = "the same UUID everywhere" if ok else "MISMATCH"
    _say(f"\n{engine}: {verdict}; {time.monotonic() - started:.1f} s.")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else "dask"))
