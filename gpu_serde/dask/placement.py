"""Dask: send a task to a worker that sees its GPU (``gpu_serde.dask.on``).

How workers say what they have: :class:`~gpu_serde.dask.GPUSerdePlugin` (and the
``--preload``) publish, on each worker that sees a GPU, one Dask *resource* named
``gpu_serde:GPU-<uuid>`` (:func:`gpu_serde.routing.resource_name`) for the worker's own GPU (its
device 0, the GPU dask-cuda gives it: dask-cuda rotates ``CUDA_VISIBLE_DEVICES`` so each worker's
device 0 is another GPU), with amount 1; it shows wherever the worker's resources are listed
(docs/placement.md says so). A resource is
the scheduler's own placement mechanism: ``on()`` reads every worker's resources in one
``scheduler_info`` call, the scheduler itself keeps the task off other workers, and a worker that
restarts (a new address) publishes it again, so a waiting task still finds it. Workers that only
*see* a GPU (not as device 0) are found by asking them (``client.run``, cached per worker: a
worker's view is fixed when it starts), only when no worker owns the GPU.

What ``on()`` returns:

- the GPU has an owner: ``{"resources": {"gpu_serde:GPU-...": 1}}``: the task runs on an owner
  and holds its
  GPU: **one routed task at a time per GPU** (as ``dask worker --resources GPU=1`` does).
  ``exclusive=False`` gives ``{"workers": [owners], "allow_other_workers": False}`` instead:
  any number at once, and the task waits if those workers go away (their addresses change).
- no owner, some workers see it: ``{"workers": [those], "allow_other_workers": False}``, not
  exclusive.
- nobody sees it: :class:`~gpu_serde.DeviceNotVisibleError` at once, naming every worker and
  what it sees (a task restricted to a resource nobody has would wait for ever).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable
from typing import Any

from distributed import get_client

from gpu_serde.errors import DeviceNotVisibleError
from gpu_serde.inventory import inventory
from gpu_serde.routing import resource_name, target_uuid

_lock = threading.Lock()
_views: dict[tuple[str, str], tuple[list[str], str]] = {}  # (scheduler, worker) -> (uuids, why)


def published() -> dict[str, float]:
    """The resources this process publishes as a Dask worker: ``{"gpu_serde:<uuid of device 0>":
    1}``, or ``{}`` when it sees no GPU."""
    devices = inventory().devices
    return {resource_name(devices[0].uuid): 1.0} if devices else {}


def publish(worker: Any) -> Awaitable[None] | None:
    """Publish ``worker``'s own GPU as a resource (called by the plugin's ``setup`` and the
    preload). Returns the awaitable of ``Worker.set_resources`` on a registered worker (the
    plugin's ``setup`` returns it, so registration waits for it); before registration (a
    preload) it sets the worker's starting resources, which it sends when it registers."""
    resources = published()
    if not resources:
        return None
    if worker.status.name == "running":
        coro: Awaitable[None] = worker.set_resources(**resources)
        return coro
    state = worker.state  # not registered yet: what Worker(resources=...) sets
    for name, amount in resources.items():
        state.total_resources[name] = amount
        state.available_resources[name] = amount
    return None


def view() -> tuple[list[str], str]:
    """Runs on a worker: the canonical UUIDs it sees in ordinal order, and why none when empty."""
    inv = inventory()
    return [d.uuid for d in inv.devices], inv.reason


def _worker_views(client: Any, addresses: list[str]) -> dict[str, tuple[list[str], str]]:
    """What each worker at ``addresses`` sees; answers are cached, failures asked again later."""
    key = client.scheduler.address
    with _lock:
        views = {a: _views[(key, a)] for a in addresses if (key, a) in _views}
    missing = [a for a in addresses if a not in views]
    if missing:
        got = client.run(view, workers=missing, on_error="return")
        for address in missing:
            result = got.get(address, RuntimeError("it left"))
            if isinstance(result, BaseException):
                views[address] = ([], f"could not ask it: {result!r:.300}")
                continue
            views[address] = (list(result[0]), str(result[1]))
            with _lock:
                _views[(key, address)] = views[address]
    return {a: views[a] for a in addresses}


