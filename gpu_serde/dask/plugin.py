"""Dask: gpu_serde on every worker, through a worker plugin (:func:`register`) or a preload
(:func:`dask_setup`); and Devices, buffers and pools tokenized without an ordinal.

The scheduler needs gpu_serde installed (it unpickles and re-pickles task arguments) but no GPU
and no CUDA driver. A ``dask scheduler`` that preloads gpu_serde only forwards: it rebuilds no
payload, and a live CUDA object in a task argument (pickled by its ordinal, by a client without
gpu_serde) reaches the worker as a ``HandoffError`` that says so, never as the scheduler's GPU of
that number.
"""

from __future__ import annotations

import logging
import os
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from cuda.core import (
    Buffer,
    Device,
    DeviceMemoryResource,
    PinnedMemoryResource,
    VirtualMemoryResourceOptions,
)
from dask.tokenize import normalize_token
from distributed import Client, Scheduler, Worker
from distributed.diagnostics.plugin import WorkerPlugin

from gpu_serde.dask import hosts
from gpu_serde.dask import serializers as _serializers  # noqa: F401  (registers the Buffer's)
from gpu_serde.dask.placement import publish
from gpu_serde.errors import HandoffError
from gpu_serde.identity import uuid_bytes
from gpu_serde.inventory import inventory, set_role, uuid_of
from gpu_serde.memory.unsent import unsent
from gpu_serde.registry import ensure_installed, forward_only

logger = logging.getLogger("gpu_serde.dask")


def _tokenize_device(dev: Device) -> tuple[str, bytes]:
    """Devices hash by UUID, so task keys do not depend on the local ordinal."""
    try:
        uuid = uuid_of(dev.device_id)
    except ValueError:  # the driver showed cuda.core a device it did not show the inventory
        uuid = dev.uuid
    return ("cuda.core.Device", uuid_bytes(uuid))


_buffer_tokens: dict[int, str] = {}  # id(buffer) -> its token, while it lives


def _tokenize_buffer(buf: Buffer) -> tuple[str, str]:
    """A buffer hashes as itself: one token per Buffer object for its life, never exported (which
    would keep it alive for importers that never come). Not by address: a pool hands the same
    address to the next buffer, and two buffers with one key let the scheduler forget the second
    when it forgets the first (a flaky "lost dependencies" after ``scatter``)."""
    token = _buffer_tokens.get(id(buf))
    if token is None:
        token = _buffer_tokens[id(buf)] = uuid.uuid4().hex
        weakref.finalize(buf, _buffer_tokens.pop, id(buf), None)
    return ("cuda.core.Buffer", token)


def _tokenize_pool(mr: DeviceMemoryResource | PinnedMemoryResource) -> tuple[str, str, int, int]:
    """Pools hash by identity: hashing never exports them."""
    return (type(mr).__name__, str(mr.uuid), id(mr), os.getpid())


normalize_token.register(Device)(_tokenize_device)
normalize_token.register(Buffer)(_tokenize_buffer)
normalize_token.register((DeviceMemoryResource, PinnedMemoryResource))(_tokenize_pool)


def _worker_alive(worker: Any) -> Callable[[], bool]:
    return lambda: worker.status.name not in ("closing", "closed", "closing_gracefully", "failed")


async def _setup_worker(worker: Any) -> None:
    ensure_installed("Dask")
    set_role(f"dask worker {worker.address}")
    inv = inventory()
    logger.debug(
        "gpu_serde: dask worker %s pid %d:\n%s", worker.address, os.getpid(), inv.describe()
    )
    hosts.mark(worker.connection_args)  # its host, to the peers it asks for data
    published = publish(worker)  # its own GPU as a resource, for on()
    if published is not None:
        await published
    await hosts.join(worker.scheduler, worker.address)
    hosts.start_following(worker.scheduler, worker.address, _worker_alive(worker))


class GPUSerdePlugin(WorkerPlugin):
    """Distributed ``WorkerPlugin`` that installs gpu_serde on a worker.

    ``setup`` installs the reducers, warms the GPU inventory, names the worker in error
    messages, publishes the worker's own GPU (for :func:`on`) and its host (so that buffers reach
    it mapped from its own host and by value from others: :mod:`gpu_serde.dask.serializers`). It is
    idempotent (registering it again is a no-op) and has the fixed name ``"gpu_serde"``.
    """

    idempotent = True
    name = "gpu_serde"

    async def setup(self, worker: Any) -> None:
        """Install gpu_serde in ``worker``'s process and publish what it has."""
        await _setup_worker(worker)


