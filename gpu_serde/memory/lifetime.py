"""The lifetime of memory that crosses processes: one protocol, used by every memory kind (pools,
pinned, VMM, arena, and the tensor kinds to come).

**The exporter's side** (:func:`send`). A buffer that is sent is held by this process's broker
(:mod:`gpu_serde.memory.broker`) under a token that names the block it was issued for, and keeps
travelling as the payload it was first sent with while that hold lasts, so sending it again costs
nothing. The broker owns the holds: each belongs to the importing process that acquired it, is
released only by that process, and is dropped when that process exits or is killed (a hold is
a lock in the broker's holds file, which the kernel releases with the process; taking one waits
for no answer from the exporter). An object whose holds are all gone is let go
:data:`RELEASE_GRACE_S` seconds later, unless it was sent since its last acquire: a payload not
yet acquired keeps it (a payload may wait in Ray's object store, or in a Dask graph, longer than
the grace period).
**A sender never fails**: a buffer that cannot be sent (closed, and no longer held) raises
:class:`~gpu_serde.HandoffError` here, which the reducers turn into a payload that raises the same
error in the receiver, when the buffer is used (:mod:`gpu_serde.memory.unsent`).

**The importer's side** (:class:`Import`). Acquire (the table checks the block), key, hold,
release at once if the mapping fails, track: written once, here::

    with lifetime.Import(address, token, block, device) as hold:
        buf = ...map the memory..., its memory resource an Imported subclass over ``hold``
        hold.keep(buf, reduction)

Freeing the buffer (:meth:`Imported.deallocate`) queues the release; one thread here waits for the
free to complete on the GPU (CUDA's rule for imported memory: the importer's free completes before
the exporter's) and then tells the exporter, and unmaps freed memory in the background.

**What was received** travels on as it came (:func:`forwarded`): an imported object is forwarded
with its original payload, so a hop (a Dask scheduler) passes it on untouched.

Also here: the host check (memory crosses processes only on the host that exported it), and the
fork and exit hooks that keep these promises in children and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.util
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuda.bindings import driver as cuda_driver
from cuda.core import Buffer, Device, EventOptions, MemoryResource, Stream

from gpu_serde import inventory as _inventory
from gpu_serde import settings
from gpu_serde.errors import HandoffError, OtherHostError
from gpu_serde.format.device import decode_device
from gpu_serde.hostid import host_id
from gpu_serde.memory import broker as _broker
from gpu_serde.memory import driver as _driver
from gpu_serde.memory.background import Background
from gpu_serde.placeholders import not_visible_error
from gpu_serde.text import quoted

#: Seconds the exporter still keeps a buffer after its last importer released it, so that a hop
#: (a Dask scheduler, a Ray task passing it on) that imported and dropped it does not free it
#: under the next importer. The environment variable is read when gpu_serde is imported; this
#: attribute at each export.
RELEASE_GRACE_S = settings.number(
    "GPU_SERDE_RELEASE_GRACE_S", 5.0, "a number of seconds, 0 or more"
)
#: Seconds without a release after which an importer unmaps the memory it has freed. The driver
#: unmaps freed imported memory lazily, at this process's next synchronisation (any stream): until
#: then, a buffer sent again from the same pool memory maps at no cost; after it, the unmapping
#: would fall on the user's next synchronisation, so the release thread does it in the background
#: on a stream of its own (which waits for no one's work).
UNMAP_AFTER_S = 0.05
#: Seconds an exiting importer waits for the release thread to finish what was queued before.
EXIT_WAIT_S = 2.0


# ---- the host check ----
def check_host(boot: bytes, what: str) -> None:
    """Raise :class:`OtherHostError` unless ``boot`` is this host's identity. ``what`` names
    the memory and where it came from; the caller escapes the wire text in it
    (:func:`gpu_serde.text.quoted`)."""
    if boot != host_id():
        if any(word in what for word in ("Tensor", "tensor", "ndarray")):  # shared, or torch's IPC
            fix = (
                "To reach other hosts, send the tensor itself, not gpu_serde.share(x) or through "
                "torch.multiprocessing: pickled, Ray and Dask carry it by value, with its bytes"
            )
        else:
            fix = (
                "To reach other hosts, send the buffer wrapped in gpu_serde.portable(buf), which "
                "carries a copy (Ray tasks, actors and ray.put; Dask task arguments; "
                "multiprocessing); Dask sends buffers that are task results or scattered data by "
                "value to other hosts by itself (return it from a task, or client.scatter it, "
                "instead of passing it inside a task's arguments)"
            )
        raise OtherHostError(
            f"{what} reached host {quoted(_inventory.inventory().host)}, another host: GPU "
            f"memory is mapped only on the host that exported it, and this was sent to be mapped. "
            f"{fix}. Or run this work on the exporter's host."
        )


# ---- the exporter's side ----
lock = threading.RLock()  # guards what was sent and what was imported, in every memory module


@dataclass(frozen=True)
class _Sent:
    """How a buffer was sent: its hold's token, its reduction, and whether its block outlives a
    close while held."""

    token: bytes
    reduction: tuple[Any, ...]
    survives_close: bool


#: id(sent buffer) -> how it was sent, while it lives (by id: a Buffer's hash changes when it is
#: closed, so a WeakKeyDictionary would lose a closed buffer's entry)
_sent: dict[int, _Sent] = {}


def hold(
    obj: object, block: bytes, on_release: Callable[[Any], None], *, needs: bytes | None = None
) -> bytes:
    """Hold ``obj`` (a sent block) at this process's broker for importers; return its token.
    ``block`` names the block the hold is issued for (:func:`gpu_serde.format.memory.block_digest`);
    ``on_release(obj)`` runs in the broker's release thread once its importers are all gone and
    :data:`RELEASE_GRACE_S` has passed. ``needs`` is the broker's token of the descriptor an
    importer maps: if it was offered to be kept (:meth:`~gpu_serde.memory.broker.Broker.offer`),
    the hold outlives this process's exit in a keeper (:mod:`gpu_serde.memory.broker.keeper`)."""
    return _broker.broker().hold(obj, on_release, block=block, grace=RELEASE_GRACE_S, needs=needs)


