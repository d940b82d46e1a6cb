"""The hand-off core shared by every kind of memory that crosses processes (pools, VMM).

- the host check: memory crosses processes only on the host that exported it (its host identity,
  the kernel ``boot_id`` unless ``GPU_SERDE_HOST_ID`` says otherwise: :mod:`gpu_serde.hostid`);
- what was sent: the payload a buffer was sent with, kept while its exporter holds it, so that
  sending it again costs nothing;
- what was received: an imported object is forwarded as it came, and its exporter is told once it
  has been freed here (or this process exits);
- the release thread, which waits for a free to complete on the GPU before it tells the exporter
  (CUDA's rule for imported memory: the importer's free completes before the exporter's), and
  unmaps freed memory in the background;
- the fork and exit hooks that keep those promises in children and at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing.util
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from cuda.bindings import driver
from cuda.core import Buffer, Device

from gpu_serde import broker as _broker
from gpu_serde import inventory as _inventory
from gpu_serde.errors import ExporterGoneError, HandoffError, OtherHostError
from gpu_serde.hostid import host_id
from gpu_serde.text import quoted

#: Seconds the exporter still keeps a buffer after its last importer released it, so that a hop
#: (a Dask scheduler, a Ray task passing it on) that imported and dropped it does not free it
#: under the next importer. Set it before the first export.
RELEASE_GRACE_S = float(os.environ.get("GPU_SERDE_RELEASE_GRACE_S", "5"))


def __getattr__(name: str) -> bytes:
    if name == "BOOT_ID":  # the name earlier releases had: the host identity, read on first use
        return host_id()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


lock = threading.RLock()  # guards what was sent and what was imported, in every memory module
_sent: weakref.WeakKeyDictionary[Any, tuple[bytes, tuple[Any, ...]]] = weakref.WeakKeyDictionary()
_origin: dict[int, tuple[Any, ...]] = {}  # id(imported object) -> the reduction it came with


def check_host(boot: bytes, what: str) -> None:
    """Raise :class:`OtherHostError` unless ``boot`` is this host's identity. ``what`` names
    the memory and where it came from; the caller escapes the wire text in it
    (:func:`gpu_serde.text.quoted`)."""
    if boot != host_id():
        raise OtherHostError(
            f"{what} reached host {quoted(_inventory.inventory().host)}, another host: GPU "
            "memory is mapped only on the host that exported it, and this was sent to be mapped. "
            "To reach other hosts, send the buffer wrapped in gpu_serde.portable(buf), which "
            "carries a copy (Ray tasks, actors and ray.put; Dask task arguments; multiprocessing); "
            "Dask sends buffers that are task results or scattered data by value to other hosts "
            "by itself (return it from a task, or client.scatter it, instead of passing it inside "
            "a task's arguments). Or run this work on the exporter's host."
        )


def any_device() -> Device:
    """This thread's current Device, or the first visible one, for work that needs a context but
    no particular GPU (pinned host memory).

    Raises:
        HandoffError: this process sees no GPU.
    """
    inv = _inventory.inventory()
    if not inv.devices:
        raise HandoffError(
            "host memory (a pinned pool, or a VirtualMemoryResource of host memory) needs a CUDA "
            f"device in the receiving process to map it, and this process sees none: "
            f"{inv.describe()}"
        )
    return Device()


@contextlib.contextmanager
def current(dev: Device) -> Iterator[None]:
    """Make ``dev`` current for the block, then restore the thread's previous context."""
    prev = driver.cuCtxGetCurrent()[1]
    dev.set_current()
    try:
        yield
    finally:
        driver.cuCtxSetCurrent(prev)


def let_go(buf: Buffer) -> None:
    """Runs in the broker's release thread when the last importer released ``buf``: freeing
    needs a context in this thread (the buffer's device's, or any for pinned memory)."""
    (Device(buf.device_id) if buf.device_id >= 0 else Device()).set_current()


def sent_payload(buf: Buffer, make: Callable[[], tuple[bytes, tuple[Any, ...]]]) -> tuple[Any, ...]:
    """The payload ``buf`` travels as: the one it was sent with while its exporter still holds
    it, else ``make()``'s, which returns ``(hold token, payload)`` and is remembered."""
    with lock:
        sent = _sent.get(buf)
        if sent is None or _broker.broker().peek(sent[0]) is not buf:  # first time, or let go
            sent = _sent[buf] = make()
        return sent[1]


