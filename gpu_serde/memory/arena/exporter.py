"""``ArenaMemoryResource``, the exporter's side: one region, sub-allocated; its buffers hand off
as an offset, with no driver call that grows with their size. The receiver's side is
:mod:`gpu_serde.memory.arena.importer`.

The exporter makes one VMM region (:mod:`gpu_serde.memory.driver`) and hands out blocks of it
(:mod:`gpu_serde.memory.arena.ranges`). The region travels as its GPU's UUID, the host, a token
for its descriptor at the exporter's broker, its id and size, and an IPC event; a buffer as its
region plus an offset, a size and a hold token. The receiver maps the region the first time it
sees it and keeps it mapped; every later buffer is a hold (a lock in the exporter's holds file, no
round trip), a wait for the sender's event and a ``Buffer`` at ``base + offset``.

Ordering: pickling a buffer records the region's event on the stream the buffer was allocated on
(after waiting for its previous recording, so the event follows every hand-off before it), and the
receiver waits for the event before it hands the buffer out.

Lifetime: the exporter holds each sent buffer with its broker until every importer released it
(plus the grace period); a block closed while held is given back to the allocator only then. A
freed block is reused once the work on the stream it was freed on is done (an event per free).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import secrets
import threading
import weakref
from typing import Any

from cuda.bindings import driver
from cuda.core import Buffer, Device, MemoryResource, Stream

from gpu_serde import inventory as _inventory
from gpu_serde import wire
from gpu_serde.device import device_payload
from gpu_serde.errors import ArenaFullError, HandoffError
from gpu_serde.format.device import VERSION
from gpu_serde.format.memory import MAX_SIZE, AbufPayload, RegionPayload, region_identity
from gpu_serde.hostid import host_id
from gpu_serde.memory import broker as _broker
from gpu_serde.memory import driver as _driver
from gpu_serde.memory import lifetime
from gpu_serde.memory.arena.ranges import Ranges, align_up
from gpu_serde.memory.background import Background

#: region id -> the arena that exports it, in this process (back home, a payload is the original)
_exported: weakref.WeakValueDictionary[bytes, ArenaMemoryResource] = weakref.WeakValueDictionary()


def exported(region: bytes) -> ArenaMemoryResource | None:
    """The arena this process exports under region id ``region``, or None."""
    return _exported.get(region)


def _room(ordinal: int) -> str:
    """What the GPU has, for a message: '; the GPU has ... free of ...: create it with at most
    ...' (empty when the driver cannot say)."""
    got = _driver.memory(ordinal)
    if got is None:
        return ""
    free, total = got
    return (
        f"; the GPU has {human(free)} free of {human(total)}: create it with at most the free "
        "memory, or free memory on this GPU first (other processes' too: nvidia-smi lists them)"
    )


def human(n: int) -> str:
    """``n`` bytes for a message: ``3.0 MiB (3,145,728 bytes)``."""
    size, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n:,} bytes" if unit == "bytes" else f"{size:.1f} {unit} ({n:,} bytes)"