def send(
    buf: Buffer,
    name: Callable[..., Any],
    make: Callable[[], tuple[bytes, tuple[Any, ...]]],
    *,
    survives_close: bool,
) -> tuple[Any, ...]:
    """The reduction ``(name, (payload,))`` that ``buf`` travels as: the one it was sent with
    while its exporter still holds it, else one made of ``make()``, which holds it (:func:`hold`)
    and returns ``(hold token, payload)``; it is remembered.

    ``survives_close`` says whether the memory kind keeps a closed buffer's block while it is
    held (an arena defers the free, a VMM allocation lives while it is mapped): such a buffer,
    closed, still travels as it was first sent while held (:func:`sent_closed`). A pool's buffer is
    freed by ``close`` whatever is held.

    Raises:
        HandoffError: as :func:`sent_closed`, for a closed buffer.
    """
    with lock:
        if not buf.handle:
            return sent_closed(buf)
        sent = _sent.get(id(buf))
        if sent is None or not _broker.broker().sent_again(sent.token, buf):  # new, or let go
            token, payload = make()
            if id(buf) not in _sent:
                weakref.finalize(buf, _sent.pop, id(buf), None)
            sent = _sent[id(buf)] = _Sent(token, (name, (payload,)), survives_close)
        return sent.reduction


def sent_closed(buf: Buffer) -> tuple[Any, ...]:
    """The reduction a closed buffer was first sent with, while its exporter still holds it and
    its memory kind keeps the block until its importers let go.

    Raises:
        HandoffError: the buffer was never sent, its importers let go of it, or its kind frees
            the memory at close.
    """
    with lock:
        sent = _sent.get(id(buf))
        b = _broker.broker()
        if sent is not None and sent.survives_close and b.sent_again(sent.token, buf):
            return sent.reduction
    if sent is None:
        why = "before it was sent"
    elif not sent.survives_close:
        why = "(closing a pool's buffer frees its memory, whatever importers hold)"
    else:
        why = "and every importer had let go of it"
    raise HandoffError(
        f"this Buffer was closed by its exporter {why}: a closed buffer cannot be sent; send it "
        "before you close it, and keep it open while it may be sent again (a Dask recomputation "
        "or a Ray task retry sends a task's arguments again)"
    )


def not_forked(what: str) -> None:
    """Check that this process may export ``what`` (memory it allocated, or that its parent did).

    Raises:
        HandoffError: this process was forked from the one whose memory it is, after CUDA was
            initialised there: it cannot use CUDA, and its parent's broker would not know a
            hold it made.
    """
    parent = _inventory.forked_from()
    if parent is not None:
        raise HandoffError(
            f"this {what}'s memory belongs to pid {parent}: this process was forked from it "
            f"after CUDA was initialised there, and cannot send it. Send it from pid {parent}, "
            "or start this process with the 'spawn' or 'forkserver' method"
        )