def register(client: Any) -> Awaitable[None] | None:
    """Install gpu_serde in this process and on every current and future worker of ``client``,
    and publish this process's host to the cluster (buffers it scatters or gathers then travel
    mapped on its host and by value beyond it).

    Args:
        client: a connected ``distributed.Client``.

    Returns:
        None; for an asynchronous client, an awaitable to await.

    Raises:
        TypeError: ``client`` is not a ``distributed.Client``.
    """
    if not isinstance(client, Client):
        raise TypeError(
            f"gpu_serde.dask.register() takes a distributed.Client, not {type(client).__name__}"
        )
    ensure_installed("Dask")
    set_role("dask client")
    hosts.mark(client.connection_args)
    if client.asynchronous:
        return _register_async(client)
    client.register_plugin(GPUSerdePlugin())
    client.sync(_join_client, client)
    return None


async def _join_client(client: Any) -> None:
    name = f"client {client.id}"
    await hosts.join(client.scheduler, name)
    alive = lambda: client.status not in ("closing", "closed")  # noqa: E731
    hosts.start_following(client.scheduler, name, alive)


async def _register_async(client: Any) -> None:
    await client.register_plugin(GPUSerdePlugin())
    await _join_client(client)


async def dask_setup(service: Any) -> None:
    """Preload hook: ``dask worker --preload gpu_serde.dask`` / ``dask scheduler --preload ...``.

    In a worker it does what :class:`GPUSerdePlugin` does; in a scheduler it installs gpu_serde
    and the host table's plugin (:class:`~gpu_serde.dask.hosts.HostTablePlugin`)."""
    if isinstance(service, Worker):
        await _setup_worker(service)
        return
    ensure_installed("Dask")
    set_role(f"dask {type(service).__name__.lower()} {getattr(service, 'address', '')}")
    if isinstance(service, Scheduler):
        if _scheduler_alone():
            forward_only(_sent_by_ordinal)
        service.add_plugin(hosts.HostTablePlugin(), idempotent=True)


def _scheduler_alone() -> bool:
    """True in a process that the ``dask scheduler`` command runs (``python -m
    distributed.cli.dask_scheduler`` too): a scheduler and nothing else. Not where a scheduler
    shares its process with a client (``LocalCluster``) or a worker (``dask spec``)."""
    import click  # distributed's command lines are click's

    ctx = click.get_current_context(silent=True)
    code = getattr(getattr(getattr(ctx, "command", None), "callback", None), "__code__", None)
    return code is not None and code.co_filename.replace(os.sep, "/").endswith(
        "distributed/cli/dask_scheduler.py"
    )


def _sent_by_ordinal(obj: object, own: Callable[[Any], tuple[Any, ...]]) -> tuple[Any, ...]:
    """A forwarding scheduler's guard (:func:`gpu_serde.registry.forward_only`). What names a
    GPU (a Device, GPU memory, a CUDA tensor, a CuPy array, options with peers) came here
    without gpu_serde, by a CUDA ordinal or current device, and travels on as the error,
    without being reduced here (no copy, no hold); what names none (a CPU tensor, options
    without peers) is pickled as it would be without gpu_serde. Never raises: a scheduler that
    cannot pickle a task drops workers."""
    what = type(obj).__name__
    if isinstance(obj, VirtualMemoryResourceOptions) and not obj.peers:
        return obj.__reduce_ex__(2)  # type: ignore[no-any-return]  # plain data, no GPU in it
    if getattr(obj, "is_cuda", True) is False:  # a CPU torch tensor: torch's own reduction
        try:
            return own(obj)
        except Exception as exc:
            return unsent(what, exc)
    return unsent(
        what,
        HandoffError(
            f"a live {what} reached the Dask scheduler, which only forwards: it was pickled "
            "by its CUDA ordinal or current device, without gpu_serde (another GPU in each "
            "process). Call gpu_serde.dask.register(client) where it is sent from (or preload "
            "gpu_serde.dask there) and send it again"
        ),
    )
