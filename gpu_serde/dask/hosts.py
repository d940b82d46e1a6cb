"""Where a Dask peer is: the host identities of a cluster's gpu_serde processes, which the
Buffer serializer (:mod:`gpu_serde.dask.serializers`) reads to pick how a buffer travels.

Two sources, both filled by gpu_serde itself:

- *the handshake*: the connections that gpu_serde's workers and registered clients open carry
  their host identity (:mod:`gpu_serde.hostid`) in the comm handshake
  (``handshake_overrides``, an argument of ``distributed.comm.connect`` that distributed's own
  scheduler uses the same way, set through the worker's or client's ``connection_args``). A
  worker that answers a request (a peer fetching a result, a client gathering directly) reads the
  requester's host from the comm.
- *the cluster's table*: each worker and registered client publishes its host identity in the
  scheduler's metadata (:data:`TABLE_KEY`) and follows the table (every :data:`REFRESH_S`). It
  places a peer reached at its listening address (a client scattering directly to a worker), and
  says whether the cluster is on one host. In a cluster of several hosts, a process that joins
  waits :data:`REFRESH_S` before it takes work, so that every process knows of its host first.
  The scheduler forgets a worker or client when it leaves, however it leaves
  (:class:`HostTablePlugin`, which every joining process registers there).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from distributed.comm import core as _comm
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from gpu_serde.hostid import host_id

logger = logging.getLogger("gpu_serde.dask")

#: The handshake entry (and the comm ``context``'s) that names a peer's host identity.
HANDSHAKE_KEY = "gpu_serde-host"
#: The scheduler metadata key under which processes publish their host identities.
TABLE_KEY = "gpu_serde-hosts"
#: Seconds between two reads of the cluster's table by a worker or a registered client.
REFRESH_S = 2.0


class HostTable:
    """The host identities of a cluster's gpu_serde processes, as this process last read them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[str, str] = {}

    def update(self, table: object) -> None:
        """Take the scheduler's table (``{process: host hex}``); malformed entries are dropped."""
        if not isinstance(table, dict):
            return
        clean = {
            str(k): v
            for k, v in table.items()
            if isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v)
        }
        with self._lock:
            self._hosts = clean

    def host_of(self, address: object) -> bytes | None:
        """The host identity published for a process at ``address`` (a worker's listening
        address), or None."""
        with self._lock:
            found = self._hosts.get(address) if isinstance(address, str) else None
        return bytes.fromhex(found) if found else None

    def one_host(self) -> bool:
        """True when every published process is on this host (and at least one published)."""
        with self._lock:
            return bool(self._hosts) and all(v == host_id().hex() for v in self._hosts.values())

    def hosts(self) -> dict[str, str]:
        """A copy of the table."""
        with self._lock:
            return dict(self._hosts)


table = HostTable()


def peer_host(context: dict[str, Any]) -> bytes | None:
    """The host identity of the peer that distributed's serializer ``context`` names, from the
    handshake or the table; None when unknown."""
    peer = context.get("recipient")
    if not isinstance(peer, dict):
        return None
    marked = peer.get(HANDSHAKE_KEY)
    if isinstance(marked, str):
        with contextlib.suppress(ValueError):
            raw = bytes.fromhex(marked)
            if len(raw) == 16:
                return raw
    return table.host_of(peer.get("address"))


def _takes_overrides() -> bool:
    return "handshake_overrides" in inspect.signature(_comm.connect).parameters


def mark(connection_args: object) -> bool:
    """Add this process's host identity to the handshake of the connections that a worker or
    client with these ``connection_args`` opens; False where distributed cannot carry it (its
    ``connect`` takes no ``handshake_overrides``: peers then count as of unknown host)."""
    if not isinstance(connection_args, dict) or not _takes_overrides():
        return False
    overrides = connection_args.get("handshake_overrides")
    if not isinstance(overrides, dict):
        overrides = connection_args["handshake_overrides"] = {}
    overrides[HANDSHAKE_KEY] = host_id().hex()
    return True


async def _read(scheduler: Any) -> dict[str, Any]:
    got = await scheduler.get_metadata(keys=[TABLE_KEY], default={})
    return got if isinstance(got, dict) else {}


class HostTablePlugin(SchedulerPlugin):
    """Scheduler plugin: the cluster's table forgets a worker or a client when it leaves (a
    worker killed without a word too). At every worker or client that comes or goes it also drops
    the entries of processes the scheduler does not know (one that published and died before it
    registered); a live one that published before it registered publishes again within
    :data:`REFRESH_S` (:func:`follow`)."""

    idempotent = True
    name = "gpu_serde-hosts"

    async def start(self, scheduler: Any) -> None:
        """Drop the entries of processes that left before the plugin was there."""
        self._prune(scheduler)

    @staticmethod
    def _prune(scheduler: Any, gone: str = "") -> None:
        table = scheduler.task_metadata.get(TABLE_KEY)
        if isinstance(table, dict):
            known = set(scheduler.workers) | {f"client {c}" for c in scheduler.clients}
            for name in [n for n in table if n not in known or n == gone]:
                table.pop(name, None)

    def add_worker(self, scheduler: Any, worker: str) -> None:
        """A worker came: drop the entries of processes the scheduler does not know."""
        self._prune(scheduler)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left (closed, killed, retired): forget its host."""
        self._prune(scheduler, worker)

    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client left: forget its host."""
        self._prune(scheduler, f"client {client}")


async def _register_table_plugin(scheduler: Any) -> None:
    await scheduler.register_scheduler_plugin(
        plugin=dumps(HostTablePlugin()), name=HostTablePlugin.name, idempotent=True
    )


async def join(scheduler: Any, name: str) -> None:
    """Publish this process's host identity as ``name`` (a worker's address, a client's id) in
    the table of the scheduler behind ``scheduler`` (an rpc), and read the table. In a cluster of
    several hosts it then waits :data:`REFRESH_S` (and a little) and reads it again, so that every
    process knows of its host before it takes work, and it of theirs. Failures are logged, never
    raised."""
    own = host_id().hex()
    try:
        await _register_table_plugin(scheduler)
        await scheduler.set_metadata(keys=[TABLE_KEY, name], value=own)
        table.update(await _read(scheduler))
    except Exception as exc:  # the plugin's setup must not fail a worker
        logger.warning(
            "gpu_serde: could not publish this process's host to the scheduler (%s); buffers "
            "sent to it travel both mapped and by value",
            exc,
        )
        return
    if any(v != own for v in table.hosts().values()):
        await asyncio.sleep(REFRESH_S + 0.5)
        with contextlib.suppress(Exception):
            table.update(await _read(scheduler))


async def follow(scheduler: Any, name: str, alive: Callable[[], bool]) -> None:
    """Every :data:`REFRESH_S` while ``alive()``: publish this process's entry again (the
    scheduler may have pruned it: :class:`HostTablePlugin`) and read the scheduler's table; a
    failed turn is tried again at the next."""
    own = host_id().hex()
    while alive():
        await asyncio.sleep(REFRESH_S)
        if not alive():
            return
        with contextlib.suppress(Exception):
            await scheduler.set_metadata(keys=[TABLE_KEY, name], value=own)
            table.update(await _read(scheduler))


_following: set[asyncio.Future[None]] = set()


def start_following(scheduler: Any, name: str, alive: Callable[[], bool]) -> None:
    """Run :func:`follow` on the running event loop (a task kept until it ends)."""
    task = asyncio.ensure_future(follow(scheduler, name, alive))
    _following.add(task)
    task.add_done_callback(_following.discard)