def back_home(held: object) -> Any:
    """``held``, the original object a payload names, back in its exporter (``peek``'s answer,
    not None): a buffer closed here after it was sent cannot be handed back.

    Raises:
        HandoffError: ``held`` is a closed Buffer.
    """
    if isinstance(held, Buffer) and not held.handle:
        raise HandoffError(
            "this Buffer came back to its exporter, which closed it after sending it: a closed "
            "buffer cannot be used here (receivers in other processes still read it while they "
            "hold it). Keep it open while this process may receive it back (ray.get of its own "
            "ray.put, a task scheduled where it was made)"
        )
    return held


def let_go_in_context(buf: Buffer) -> None:
    """An ``on_release`` for a buffer whose collection frees it: runs in the broker's release
    thread, which needs a context to free (the buffer's device's, or any for pinned memory)."""
    (Device(buf.device_id) if buf.device_id >= 0 else Device()).set_current()


# ---- what was received travels on as it came ----
_origin: dict[int, tuple[Any, ...]] = {}  # id(imported object) -> the reduction it came with


def forwarded(obj: object) -> tuple[Any, ...] | None:
    """The reduction an imported object came with (it travels on as it came), or None."""
    return _origin.get(id(obj))


def forward_as(obj: object, reduction: tuple[Any, ...]) -> None:
    """Forward ``obj`` as ``reduction`` while it lives (replacing how it came, if it was
    imported: a portable buffer stays portable when a hop passes it on)."""
    if id(obj) not in _origin:  # the finalizer first: an object it cannot watch is not noted
        weakref.finalize(obj, _origin.pop, id(obj), None)  # (TypeError)
    _origin[id(obj)] = reduction


def remember(obj: object, reduction: tuple[Any, ...]) -> None:
    """Forward ``obj`` as ``reduction`` for as long as the process lives (imported pools and
    regions are kept for good)."""
    _origin[id(obj)] = reduction


# ---- the importer's side ----
WHOLE_DEVICE = "device"  #: release once the whole device is idle (nobody said which stream)
#: release now: the free's stream had nothing left to do when the buffer was closed
AT_ONCE = "at once"
_releases: queue.SimpleQueue[tuple[Any, str, bytes, int]] = queue.SimpleQueue()
_live: dict[int, tuple[str, bytes, int]] = {}  # key -> (broker address, hold token, device)
_keys = itertools.count(1)


class Import:
    """One hold that this process takes on one exported block: acquire, key, hold, release on
    failure, track. A context manager around the mapping::

        with Import(address, token, block, device) as hold:
            ...map it, with an Imported memory resource over hold...
            hold.keep(buf, reduction)

    Entering takes the hold (the exporter's holds table says whether it was issued for
    ``block``; no answer is awaited).
    An exception inside the block releases it at once (the caller undoes its own mapping first);
    after :meth:`keep`, the buffer's memory resource releases it when the buffer is freed.

    Raises:
        ExporterGoneError, TokenRefusedError: on entering, as
            :func:`gpu_serde.memory.broker.acquire`.
    """

    __slots__ = ("address", "device", "kept", "key", "token")

    def __init__(self, address: str, token: bytes, block: bytes, device: int = -1) -> None:
        start_release_thread()
        _broker.acquire(address, token, block)
        self.address, self.token, self.device = address, token, device
        self.key = -next(_keys)
        self.kept = False
        _live[self.key] = (address, token, device)

    def __enter__(self) -> Import:
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        if exc is not None and not self.kept and _live.pop(self.key, None) is not None:
            _broker.release(self.address, self.token)

    def keep(self, buf: Buffer, reduction: tuple[Any, ...]) -> None:
        """The mapping worked: ``buf`` travels on as ``reduction`` while it lives, and its
        memory resource releases the hold when it is freed."""
        self.kept = True
        _origin[id(buf)] = reduction
        weakref.finalize(buf, _origin.pop, id(buf), None)

    def release(self, event: object) -> None:
        """Tell the exporter from the release thread once ``event`` (an ``Event`` recorded after
        the free, or :data:`WHOLE_DEVICE`) has completed; :data:`AT_ONCE` tells it here and now,
        unless this process's connection to the exporter is in use by another thread, gone, or
        has notes waiting (then the release thread does). Never raises, never waits for a lock
        (it may run during garbage collection, in any thread); the second call does nothing."""
        item = _live.pop(self.key, None)
        if item is None:
            return
        if event is AT_ONCE:
            try:
                if _broker.release(item[0], item[1], wait=False) is not None:
                    return
            except Exception:  # the release thread tries again
                pass
        _releases.put((event, *item))


