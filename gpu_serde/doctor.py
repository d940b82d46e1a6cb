"""``gpu-serde doctor``: what every worker of a running Ray or Dask cluster sees, and what is wrong.

For each worker: host, pid, ``CUDA_VISIBLE_DEVICES``, its GPU map (ordinal, UUID) and whether
gpu_serde is installed there. Flags workers without gpu_serde and GPUs that more than one worker
(Dask) or node (Ray) claims.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class WorkerReport:
    """What one worker process said about itself."""

    name: str
    host: str
    pid: int
    cuda_visible_devices: str | None
    gpus: list[tuple[int, str]]
    reason: str
    installed: bool
    version: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def probe() -> dict[str, Any]:
    """Runs on a worker: this process's view (never initialises CUDA before the engine assigns
    GPUs, since it runs as a task)."""
    import gpu_serde
    from gpu_serde.inventory import inventory
    from gpu_serde.registry import is_installed

    inv = inventory()
    return {
        "host": inv.host,
        "pid": os.getpid(),
        "cvd": inv.cuda_visible_devices,
        "gpus": [(d.ordinal, d.uuid) for d in inv.devices],
        "reason": inv.reason,
        "installed": is_installed(),
        "version": gpu_serde.__version__,
    }


def locate(device: Any) -> tuple[int, str]:
    """Runs on a worker: the local ordinal and canonical UUID of a received Device.

    Raises:
        DeviceNotVisibleError: the Device's GPU is not visible in this worker.
    """
    import gpu_serde
    from gpu_serde.inventory import uuid_of

    d = gpu_serde.resolve(device)
    return d.device_id, uuid_of(d.device_id)


def _report(name: str, raw: dict[str, Any] | BaseException) -> WorkerReport:
    if isinstance(raw, BaseException):
        return WorkerReport(name, "?", 0, None, [], "", False, "", [f"probe failed: {raw!r}"])
    r = WorkerReport(
        name,
        raw["host"],
        raw["pid"],
        raw["cvd"],
        [tuple(g) for g in raw["gpus"]],
        raw["reason"],
        raw["installed"],
        raw["version"],
    )
    if not r.installed:
        r.problems.append("gpu_serde is not installed in this worker: Devices leave it by ordinal")
    return r


def _flag_shared(reports: list[WorkerReport], what: str, *, primary_only: bool) -> None:
    """Flag GPUs claimed twice: any GPU of a Ray node, or a Dask worker's device 0 (dask-cuda
    workers see every GPU, rotated, and each computes on its own device 0)."""
    owners: dict[str, list[str]] = defaultdict(list)
    for r in reports:
        for _, uuid in r.gpus[:1] if primary_only else r.gpus:
            owners[uuid].append(r.name)
    for r in reports:
        for _, uuid in r.gpus[:1] if primary_only else r.gpus:
            if len(owners[uuid]) > 1:
                others = ", ".join(n for n in owners[uuid] if n != r.name)
                role = f"device 0 of {what}" if primary_only else "seen by"
                r.problems.append(f"{uuid} is also {role} {others}")


def survey_dask(address: str, timeout: float = 30) -> list[WorkerReport]:
    """Probe every worker of the Dask scheduler at ``address``."""
    from distributed import Client

    with Client(address, timeout=timeout) as client:
        names = {
            a: w.get("name", a) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
        }
        raw = client.run(probe, on_error="return")
    reports = []
    for addr, result in sorted(raw.items()):
        reports.append(_report(f"{names.get(addr, addr)} ({addr})", result))
    _flag_shared(reports, "worker", primary_only=True)
    return reports


def survey_ray(address: str, node_ip_address: str | None = None) -> list[WorkerReport]:
    """Probe one worker on every alive node of the Ray cluster at ``address``, in a job started
    with gpu_serde's hook; a node where the hook did not run is flagged. ``node_ip_address`` is
    this machine's address as the cluster knows it (Ray's ``_node_ip_address``), where Ray cannot
    tell by itself (a cluster on a loopback address other than 127.0.0.1)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import gpu_serde.ray

    extra = {"_node_ip_address": node_ip_address} if node_ip_address else {}
    ray.init(address=address, runtime_env=gpu_serde.ray.runtime_env(), log_to_driver=False, **extra)
    try:
        task = ray.remote(max_retries=0)(probe)
        refs = {}
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            gpus = int(node.get("Resources", {}).get("GPU", 0))
            where = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            name = f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress')}, {gpus} GPU)"
            ref = task.options(num_gpus=gpus, num_cpus=0, scheduling_strategy=where).remote()
            refs[name] = (ref, gpus)
        reports = []
        owning = []
        for name, (ref, gpus) in refs.items():
            try:
                r = _report(name, ray.get(ref, timeout=120))
            except Exception as exc:  # a node that cannot run the probe is itself a finding
                r = _report(name, exc)
            reports.append(r)
            if gpus:
                owning.append(r)
            elif r.gpus:
                r.notes.append(
                    f"Ray gives this node no GPU, yet its tasks see {len(r.gpus)} "
                    "(num_gpus=0 tasks are not masked)"
                )
    finally:
        ray.shutdown()
    for r in reports:
        if not r.installed:
            r.problems[:] = [
                "gpu_serde's worker hook did not run here (is gpu_serde installed on this node?)"
            ]
    _flag_shared(owning, "node", primary_only=False)
    return reports


def render(reports: list[WorkerReport]) -> str:
    """The doctor's text: one block per worker, problems marked ``!``."""
    lines = []
    for r in reports:
        cvd = "unset" if r.cuda_visible_devices is None else repr(r.cuda_visible_devices)
        state = f"gpu_serde {r.version} installed" if r.installed else "gpu_serde NOT installed"
        lines.append(f"{r.name}: host {r.host}, pid {r.pid}, CUDA_VISIBLE_DEVICES={cvd}, {state}")
        lines += [f"    {o}  {u}" for o, u in r.gpus] or [f"    no GPU: {r.reason}"]
        lines += [f"  - {n}" for n in r.notes]
        lines += [f"  ! {p}" for p in r.problems]
    bad = sum(bool(r.problems) for r in reports)
    lines.append(f"{len(reports)} worker(s), {bad} with problems")
    return "\n".join(lines)