def forwarded(obj: object) -> tuple[Any, ...] | None:
    """The reduction an imported object came with (it travels on as it came), or None."""
    return _origin.get(id(obj))


def forward_as(obj: object, reduction: tuple[Any, ...]) -> None:
    """Forward ``obj`` as ``reduction`` while it lives (replacing how it came, if it was
    imported: a portable buffer stays portable when a hop passes it on)."""
    new = id(obj) not in _origin
    _origin[id(obj)] = reduction
    if new:
        weakref.finalize(obj, _origin.pop, id(obj), None)


def remember(obj: object, reduction: tuple[Any, ...]) -> None:
    """Forward ``obj`` as ``reduction`` for as long as it lives (imported pools live forever)."""
    _origin[id(obj)] = reduction


# Releases: a buffer's free (or finalizer) only puts on a queue (it may run inside garbage
# collection, in any thread, so it takes no lock and does no I/O); one thread waits for the free
# to complete and tells the exporters.
WHOLE_DEVICE = "device"  # release after the whole device is idle (the free is queued)
_releases: queue.SimpleQueue[tuple[Any, str, bytes, int]] = queue.SimpleQueue()
_live: dict[int, tuple[str, bytes, int]] = {}  # key -> (broker address, hold token, device)
_sending = threading.Lock()  # held by the release thread while it tells one exporter
_STOP = object()  # the exit flush's mark on the queue: the release thread stops there
_stopped = threading.Event()  # set by the release thread when it reaches the mark
#: Seconds an exiting importer waits for the release thread to tell what was queued before.
EXIT_WAIT_S = 2.0
_keys = itertools.count(1)


def new_key() -> int:
    """A key for :func:`hold_import` that is never an ``id()`` (it is negative)."""
    return -next(_keys)


def hold_import(key: int, address: str, token: bytes, device: int) -> None:
    """Remember that this process holds ``token`` at ``address`` (``device``: where to wait for
    the free; -1 until known); :func:`queue_release` lets go of it."""
    _live[key] = (address, token, device)


def drop_import(key: int) -> tuple[str, bytes, int] | None:
    """Forget a hold without telling its exporter (the caller tells it)."""
    return _live.pop(key, None)


def queue_release(key: int, event: object) -> None:
    """Tell the exporter of hold ``key``, from the release thread, once ``event`` (an ``Event``
    after the free, :data:`WHOLE_DEVICE`, or None: a finalizer) has completed."""
    item = _live.pop(key, None)
    if item is not None:
        _releases.put((event, *item))


def _tell(event: object, address: str, token: bytes, device: int) -> None:
    try:
        if event is None:
            time.sleep(0.01)  # a finalizer ran just before its Buffer queued the free
        if event is None or event is WHOLE_DEVICE:
            raise LookupError  # no stream says when the work on it is done: the whole device
        event.sync()  # type: ignore[attr-defined]  # the event follows the free on its stream
    except Exception:
        with contextlib.suppress(Exception):
            Device(device).set_current()
            Device(device).sync()
    _broker.release(address, token)


#: Seconds without a release after which an importer unmaps the memory it has freed. The driver
#: unmaps freed imported memory lazily, at this process's next synchronisation (any stream): until
#: then, a buffer sent again from the same pool memory maps at no cost; after it, the unmapping
#: would fall on the user's next synchronisation, so the release thread does it in the background
#: on a stream of its own (which waits for no one's work).
UNMAP_AFTER_S = 0.05
_unmap_streams: dict[int, Any] = {}  # device ordinal -> the release thread's idle stream


def _unmap(devices: set[int]) -> None:
    for ordinal in devices:
        with contextlib.suppress(Exception):
            Device(ordinal).set_current()
            stream = _unmap_streams.get(ordinal)
            if stream is None:
                stream = _unmap_streams[ordinal] = Device(ordinal).create_stream()
            stream.sync()  # nothing runs on it: it only lets the driver unmap what was freed


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
        with _sending, contextlib.suppress(Exception):  # a dead thread would stop all releases
            _tell(*item)
        if item[0] is not None and item[0] is not WHOLE_DEVICE and item[3] >= 0:
            freed.add(item[3])