class DeviceMemory:
    """What a memory resource of gpu_serde's reads as by default: device memory, not host
    memory (an imported pinned pool's buffers say otherwise)."""

    @property
    def is_device_accessible(self) -> bool:
        """True: device memory."""
        return True

    @property
    def is_host_accessible(self) -> bool:
        """False: device memory."""
        return False


class MappedDeviceMemory(DeviceMemory):
    """Device memory mapped from another process (cuda.core's own ``Buffer.is_mapped`` says so
    only of its own imports)."""

    @property
    def is_mapped(self) -> bool:
        """True: the memory is mapped from another process."""
        return True


def local_ordinal(device: bytes, boot: bytes, what: str) -> int:
    """This process's ordinal of the GPU that device payload ``device`` names, for memory of
    that GPU exported on host ``boot``; ``what`` names the memory in messages.

    Raises:
        OtherHostError: the memory was exported on another host.
        DeviceNotVisibleError: the GPU is not visible in this process.
    """
    d = decode_device(device)
    check_host(boot, f"{what} from host {quoted(d.host)} (pid {d.pid}, GPU {d.canonical_uuid})")
    ordinal = _inventory.local_ordinal(d.uuid)
    if ordinal is None:
        raise not_visible_error(d, _inventory.inventory())
    return ordinal


class Imported(MappedDeviceMemory, MemoryResource):
    """The memory resource of a buffer mapped from another process (``buf.memory_resource`` in
    the receiver): it cannot allocate, and freeing the buffer lets go of its hold.

    - ``buf.close(stream)`` (or ``buf.close()``: the device's default stream) frees it on that
      stream, and the exporter is told once an event after the free has completed. Work on the
      buffer must be ordered before that stream, as for any cuda.core buffer.
    - A buffer collected without ``close`` is freed on the default stream, and the exporter is
      told once the whole device is idle (nobody said which stream used it last).

    Subclasses free their own kind of mapping (:meth:`_free`) and read like what was mapped.
    """

    #: What ``allocate`` says (a subclass names where to allocate instead).
    refusal = "memory received from another process cannot allocate more: allocate in the exporter"
    #: True for a kind whose free makes no driver call (the mapping stays): an explicit close on
    #: a stream with no work left then tells the exporter at once, in the closing thread, with no
    #: event and no wake-up of the release thread (the hot path of a hand-off).
    tells_at_close = False

    def __init__(self, hold: Import, device: int) -> None:
        self._hold = hold
        self._device = device
        self._freed = False
        self._pid = os.getpid()  # a forked child's copy frees nothing: the mapping is the parent's
        self._user: weakref.ref[Any] | None = None  # the Buffer handed out, once made

    def hand_out(self, buf: Buffer) -> Buffer:
        """Note ``buf`` as the buffer over this memory (an explicit close keeps it alive, a
        collection does not) and return it."""
        self._user = weakref.ref(buf)
        return buf

    def _free(self, ptr: int, size: int, stream: Any) -> None:
        """Free this kind's mapping on ``stream``, in the device's context (may raise)."""

    def allocate(self, size: int, stream: Stream | None = None) -> Buffer:
        """Refused: imported memory belongs to the exporter.

        Raises:
            TypeError: always; allocate in the exporting process and send the buffer.
        """
        raise TypeError(self.refusal)

    def deallocate(self, ptr: Any, size: int, stream: Stream | None = None) -> None:
        """Free the mapping on ``stream`` (else the device's default stream) and queue the
        exporter's release. Never raises (it may run during garbage collection, in any thread).
        """
        if self._freed:
            return
        self._freed = True
        if os.getpid() != self._pid:  # no driver call in a forked child; the hold is the parent's
            return
        # during collection the Buffer's weak references are already dead: an explicit close
        # keeps it alive
        closed = self._user is not None and self._user() is not None
        event: object = WHOLE_DEVICE
        with contextlib.suppress(Exception), _driver.context(self._device):
            s = stream if stream is not None else Device(self._device).default_stream
            try:
                self._free(int(ptr), size, s)
            except Exception:
                s = Device(self._device).default_stream
                self._free(int(ptr), size, s)
            if closed and isinstance(s, Stream):
                if self.tells_at_close and _driver.idle(int(s.handle)):
                    event = AT_ONCE
                else:
                    event = s.record(options=EventOptions(blocking_sync=True))
        self._hold.release(event)

    @property
    def device_id(self) -> int:
        """This process's ordinal of the GPU the memory is mapped on."""
        return self._device


