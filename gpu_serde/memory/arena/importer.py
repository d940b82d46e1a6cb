"""``ArenaMemoryResource``, the receiver's side: each region mapped once per process, every
buffer an offset in it. The exporter's side is :mod:`gpu_serde.memory.arena.exporter`.

The first buffer (or arena) a process receives from a region maps the region here
(:func:`attach`: the host check, the device by UUID, the descriptor from the exporter's broker, the
mapping and the opening of the exporter's event) and keeps it mapped for the process's life. The
cache is keyed by the exporter and the descriptor's token, not by the id a payload claims, and the
exporter's broker checks the claimed id and size against the descriptor: a stream of payloads,
forged or not, maps each real region at most once. Every later buffer is a hold
(:class:`~gpu_serde.memory.lifetime.Import`), a wait for the sender's event and a ``Buffer`` at
``base + offset``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from cuda.core import Buffer, Device, MemoryResource, Stream

from gpu_serde import wire
from gpu_serde.errors import HandoffError, TokenRefusedError
from gpu_serde.format.memory import AbufPayload, RegionPayload, decode_abuf, decode_region
from gpu_serde.memory import broker as _broker
from gpu_serde.memory import driver as _driver
from gpu_serde.memory import lifetime
from gpu_serde.memory.arena.exporter import ArenaMemoryResource, exported, human
from gpu_serde.memory.lifetime import Import, Imported, MappedDeviceMemory


@dataclass(frozen=True)
class Region:
    """A region mapped in this process: where, on which of this process's devices, and the
    exporter's event (opened here) that a hand-off waits for."""

    id: bytes
    wire: tuple[Any, ...]  #: the region payload it was mapped for
    base: int
    size: int
    ordinal: int
    event: Any  #: None when the exporter had exited (a keeper served the region)
    address: str  #: the exporter's broker

    def wait(self) -> None:
        """Block until the exporter's work before its latest hand-off from this region is done
        (nothing to wait for once it has exited: it waited for its work first). Call it while
        holding a hold at the exporter.

        Raises:
            HandoffError: the driver refused (the exporter's context is gone, ...).
        """
        if self.event is None or _broker.exited(self.address, holding=True):
            return
        try:
            _driver.wait(self.event)
        except HandoffError:
            if not _broker.exited(self.address, holding=True):  # exited meanwhile: work done
                raise


_attached: dict[tuple[str, bytes], Region] = {}  # (broker address, token) -> the region here
_lock = threading.Lock()
maps = 0  #: how many regions this process has mapped (each once): tests read it


ARENA_MEMORY = "GPU memory (an ArenaMemoryResource)"  #: what an arena's memory is called


def attach(p: RegionPayload, wire_payload: tuple[Any, ...], what: str = ARENA_MEMORY) -> Region:
    """The region that ``p`` names, mapped in this process: the first time per exporter and
    descriptor, then from the cache. ``what`` names the memory in the errors of a first map.

    Raises:
        OtherHostError, DeviceNotVisibleError, ExporterGoneError: as for a pool.
        TokenRefusedError: the exporter does not serve the token, or not for this region and
            size.
        HandoffError: the driver refused to import, map or open, or the payload names another
            region than the one mapped for its descriptor.
    """
    global maps
    key = (p.address, p.token)
    region = _attached.get(key)
    if region is None:
        with _lock:
            region = _attached.get(key)
            if region is None:
                region = _attached[key] = _map_region(p, wire_payload, what)
                maps += 1
    if region.wire != wire_payload:
        raise HandoffError(
            "this arena payload names a region other than the one mapped here for its "
            "descriptor: refused (a forged or corrupted payload)"
        )
    return region


def is_attached(p: RegionPayload) -> bool:
    """True when the region ``p`` names is mapped here already (its host and GPU checked)."""
    return (p.address, p.token) in _attached


def _map_region(p: RegionPayload, wire_payload: tuple[Any, ...], what: str) -> Region:
    ordinal = lifetime.local_ordinal(p.device, p.boot, what)
    exited = _broker.exited(p.address)  # before anything is mapped: it may raise
    fd = _broker.fetch(p.address, p.token, p.identity)
    try:
        with _driver.context(ordinal):
            flags = _driver.ACCESS["rw"]
            base = _driver.import_and_map(fd, p.size, _driver.access([(ordinal, flags)]))
            try:
                event = None if exited else _open_event(p)
            except BaseException:
                _driver.unmap_here(base, p.size)
                raise
    finally:
        os.close(fd)
    return Region(p.region, wire_payload, base, p.size, ordinal, event, p.address)


def _open_event(p: RegionPayload) -> Any:
    """The exporter's event, opened here; None when the exporter has exited meanwhile (a keeper
    serves its region: its work is done, and its event may not open any more).

    Raises:
        HandoffError: the driver refused, and the exporter has not exited.
    """
    try:
        return _driver.open_ipc_event(p.event)
    except HandoffError:
        try:
            gone = _broker.exited(p.address)
        except HandoffError:
            gone = False
        if not gone:
            raise
        return None


def attached() -> int:
    """How many regions are mapped in this process."""
    return len(_attached)