class _Region:
    """The exporter's state of one region, apart from the resource (its finalizer frees it)."""

    def __init__(self, dev: Device, size: int) -> None:
        self.ordinal = dev.device_id
        self.uuid = _inventory.uuid_of(dev.device_id)  # GPU-... or MIG-...
        with _driver.context(self.ordinal):  # the device need not be current in this thread
            self.default_stream = int(dev.default_stream.handle)
        self.size = align_up(size, _driver.granularity(self.ordinal))
        try:
            self.base = _driver.create(self.ordinal, self.size)
        except HandoffError as exc:
            raise HandoffError(
                f"ArenaMemoryResource on GPU {self.uuid} (device {self.ordinal}): the driver "
                f"refused a region of {human(self.size)} ({exc}){_room(self.ordinal)}"
            ) from None
        self.id = secrets.token_bytes(16)
        self.ranges = Ranges(self.size)
        self.lock = threading.Lock()  # held, deferred, pending, the payload; never in a free
        self.event, self.event_bytes = self._new_event()
        self.wire: tuple[Any, ...] | None = None  # the region payload, made at the first send
        self.tokens: list[bytes] = []  # the broker's token for the descriptor
        self.streams: dict[int, Stream] = {}  # block address -> the stream it was allocated on
        self.held: dict[int, int] = {}  # block address -> holds for importers
        self.hold_tokens: dict[int, set[bytes]] = {}  # block address -> its holds' tokens
        self.deferred: dict[int, Any] = {}  # address -> free's event: closed while held
        self.pending: list[tuple[int, Any]] = []  # (address, event): freed, its stream busy
        self.frees: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()  # from deallocate
        self.freeing: set[int] = set()  # blocks freed and not yet given back to the allocator
        self.spare: list[Any] = []  # events to record frees with
        self.recording = threading.Lock()
        self.pid = os.getpid()  # a forked child's copy frees nothing: the region is the parent's

    def _new_event(self) -> tuple[Any, bytes]:
        try:
            return _driver.ipc_event(self.ordinal)
        except Exception:
            _driver.unmap(self.ordinal, self.base, self.size)
            raise

    def payload(self) -> tuple[Any, ...]:
        """The region's wire payload: its descriptor offered to the broker the first time."""
        with self.lock:
            if self.wire is None:
                b = _broker.broker()
                dev, boot = device_payload(Device(self.ordinal)), host_id()
                identity = region_identity(self.id, self.size, dev, boot, self.event_bytes)
                fd = _driver.export(self.ordinal, self.base)
                try:
                    # the descriptor keeps the region allocated: a keeper may serve it after
                    # this process exits, once the GPU's work on it is done
                    ready = functools.partial(_driver.synchronize, self.ordinal)
                    self.tokens.append(b.offer(fd, identity, keep=ready))
                finally:
                    os.close(fd)
                p = RegionPayload(
                    VERSION,
                    dev,
                    boot,
                    b.address,
                    self.tokens[0],
                    self.id,
                    self.size,
                    self.event_bytes,
                )
                self.wire = p.wire()
            return self.wire

    def record(self, ptr: int) -> None:
        """Record the region's event after the work on block ``ptr``'s stream (and after every
        earlier recording)."""
        stream = self.streams.get(ptr)
        handle = int(stream.handle) if stream is not None else self.default_stream
        with self.recording, _driver.context(self.ordinal):
            try:
                _driver.record_after(self.event, handle)
            except HandoffError:  # the stream was destroyed: whatever ran on it is queued
                driver.cuCtxSynchronize()
                _driver.record_after(self.event, self.default_stream)

    def hold(self, ptr: int) -> None:
        with self.lock:
            self.held[ptr] = self.held.get(ptr, 0) + 1

    def held_under(self, ptr: int, token: bytes) -> None:
        """Block ``ptr``'s new hold is the broker's ``token``."""
        with self.lock:
            self.hold_tokens.setdefault(ptr, set()).add(token)

    def released(self, ptr: int, token: bytes | None = None) -> None:
        """The broker let go of a hold on block ``ptr`` (its importers released it)."""
        with self.lock:
            tokens = self.hold_tokens.get(ptr)
            if tokens is not None and token is not None:
                tokens.discard(token)
                if not tokens:
                    del self.hold_tokens[ptr]
            left = self.held.get(ptr, 0) - 1
            if left > 0:
                self.held[ptr] = left
                return
            self.held.pop(ptr, None)
            if ptr in self.deferred:  # closed while held: free now
                self.pending.append((ptr, self.deferred.pop(ptr)))

    def freed(self, ptr: int, stream: Any) -> None:
        """Block ``ptr`` was freed on ``stream`` (from ``deallocate``: any thread, maybe during
        garbage collection): record an event there and queue it. Never raises, takes no lock."""
        if os.getpid() != self.pid:  # no driver call in a forked child: the block is the parent's
            return
        event = None
        with contextlib.suppress(Exception), _driver.context(self.ordinal):
            try:
                event = self.spare.pop()
            except IndexError:
                event = _driver.plain_event(self.ordinal)
            handle = int(stream.handle) if stream is not None else self.default_stream
            _driver.check("cuEventRecord", driver.cuEventRecord(event, handle))
        self.streams.pop(ptr, None)
        self.freeing.add(ptr)
        self.frees.put((ptr, event))

    def handed_out(self, ptr: int) -> bool:
        """True when ``ptr`` is a block's address that :meth:`take` handed out and that was not
        freed since. Takes no lock (it may run during garbage collection)."""
        return self.ranges.handed_out(ptr - self.base) and ptr not in self.freeing

    def _drain(self) -> None:
        """Move queued frees on (to deferred while held, else to pending); call with the lock."""
        while True:
            try:
                ptr, event = self.frees.get_nowait()
            except queue.Empty:
                return
            if self.held.get(ptr):
                self.deferred[ptr] = event
            else:
                self.pending.append((ptr, event))

    def _reclaim(self, wait: bool) -> None:
        """Give the allocator back every pending block whose stream has done its work (``wait``:
        wait for all of them); call with the lock."""
        if not self.pending:
            return
        keep = []
        with _driver.context(self.ordinal):
            for ptr, event in self.pending:
                if event is None:  # no event was recorded: the whole device
                    if not wait:
                        keep.append((ptr, event))
                        continue
                    driver.cuCtxSynchronize()
                elif wait:
                    driver.cuEventSynchronize(event)
                elif not _driver.done(event):
                    keep.append((ptr, event))
                    continue
                self.ranges.give(ptr - self.base)
                self.freeing.discard(ptr)
                if event is not None:
                    self.spare.append(event)
        self.pending = keep

    def take(self, nbytes: int) -> int | None:
        """A free block of ``nbytes``: its address, or None."""
        with self.lock:
            self._drain()
            self._reclaim(wait=False)
            offset = self.ranges.take(nbytes)
            if offset is None and self.pending:
                self._reclaim(wait=True)
                offset = self.ranges.take(nbytes)
            return None if offset is None else self.base + offset

    def stats(self) -> dict[str, int]:
        with self.lock:
            self._drain()
            self._reclaim(wait=False)
            taken = self.ranges.taken()
            held = sum(taken.get(ptr - self.base, 0) for ptr in {*self.held, *self.deferred})
            return {"free": self.ranges.free, "largest": self.ranges.largest_free, "held": held}

    def unclaimed(self) -> int:
        """Bytes of blocks held for a payload that no process has received yet (sent, or sent
        again, and no hold taken since): kept until one is, or until this process exits."""
        with self.lock:
            taken = self.ranges.taken()
            tokens = {ptr: list(t) for ptr, t in self.hold_tokens.items()}
        b = _broker.started()  # outside the lock: the broker's (its release thread takes this one)
        if b is None or not tokens:
            return 0
        return sum(
            taken.get(ptr - self.base, 0) for ptr, ts in tokens.items() if any(map(b.unclaimed, ts))
        )

    def close(self) -> None:
        """Free the region here (when its resource is collected). Never raises."""
        if os.getpid() != self.pid:  # a forked child's copy: the region is the parent's
            return
        with contextlib.suppress(Exception):
            if self.tokens:  # sent: the broker has started (a region never sent starts none)
                b = _broker.broker()
                for token in self.tokens:
                    b.revoke(token)
        events = [self.event, *self.spare, *(e for _, e in self.pending if e is not None)]
        _driver.destroy(self.ordinal, events)
        _driver.unmap(self.ordinal, self.base, self.size)