def live_holds() -> int:
    """How many holds this process has taken and not yet let go (queued releases excluded)."""
    return len(_live)


def _tell(event: object, address: str, token: bytes, device: int) -> None:
    try:
        if event is WHOLE_DEVICE:
            raise LookupError  # no stream says when the work on it is done: the whole device
        if event is not AT_ONCE:  # (at once: the stream was idle at the close)
            event.sync()  # type: ignore[attr-defined]  # the event follows the free on its stream
    except Exception:  # the whole device, through the driver (Device.sync() is the runtime's)
        with contextlib.suppress(Exception), _driver.context(device):
            _driver.check("cuCtxSynchronize", cuda_driver.cuCtxSynchronize())
    _broker.release(address, token)


_unmap_streams: dict[int, Any] = {}  # device ordinal -> the release thread's idle stream


def _unmap(devices: set[int]) -> None:
    for ordinal in devices:
        with contextlib.suppress(Exception):
            Device(ordinal).set_current()
            stream = _unmap_streams.get(ordinal)
            if stream is None:
                stream = _unmap_streams[ordinal] = Device(ordinal).create_stream()
            stream.sync()  # nothing runs on it: it only lets the driver unmap what was freed


_STOP = object()  # the exit's mark on the queue: the release thread stops there
_stopped = threading.Event()  # set by the release thread when it reaches the mark


def _release_worker() -> None:
    freed: set[int] = set()  # devices with freed imported memory the driver may still map
    while True:
        try:
            item = _releases.get(timeout=UNMAP_AFTER_S if freed else None)
        except queue.Empty:
            _unmap(freed)
            freed.clear()
            continue
        if item[0] is _STOP:  # the process exits: everything queued before it has been told
            _stopped.set()
            return  # no driver call after this: the interpreter is being torn down
        with contextlib.suppress(Exception):  # a dead thread would stop all releases
            _tell(*item)
        if item[0] is not WHOLE_DEVICE and item[0] is not AT_ONCE and item[3] >= 0:
            freed.add(item[3])


_release_thread = Background("gpu_serde-release", _release_worker)


def start_release_thread() -> None:
    """Start the release thread (once per process; :class:`Import` starts it)."""
    _release_thread.start()


#: Called (no arguments, maybe twice) at the process's exit, after the release thread stopped: the
#: other daemon threads that call the driver stop there too (an arena exporter's closer).
on_exit: list[Callable[[], None]] = []


def _stop_at_exit() -> None:
    """An exiting importer lets the release thread tell what was queued before the exit (within
    :data:`EXIT_WAIT_S`) and stop, so that no daemon thread calls the driver while the
    interpreter is torn down. What it still holds needs no message: the kernel releases a
    process's locks in the exporters' holds files, and closes its connections, at its end.
    Then :data:`on_exit`."""
    worker = _release_thread.close()  # an import after this queues its release for no thread
    if worker is not None:
        _releases.put((_STOP, "", b"", -1))
        _stopped.wait(EXIT_WAIT_S)
    for hook in on_exit:
        with contextlib.suppress(Exception):
            hook()


_left_by_fork: list[Any] = []


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's imports (its copies of the parent's broker
    connections are closed, the holds stay the parent's; freeing its copy of a received buffer
    does nothing) and has no release thread. What its parent received still travels on as it
    came."""
    global lock, _releases, _stopped
    _live.clear()
    _sent.clear()  # the parent's holds, at the parent's broker
    # kept, never dropped: destroying a stream or a queued release's event calls the driver,
    # which a forked child must not do before it execs (it hangs on a lock another thread held)
    _left_by_fork.append((_releases, dict(_unmap_streams)))
    _unmap_streams.clear()
    _releases = queue.SimpleQueue()
    lock = threading.RLock()
    _release_thread.forget()
    _stopped = threading.Event()
    multiprocessing.util.Finalize(None, _stop_at_exit, exitpriority=100)


class _AfterFork:
    """multiprocessing clears its exit finalizers in a child it forks, after ``os.fork``'s
    hooks; this re-registers ours afterwards (``register_after_fork`` runs later)."""


_after_fork_key = _AfterFork()
atexit.register(_stop_at_exit)
multiprocessing.util.Finalize(None, _stop_at_exit, exitpriority=100)  # mp children
multiprocessing.util.register_after_fork(
    _after_fork_key, lambda _: multiprocessing.util.Finalize(None, _stop_at_exit, exitpriority=100)
)
os.register_at_fork(after_in_child=_after_fork_in_child)