class ImportedArena(MappedDeviceMemory, MemoryResource):
    """An arena's region as mapped in a receiving process: what ``gpu_serde.wire.arena`` gives
    there, and the ``.arena`` of every buffer received from it. It reads like the arena (device,
    size) and cannot allocate. The region stays mapped for the process's life."""

    def __init__(self, region: Region) -> None:
        self._region = region

    def allocate(self, size: int, stream: Stream | None = None) -> Buffer:
        """Refused: the region belongs to its exporter.

        Raises:
            TypeError: always; allocate in the exporting process and send the buffer.
        """
        raise TypeError(ImportedArenaMemory.refusal)

    def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
        """Nothing to do: no buffer is allocated from it here."""

    @property
    def device_id(self) -> int:
        """This process's ordinal of the region's GPU."""
        return self._region.ordinal

    @property
    def size(self) -> int:
        """The region's size in bytes."""
        return self._region.size

    def __reduce__(self) -> tuple[Any, ...]:
        return (wire.arena, (self._region.wire,))  # travels on as it came

    def __repr__(self) -> str:
        return f"<ImportedArena {human(self._region.size)} (device {self._region.ordinal})>"


class ImportedArenaMemory(Imported):
    """The memory resource of a buffer received from an arena (``buf.memory_resource`` in the
    receiver; ``.arena`` is the region's :class:`ImportedArena`). It cannot allocate.

    Freeing the buffer tells the exporter, which may then reuse the block
    (:class:`~gpu_serde.memory.lifetime.Imported` says when). The region stays mapped.
    """

    refusal = (
        "an arena received from another process cannot allocate: allocate from the "
        "ArenaMemoryResource in the exporting process and send the buffer"
    )
    tells_at_close = True  # freeing a block unmaps nothing: the region stays

    def __init__(self, arena: ImportedArena, hold: Import) -> None:
        super().__init__(hold, arena.device_id)
        self.arena = arena  #: the region it lies in

    def __repr__(self) -> str:
        return f"<ImportedArenaMemory of {self.arena!r}>"


_imported: dict[tuple[str, bytes], ImportedArena] = {}  # as _attached: this process's views
_left_by_fork: list[Any] = []


def _forget_after_fork() -> None:
    """A forked child maps nothing of its parent's (CUDA does not survive a fork): the parent's
    regions and views are kept, never freed (freeing calls the driver, which a forked child must
    not do before it execs; it can hang there, as under Ray, whose preexec_fn runs these hooks)."""
    global _lock, maps
    _left_by_fork.append((dict(_attached), dict(_imported)))
    _attached.clear()
    _imported.clear()
    _lock, maps = threading.Lock(), 0


os.register_at_fork(after_in_child=_forget_after_fork)


def _home(p: RegionPayload) -> ArenaMemoryResource | None:
    """The arena that exports this region, if this process is its exporter."""
    mr = exported(p.region)
    return mr if mr is not None and _broker.is_own(p.address) else None


def _imported_arena(
    p: RegionPayload, wire_payload: tuple[Any, ...], what: str = ARENA_MEMORY
) -> ImportedArena:
    region = attach(p, wire_payload, what)
    key = (p.address, p.token)
    mr = _imported.get(key)
    if mr is None:
        mr = _imported.setdefault(key, ImportedArena(region))
    return mr


def rebuild_arena(payload: object) -> MemoryResource:
    """Rebuild body of :func:`gpu_serde.wire.arena`: the region mapped here (an
    :class:`ImportedArena`), or the original arena back in its exporter.

    Raises:
        PayloadError: malformed; and as :func:`attach`.
    """
    p = decode_region(payload)
    home = _home(p)
    if home is not None:
        return home
    return _imported_arena(p, payload)  # type: ignore[arg-type]  # a tuple: decode checked


def rebuild_buffer(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.abuf`: the buffer at its offset in its region,
    mapped here once per process; the original back in its exporter.

    Raises:
        PayloadError: malformed.
        TokenRefusedError: the exporter let go of it (also back home), or the hold was issued
            for another block.
        HandoffError: as :func:`attach`, or the driver refused.
    """
    return receive(decode_abuf(payload), payload)  # type: ignore[arg-type]  # decode checked


def receive(p: AbufPayload, payload: tuple[Any, ...], what: str = ARENA_MEMORY) -> Buffer:
    """The buffer that ``p`` names: :func:`rebuild_buffer` once decoded (``p`` must be what
    :func:`~gpu_serde.format.memory.decode_abuf` made of ``payload``); ``what`` names the memory
    in the errors of a region's first map.

    Raises:
        As :func:`rebuild_buffer`.
    """
    if _home(p.region) is not None:
        held = _broker.broker().peek(p.hold, p.block)
        if held is None:
            raise TokenRefusedError(
                "this arena buffer came back to its exporter after every importer released it: "
                "send it again"
            )
        return lifetime.back_home(held)  # the original buffer
    arena = _imported_arena(p.region, payload[1], what)
    region = arena._region
    with Import(p.region.address, p.hold, p.block, region.ordinal) as hold:
        try:
            region.wait()  # the sender's work before the hand-off
            Device(region.ordinal).set_current()
            mr = ImportedArenaMemory(arena, hold)
            buf = mr.hand_out(Buffer.from_handle(region.base + p.offset, p.size, mr=mr))
        except HandoffError:
            raise
        except Exception as exc:
            raise HandoffError(f"receiving the arena buffer failed: {exc}") from exc
        hold.keep(buf, (wire.abuf, (payload,)))
    return buf