_worker: threading.Thread | None = None


def start_release_thread() -> None:
    """Start the release thread (once per process; an importer calls it before its first hold)."""
    global _worker
    if _worker is None or not _worker.is_alive():
        with lock:
            if _worker is None or not _worker.is_alive():
                _worker = threading.Thread(
                    target=_release_worker, name="gpu_serde-release", daemon=True
                )
                _worker.start()


def _forget(key: int, release: bool) -> None:
    _origin.pop(key, None)
    if release:
        queue_release(key, None)


def track_import(buf: Buffer, reduction: tuple[Any, ...], key: int | None = None) -> None:
    """Forward an imported buffer as it came (``reduction``) while it lives. With ``key=None``
    its hold (:func:`hold_import` under ``id(buf)``) is released when it is collected; with a
    key, its memory resource releases the hold when it frees the buffer."""
    _origin[id(buf)] = reduction
    weakref.finalize(buf, _forget, id(buf), key is None)


def _release_all_at_exit() -> None:
    """An importer that exits tells the exporters about everything it held or had released.

    The release thread first finishes what was queued before the exit (a release it had taken
    off the queue is in no list here: without this wait it was lost when the process ended with
    the thread in the middle of it) and stops, so that no daemon thread calls the driver while
    the interpreter is torn down; whatever it has not told within :data:`EXIT_WAIT_S` (the bound
    of the whole wait) is told here."""
    deadline = time.monotonic() + EXIT_WAIT_S  # one bound in all: a Nanny kills a slow exit
    worker = _worker
    if worker is not None and worker.is_alive():
        _releases.put((_STOP, "", b"", -1))
        _stopped.wait(EXIT_WAIT_S)
    # a release still in flight (the thread did not reach the mark in time): let it finish
    got = _sending.acquire(timeout=max(0.0, deadline - time.monotonic()))
    try:
        _flush_all()
    finally:
        if got:
            _sending.release()


def _flush_all() -> None:
    items = []
    while _live:  # popitem: a free in another thread cannot queue an entry taken here too
        with contextlib.suppress(KeyError):
            items.append((None, *_live.popitem()[1]))
    while True:
        try:
            items.append(_releases.get_nowait())
        except queue.Empty:
            break
    gone: set[str] = set()  # exporters that did not answer: exiting too, or gone
    for event, address, token, _ in items:
        if event is _STOP:
            continue  # the mark the release thread did not reach in time
        with contextlib.suppress(Exception):
            if event is not None and event is not WHOLE_DEVICE:
                event.sync()  # a buffer closed on a stream just before exit
        if address in gone:
            continue
        try:
            _broker.release(address, token, timeout=0.5, gone=True)
        except ExporterGoneError:
            gone.add(address)
        except Exception:
            pass


_left_by_fork: list[dict[int, Any]] = []


def _after_fork_in_child() -> None:
    """A forked child holds none of its parent's imports: it must neither release them at exit
    nor lose its own releases (the release thread did not survive the fork)."""
    global _sending, lock, _worker, _releases, _stopped
    _live.clear()
    _origin.clear()
    # kept, never dropped: destroying a stream or a queued release's event calls the driver,
    # which a forked child must not do before it execs (it hangs on a lock another thread held)
    _left_by_fork.append({0: _releases, 1: dict(_unmap_streams)})
    _unmap_streams.clear()
    _releases = queue.SimpleQueue()
    _sending, lock, _worker = threading.Lock(), threading.RLock(), None
    _stopped = threading.Event()
    multiprocessing.util.Finalize(None, _release_all_at_exit, exitpriority=100)


class _AfterFork:
    """multiprocessing clears its exit finalizers in a child it forks, after ``os.fork``'s
    hooks; this re-registers ours afterwards (``register_after_fork`` runs later)."""


_after_fork_key = _AfterFork()
atexit.register(_release_all_at_exit)
multiprocessing.util.Finalize(None, _release_all_at_exit, exitpriority=100)  # mp children
multiprocessing.util.register_after_fork(
    _after_fork_key,
    lambda _: multiprocessing.util.Finalize(None, _release_all_at_exit, exitpriority=100),
)
os.register_at_fork(after_in_child=_after_fork_in_child)