# Closing a region takes the broker's lock and calls the driver: never inside a finalizer, which
# may run during garbage collection while this very thread holds that lock. Finalizers only queue
# the region; this thread (started with the first arena, in an ordinary call) closes it, and stops
# at the process's exit, with the release thread (no driver call while Python is torn down).
_closing: queue.SimpleQueue[_Region | None] = queue.SimpleQueue()
_closer_stopped = threading.Event()


def _close_regions() -> None:
    while True:
        region = _closing.get()
        if region is None:  # the exit's mark: every region queued before it is closed
            _closer_stopped.set()
            return
        region.close()


_closer = Background("gpu_serde-arena", _close_regions)


def _stop_closer_at_exit() -> None:
    if _closer.close() is not None:
        _closing.put(None)
        _closer_stopped.wait(lifetime.EXIT_WAIT_S)


def _forget_after_fork() -> None:
    """A forked child closes none of its parent's regions (their finalizers queue them where no
    thread reads); a region of its own gets a closer of its own."""
    global _closing, _closer_stopped
    _closing, _closer_stopped = queue.SimpleQueue(), threading.Event()
    _closer.forget()


lifetime.on_exit.append(_stop_closer_at_exit)
os.register_at_fork(after_in_child=_forget_after_fork)


class ArenaMemoryResource(lifetime.DeviceMemory, MemoryResource):
    """A memory resource whose buffers reach other processes with no driver call that grows with
    their size: one region of device memory, mapped once per receiving process, sub-allocated.

    Create it like a ``DeviceMemoryResource`` and allocate from it; its buffers are plain cuda.core
    ``Buffer`` objects. Pickled (task arguments and results, ``ray.put``, Dask futures, a
    ``multiprocessing.Queue``) in a process where gpu_serde is installed, a buffer travels as an
    offset in the region: the first buffer a process receives from a region maps the region there
    (the one-time cost, about a millisecond at any size); every later one costs a hold on it at
    the exporter (a lock in its holds file: no round trip) and no mapping. See ``docs/memory.md``.

    Args:
        device: the GPU (a ``Device`` or an ordinal of this process).
        size: the region's size in bytes, rounded up to the driver's granularity (2 MiB on an
            H200). All of it is allocated at once and stays allocated while the resource lives.

    Raises:
        TypeError: ``device`` is not a Device or an int, or ``size`` not an int.
        ValueError: ``size`` is not positive, or is 2**62 bytes or more (no GPU has as much).
        HandoffError: the driver refused the region (the message names its error, e.g.
            ``CUDA_ERROR_OUT_OF_MEMORY``, and what the GPU has free).

    Rules (``docs/memory.md``): a buffer is allocated on a stream (``allocate(size, stream)``,
    default: the device's default stream); write it on that stream, or order other work before it,
    before you send it. The exporter keeps a sent buffer's block until every importer released it,
    even if you close the buffer; receivers keep the region mapped for their life.
    """

    def __init__(self, device: Device | int, size: int) -> None:
        if not isinstance(device, Device) and (
            not isinstance(device, int) or isinstance(device, bool)
        ):
            raise TypeError(
                "ArenaMemoryResource(device=...): a cuda.core Device or this process's ordinal, "
                f"not {type(device).__name__} (for a GPU by UUID, find its Device with "
                "gpu_serde.visible_devices())"
            )
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"ArenaMemoryResource(size=...): an int, not {type(size).__name__}")
        if size <= 0:
            raise ValueError(f"ArenaMemoryResource(size=...) must be positive, not {size}")
        if size >= MAX_SIZE:  # no payload could name it (nor the driver, whose sizes are 64-bit)
            raise ValueError(
                f"ArenaMemoryResource(size=...) of {size:,} bytes is larger than any GPU's memory"
            )
        dev = Device(device)
        self._device = dev
        self._r = region = _Region(dev, size)
        _closer.start()
        # collected: the region is freed here (its importers keep their mappings); at exit the
        # process's end frees it
        weakref.finalize(self, _closing.put, region).atexit = False

    def allocate(self, size: int, stream: Stream | None = None) -> Buffer:
        """A buffer of ``size`` bytes from the region, allocated on ``stream`` (default: the
        device's default stream). Its deallocation and its hand-offs are ordered on that stream.

        Raises:
            ArenaFullError: no free block is that large (the message says what is free and what
                size to create the resource with).
            TypeError, ValueError: ``size`` is not a positive int, or ``stream`` not a
                ``Stream`` of the arena's device.
        """
        if not isinstance(size, int) or isinstance(size, bool):
            raise TypeError(f"allocate(size) takes an int, not {type(size).__name__}")
        if size <= 0:
            raise ValueError(f"allocate(size) must be positive, not {size}")
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(
                f"allocate(stream=...): a cuda.core Stream or None, not {type(stream).__name__}"
            )
        r = self._r
        if stream is not None and stream.device.device_id != r.ordinal:
            raise ValueError(
                f"allocate(stream=...): a stream of device {stream.device.device_id}, but this "
                f"arena's memory is on device {r.ordinal} (GPU {r.uuid}): use a stream of its "
                "device (arena.device.create_stream())"
            )
        ptr = r.take(size)
        if ptr is None:
            raise self._full(size)
        try:
            with _driver.context(r.ordinal):  # the device need not be current in this thread
                s = stream if stream is not None else self._device.default_stream
                r.streams[ptr] = s
                return Buffer.from_handle(ptr, size, mr=self, stream=s)
        except Exception:
            r.streams.pop(ptr, None)
            r.freeing.add(ptr)
            r.frees.put((ptr, None))
            raise

    def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
        """Give a buffer's block back, ordered after the work on ``stream``: it is reused once
        that work is done, and, if it was sent, once every importer released it. A buffer's
        ``close`` calls it (it may run during garbage collection, in any thread): call it
        yourself only for a pointer no ``Buffer`` owns any more.

        Raises:
            ValueError: ``ptr`` is not a block this arena handed out, or was freed already
                (nothing is freed: the arena stays as it was).
        """
        r = self._r
        address = int(ptr)
        if os.getpid() == r.pid and not r.handed_out(address):
            raise ValueError(
                f"ArenaMemoryResource.deallocate({address:#x}): not a block this arena handed "
                "out, or one freed already (a Buffer's close frees its block: do not also call "
                "deallocate); nothing was freed"
            )
        r.freed(address, stream)

    def _full(self, asked: int) -> ArenaFullError:
        r, stats = self._r, self._r.stats()
        head = f"ArenaMemoryResource on GPU {r.uuid} (device {r.ordinal}) cannot allocate "
        room = _driver.memory(r.ordinal)
        if room is not None and asked > room[1]:
            suggested = 0
            message = (
                f"{head}{human(asked)}: more than the GPU's whole memory ({human(room[1])}). "
                "Split the data into buffers that fit, or use a GPU with more memory"
            )
        else:
            gran = _driver.granularity(r.ordinal)
            suggested = align_up(max(2 * r.size, r.size + align_up(asked)), gran)
            unclaimed = r.unclaimed() if stats["held"] else 0
            released = stats["held"] - unclaimed
            held = ""
            if released > 0:
                held += (
                    f"; {human(released)} of it are buffers sent and still held for importers "
                    "(given back once every importer released them and "
                    f"{lifetime.RELEASE_GRACE_S:g} s more have passed, the grace for a payload "
                    "read again: GPU_SERDE_RELEASE_GRACE_S)"
                )
            if unclaimed:
                held += (
                    f"; {human(unclaimed)} of it are buffers sent (or sent again) whose latest "
                    "payload no process has received yet: each is kept for that payload until a "
                    "process unpickles it, or until this process exits (a pickle made and never "
                    "read, such as a Ray object reference dropped unread or dask's tokenize, "
                    "keeps its block)"
                )
            fix = (
                "Receive what you send, or send one buffer again instead of new ones; a larger "
                "one: "
                if unclaimed and not released
                else "Sent buffers come back only after their last release and the grace: size "
                "the arena for what you send in that time, send one buffer again instead of new "
                "ones, or set GPU_SERDE_RELEASE_GRACE_S lower before gpu_serde is imported; a "
                "larger one: "
                if stats["held"]
                else "Close buffers you no longer need (receivers too: close what you received), "
                "or create a larger one: "
            )
            message = (
                f"{head}{human(asked)}: {human(stats['free'])} free, the largest free block "
                f"{human(stats['largest'])}, in a region of {human(r.size)}{held}. {fix}"
                f"ArenaMemoryResource(device, size={suggested})"
            )
        return ArenaFullError(
            message,
            requested=asked,
            free=stats["free"],
            largest=stats["largest"],
            held=stats["held"],
            size=r.size,
            uuid=r.uuid,
            suggested=suggested,
        )

    @property
    def device(self) -> Device:
        """The GPU the region lives on."""
        return self._device

    @property
    def device_id(self) -> int:
        """The GPU's ordinal in this process."""
        return int(self._r.ordinal)

    @property
    def is_managed(self) -> bool:
        """False: not managed memory."""
        return False

    @property
    def is_ipc_enabled(self) -> bool:
        """False: cuda.core's own IPC path cannot carry its buffers (without
        ``gpu_serde.install()``, pickling one fails with cuda.core's error); gpu_serde's can."""
        return False

    @property
    def size(self) -> int:
        """The region's size in bytes (what was asked, rounded up to the granularity)."""
        return int(self._r.size)

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated (in blocks of any size; freed blocks count once their stream's
        work is done). A sent buffer closed here comes back only once its receivers let go of
        it: :attr:`held_bytes` counts those."""
        return self._r.stats()["free"]

    @property
    def held_bytes(self) -> int:
        """Bytes in blocks kept for receivers: sent and not yet let go (a receiver holds them,
        the grace period after their last release has not passed, or a payload sent has not been
        received yet: kept until one is, or until this process exits), whether this process
        still has the buffer open or closed it."""
        return self._r.stats()["held"]

    @property
    def largest_free_block(self) -> int:
        """The largest block one allocation can get now, in bytes."""
        return self._r.stats()["largest"]

    def __reduce__(self) -> tuple[Any, ...]:
        return reduce_arena(self)

    def __repr__(self) -> str:
        return (
            f"<ArenaMemoryResource {human(self._r.size)} on GPU {self._r.uuid} "
            f"(device {self._r.ordinal})>"
        )


def reduce_arena(mr: ArenaMemoryResource) -> tuple[Any, ...]:
    """Reducer for ``ArenaMemoryResource``: ``(gpu_serde.wire.arena, (region payload,))``.

    Raises:
        HandoffError: the driver refused to export the region, or this process was forked from
            the arena's (:func:`~gpu_serde.memory.lifetime.not_forked`).
    """
    lifetime.not_forked("ArenaMemoryResource")
    payload = mr._r.payload()
    _exported[mr._r.id] = mr
    return (wire.arena, (payload,))


def reduce_buffer(buf: Buffer, mr: ArenaMemoryResource) -> tuple[Any, ...]:
    """Reducer body for a buffer of an :class:`ArenaMemoryResource`:
    ``(gpu_serde.wire.abuf, (payload,))``. Keeps ``buf`` (and its block) for its importers, and
    records the region's event after the work on the buffer's stream.

    Raises:
        HandoffError: the driver refused to export the region or record the event, or the
            buffer is closed and no longer held for importers.
    """
    r = mr._r
    region = r.payload()
    _exported[r.id] = mr
    ptr = int(buf.handle)

    def make() -> tuple[bytes, tuple[Any, ...]]:
        p = AbufPayload(VERSION, RegionPayload(*region), ptr - r.base, buf.size, b"")
        r.hold(ptr)
        issued: list[bytes] = []
        try:
            token = lifetime.hold(
                buf,
                p.block,
                lambda _obj: r.released(ptr, issued[0] if issued else None),
                needs=r.tokens[0],
            )
        except Exception:
            r.released(ptr)
            raise
        issued.append(token)
        r.held_under(ptr, token)
        return token, p._replace(hold=token).wire()

    # a block closed while held is freed only once its importers let go: it can be sent again
    reduction = lifetime.send(buf, wire.abuf, make, survives_close=True)
    r.record(ptr)  # the event follows the work on the buffer's stream
    return reduction
