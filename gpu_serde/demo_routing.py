"""The demo's routing step: the same Device sent to tasks routed with ``on()`` lands on its GPU.

Each function returns rows for the demo's table (``(label, (status, CUDA_VISIBLE_DEVICES,
ordinal, UUID or error))``), one per distinct outcome of the routed tasks (the label says how many
had it), so the demo's verdict checks them as well.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

ROUTED_TASKS = 8

Row = tuple[str, tuple[Any, ...]]


def _where(device: Any, place: str) -> tuple[str, tuple[Any, ...]]:
    """Runs in a routed task: where it ran, and what it made of the Device (as the demo reports)."""
    import gpu_serde
    from gpu_serde.inventory import uuid_of

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