def _not_seen(uuid: str, client: Any, info: dict[str, Any]) -> DeviceNotVisibleError:
    views = _worker_views(client, sorted(info)) if info else {}
    lines = []
    for address, (uuids, why) in views.items():
        name = info[address].get("name", address)
        seen = ", ".join(f"{i}: {u}" for i, u in enumerate(uuids)) if uuids else f"no GPU ({why})"
        lines.append(f"  worker {name!r} ({address}): {seen}")
    workers = "\n".join(lines) or "  (no workers)"
    return DeviceNotVisibleError(
        f"no worker of scheduler {client.scheduler.address} sees GPU {uuid}; the workers see:\n"
        f"{workers}\n"
        "Start a worker with that GPU in its CUDA_VISIBLE_DEVICES (dask cuda worker gives each "
        "GPU a worker), and register gpu_serde there (gpu_serde.dask.register(client) or "
        "--preload gpu_serde.dask).",
        uuid=uuid,
    )


def on(device: Any, client: Any = None, *, exclusive: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``client.submit``, ``map`` and ``compute`` that run the task on a
    worker that sees ``device``'s GPU: the worker that owns it (its device 0) when there is one.

    ``client.submit(f, dev, **gpu_serde.dask.on(dev))``. The GPU is found by UUID, so ``dev``
    may be the UUID itself (``"GPU-..."``), a Device of this process, a placeholder for a GPU only
    the workers see, a device memory resource, a buffer, a CUDA torch tensor or CuPy array (or what
    ``gpu_serde.share`` made of one, or the placeholder of one sent from a GPU not seen here), or a
    list of them on one GPU.

    Args:
        device: what the work is for (see :func:`gpu_serde.routing.target_uuid`).
        client: the ``distributed.Client`` (default: the current one, ``get_client()``).
        exclusive: with an owner, hold its GPU resource, so that one routed task at a time runs
            on that GPU (default); ``False`` restricts the task to the owners without holding it.

    Returns:
        ``{"resources": {"gpu_serde:GPU-...": 1}}``, or
        ``{"workers": [...], "allow_other_workers": False}``
        (see the module's docstring for which, and what each guarantees).

    Raises:
        DeviceNotVisibleError: no worker sees that GPU; the message lists every worker's GPUs.
            (Also the reason of a memory placeholder passed as ``device``: as
            :func:`gpu_serde.routing.target_uuid`.)
        TypeError, PlacementError: ``device`` is not one of those, or names several GPUs;
            ``client`` is asynchronous (TypeError).
        ValueError: no ``client`` was given and this process has none.
    """
    uuid = target_uuid(device)
    if client is None:
        try:
            client = get_client()
        except ValueError:  # distributed's "No global client found and no address provided"
            raise ValueError(
                "gpu_serde.dask.on() asks the scheduler which worker sees the GPU: create a "
                "distributed.Client first, or pass one as client=..."
            ) from None
    if getattr(client, "asynchronous", False):
        raise TypeError("gpu_serde.dask.on() needs a synchronous Client (it asks the scheduler)")
    info: dict[str, Any] = client.scheduler_info(n_workers=-1)["workers"]
    name = resource_name(uuid)
    owners = sorted(a for a, w in info.items() if w.get("resources", {}).get(name, 0) >= 1)
    if owners:
        if exclusive:
            return {"resources": {name: 1}}
        return {"workers": owners, "allow_other_workers": False}
    views = _worker_views(client, sorted(info))
    seers = [a for a, (uuids, _) in views.items() if uuid in uuids]
    if seers:
        return {"workers": seers, "allow_other_workers": False}
    raise _not_seen(uuid, client, info)
