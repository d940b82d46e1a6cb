"""``gpu_serde.share(x)``: a CUDA torch tensor or CuPy array that crosses processes of one host
without a copy; its reduce and its rebuild side by side. Imports neither torch nor CuPy (the
library module of the object at hand does the library's part).

The memory is an :class:`~gpu_serde.ArenaMemoryResource` block: a tensor allocated there in the
first place (:func:`gpu_serde.tensors.empty`, :func:`gpu_serde.tensors.to_arena`,
:func:`gpu_serde.tensors.cupy_allocator`) is shared as it is; any other is copied into a block
once, by :func:`share`, which says so (:class:`SharedCopyWarning`). The payload
(``gpu_serde.wire.tshr``) is the block's arena payload (a hold at this process's broker, the
lifetime protocol of :mod:`gpu_serde.memory.lifetime`) and how the tensor lies over it. The
receiver maps the region once, takes the hold, waits for the sender's work and builds a tensor
of the same library, dtype, shape, strides and offset over the block, on the same GPU by UUID.

Ordering: :func:`share` makes the block's stream wait for the work queued so far on the
library's current stream (torch's or CuPy's) in the calling thread, and pickling does the same
in the pickling thread (a ``multiprocessing`` queue's feeder thread, Dask's and Ray's own
threads) before the arena records its event: a receiver sees the work queued on the caller's
stream before :func:`share` was called, and on the pickling thread's before pickling.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import warnings
import weakref
from typing import Any

from cuda.bindings import driver
from cuda.core import Buffer, Device

from gpu_serde import settings, wire
from gpu_serde.errors import ArenaFullError, HandoffError
from gpu_serde.format.device import VERSION
from gpu_serde.format.tensor import MetaPayload, decode_meta, decode_tshr
from gpu_serde.memory import buffers, lifetime, unsent
from gpu_serde.memory import driver as _driver
from gpu_serde.memory.arena import ArenaMemoryResource
from gpu_serde.memory.arena import importer as arena_importer
from gpu_serde.tensors.common import NAMES, NOT_HERE, need, need_torch_cuda

#: Bytes of each arena :func:`share` and :func:`~gpu_serde.tensors.empty` make on a GPU when
#: none was given (more are made as they fill; a larger object gets one of its own size).
ARENA_BYTES = (
    int(
        settings.number(
            "GPU_SERDE_SHARE_ARENA_MIB",
            1024,
            "a whole number of MiB, 1 to 2**30",
            integer=True,
            low=1,
            high=1 << 30,
        )
    )
    << 20
)
_MODULES = {"torch": "gpu_serde.tensors.torch", "cupy": "gpu_serde.tensors.cupy"}


class SharedCopyWarning(UserWarning):
    """:func:`gpu_serde.share` copied a tensor (once) because it was not in gpu_serde memory.

    Allocate it there in the first place to share it without a copy:
    :func:`gpu_serde.tensors.empty`, :func:`gpu_serde.tensors.to_arena` (a model's parameters),
    or :func:`gpu_serde.tensors.cupy_allocator` (CuPy).
    """


def library_of(x: object) -> str | None:
    """``"torch"`` or ``"cupy"`` for a tensor or array of an imported library, else None."""
    top = type(x).__module__.partition(".")[0]
    return top if top in _MODULES and top in sys.modules else None


_loaded: dict[str, Any] = {}  # library -> gpu_serde's module for it, once imported


def module(library: str, caller: str | None = None) -> Any:
    """gpu_serde's module for ``library`` (it imports the library: call it only once the library
    is in use, or ``caller``, a public function named in the error, needs it).

    Raises:
        HandoffError: the library is not installed here.
    """
    m = _loaded.get(library)
    if m is None:
        need(library, caller)
        m = _loaded[library] = importlib.import_module(_MODULES[library])
    return m


# ---- the blocks this process allocated for tensors ----
_lock = threading.RLock()  # re-entrant: a collection inside an allocation may run forget()
_blocks: dict[int, tuple[weakref.ref[Buffer], int]] = {}  # address -> (block, its stream)
_arenas: dict[int, list[ArenaMemoryResource]] = {}  # ordinal -> arenas share() made


def remember(buf: Buffer, stream: int) -> None:
    """Note ``buf`` (a block of an arena of this process, allocated on ``stream``) as memory that
    tensors live in: :func:`share` finds it by address."""
    ptr = int(buf.handle)

    def forget(ref: weakref.ref[Buffer]) -> None:
        with _lock:
            if _blocks.get(ptr, (None,))[0] is ref:
                del _blocks[ptr]

    with _lock:
        _blocks[ptr] = (weakref.ref(buf, forget), stream)


def block_at(ptr: int) -> tuple[Buffer, int] | None:
    """The block that starts at ``ptr`` and its stream, if this process allocated it for
    tensors and it is alive."""
    with _lock:
        hit = _blocks.get(ptr)
    if hit is None:
        return None
    buf = hit[0]()
    return None if buf is None or not buf.handle else (buf, hit[1])


_default_streams: dict[int, int] = {}  # ordinal -> handle: fixed for the process's life


def default_stream(ordinal: int) -> int:
    """The handle of cuda.core's default stream on device ``ordinal`` (what arena blocks are
    allocated on here)."""
    handle = _default_streams.get(ordinal)
    if handle is None:
        with _driver.context(ordinal):
            handle = _default_streams[ordinal] = int(Device(ordinal).default_stream.handle)
    return handle


def allocate(ordinal: int, nbytes: int, arena: ArenaMemoryResource | None = None) -> Buffer:
    """A block of ``nbytes`` for tensors on device ``ordinal``: from ``arena``, else from the
    arenas made here for it (a new one when they are full).

    Raises:
        ArenaFullError: ``arena`` has no block that large.
        TypeError: ``arena`` is not an ArenaMemoryResource.
        ValueError: ``arena`` is on another device.
        HandoffError: the driver refused a new arena.
    """
    nbytes = max(int(nbytes), 1)
    if arena is not None:
        check_arena(arena)
        if arena.device_id != ordinal:
            raise ValueError(
                f"the arena is on device {arena.device_id}, the tensor on device {ordinal}"
            )
        buf = arena.allocate(nbytes)
    else:
        buf = _from_own_arenas(ordinal, nbytes)
    remember(buf, default_stream(ordinal))
    return buf


def check_arena(arena: object) -> None:
    """Refuse an ``arena`` argument that is not an :class:`~gpu_serde.ArenaMemoryResource` of
    this process (one received from another process cannot allocate).

    Raises:
        TypeError: it is not one.
    """
    if not isinstance(arena, ArenaMemoryResource):
        raise TypeError(
            "arena= takes a gpu_serde.ArenaMemoryResource made in this process, not "
            f"{type(arena).__name__} (an arena received from another process cannot allocate: "
            "allocate in the process that made it, or make one here)"
        )


def _from_own_arenas(ordinal: int, nbytes: int) -> Buffer:
    with _lock:
        arenas = list(_arenas.get(ordinal, ()))
    for arena in arenas:
        try:
            return arena.allocate(nbytes)
        except ArenaFullError:
            continue
    arena = ArenaMemoryResource(Device(ordinal), max(ARENA_BYTES, nbytes))
    with _lock:
        _arenas.setdefault(ordinal, []).append(arena)
    return arena.allocate(nbytes)


def follow(ordinal: int, stream: int, block_stream: int) -> None:
    """Make ``block_stream`` wait for the work queued on ``stream`` so far (both raw handles on
    device ``ordinal``; 0 is the legacy default stream). Nothing to do when they are the same
    stream (torch's and CuPy's default against cuda.core's, the common case).

    Raises:
        HandoffError: the driver refused.
    """
    stream, block_stream = _driver.raw_stream(stream), _driver.raw_stream(block_stream)
    if stream == block_stream:
        return
    with _driver.context(ordinal):
        event = _driver.plain_event(ordinal)
        try:
            _driver.check("cuEventRecord", driver.cuEventRecord(event, stream))
            _driver.check("cuStreamWaitEvent", driver.cuStreamWaitEvent(block_stream, event, 0))
        finally:
            driver.cuEventDestroy(event)  # released once the wait has used it


# ---- the sender's side ----
class Shared:
    """A CUDA tensor or array made to travel without a copy to processes of this host: what
    :func:`gpu_serde.share` returns. Pickle it (Ray arguments, returns and ``ray.put``, Dask,
    ``multiprocessing``); the receiver gets a tensor of the same library, dtype, shape, strides,
    offset and ``requires_grad`` (an ``nn.Parameter`` stays one), over the same memory, on the
    same GPU found by UUID.

    In the sending process it is only a handle: ``block`` is the arena ``Buffer`` the tensor lies
    in, ``copied`` says whether :func:`share` had to copy it there, ``meta`` how the tensor lies
    over the block, ``library`` is ``"torch"`` or ``"cupy"``, ``ordinal`` this process's ordinal
    of the GPU and ``stream`` the block's stream (a raw handle). Sending it again sends the same
    memory (what the tensor holds at that moment).
    """

    __slots__ = ("__weakref__", "block", "copied", "library", "meta", "ordinal", "stream")

    def __init__(
        self,
        block: Buffer,
        meta: MetaPayload,
        copied: bool,
        library: str,
        ordinal: int,
        stream: int,
    ) -> None:
        self.block = block  #: the arena Buffer the tensor lies in
        self.meta = meta  #: how the tensor lies over it
        self.copied = copied  #: True when share() copied the tensor into the block
        self.library = library  #: "torch" or "cupy"
        self.ordinal = ordinal  #: this process's ordinal of the GPU
        self.stream = stream  #: the block's stream (raw handle)

    def __reduce__(self) -> tuple[Any, ...]:
        return reduce_shared(self)

    def __repr__(self) -> str:
        how = "a copy" if self.copied else "no copy"
        return (
            f"<gpu_serde.Shared {NAMES[self.library]} {self.meta.dtype}{list(self.meta.shape)} "
            f"on device {self.ordinal} ({how})>"
        )


def share(x: Any) -> Shared:
    """Make a CUDA torch tensor (or ``nn.Parameter``) or CuPy array travel without a copy to
    processes of this host: see :class:`Shared`. A tensor in gpu_serde memory
    (:func:`gpu_serde.tensors.empty`, :func:`gpu_serde.tensors.to_arena`,
    :func:`gpu_serde.tensors.cupy_allocator`) is shared as it is; any other is copied once, here,
    into an arena block (a :class:`SharedCopyWarning` says so), after the work queued on the
    library's current stream.

    Work queued so far on the library's current stream in this thread (a side stream too) is
    done before any receiver reads, as is work queued on the current stream of the thread that
    pickles the result. The sender may drop the tensor (and the returned object) right after
    sending it: the memory stays valid until every receiver has dropped what it received. A
    receiver whose sender died before it took its hold gets ``ExporterGoneError`` when it uses
    what it received; one on another host ``OtherHostError``; one that does not see the GPU
    ``DeviceNotVisibleError``.

    Raises:
        TypeError: ``x`` is not a CUDA torch tensor or CuPy array that gpu_serde carries (sparse,
            quantized and nested tensors, subclasses, and tensors with Python attributes are
            not).
        ArenaFullError, HandoffError: the copy found no room (a new arena was refused), or the
            driver refused to order the block after the current stream.
    """
    library = library_of(x)
    if library is None:
        raise TypeError(
            f"gpu_serde.share() takes a CUDA torch tensor or CuPy array, not {type(x).__name__}"
        )
    m = module(library)
    if not m.is_cuda(x):
        raise TypeError(
            f"gpu_serde.share() takes a dense CUDA {NAMES[library]} (on a GPU, strided, without "
            "Python attributes of its own); send others as they are (by value)"
        )
    found = in_gpu_serde_memory(x)
    if found is not None:  # ordered after the caller's stream now, the pickling thread's later
        follow(found.ordinal, m.current_stream(found.ordinal), found.stream)
        return found
    ordinal = m.device_of(x)
    meta, base, low, count = m.span(x)
    skip, nbytes = low * meta.itemsize, count * meta.itemsize
    buf = allocate(ordinal, skip + nbytes)  # the offset is kept: the block reaches to the last
    stream = default_stream(ordinal)
    if nbytes:
        current = m.current_stream(ordinal)
        with _driver.context(ordinal):
            _driver.check(
                "cuMemcpyDtoDAsync",
                driver.cuMemcpyDtoDAsync(int(buf.handle) + skip, base + skip, nbytes, current),
            )
        follow(ordinal, current, stream)
    else:  # an empty tensor: nothing to copy, nothing to say
        return Shared(buf, meta, False, library, ordinal, stream)
    warnings.warn(
        SharedCopyWarning(
            f"gpu_serde.share() copied a {NAMES[library]} of {nbytes:,} bytes into gpu_serde "
            "memory (once, here): allocate it with gpu_serde.tensors.empty() (torch), "
            "gpu_serde.tensors.to_arena(model), or under cupy.cuda.using_allocator("
            "gpu_serde.tensors.cupy_allocator()) to share it without a copy"
        ),
        stacklevel=2,
    )
    return Shared(buf, meta, True, library, ordinal, stream)


def _over_block(meta: MetaPayload, first: int, size: int) -> MetaPayload | None:
    """``meta`` placed in a block whose element [0, ...] is ``first`` bytes in; None when it
    does not lie inside the block on whole elements."""
    if first < 0 or first % meta.itemsize:
        return None
    placed = meta._replace(offset=first // meta.itemsize)
    try:
        return decode_meta(placed.wire(), size)
    except Exception:
        return None


def reduce_shared(s: Shared) -> tuple[Any, ...]:
    """Reducer of :class:`Shared`: ``(gpu_serde.wire.tshr, (payload,))``. Never raises: what
    cannot be sent (a closed block, a driver refusal) travels as its error, raised where it is
    used."""
    try:
        lifetime.not_forked(f"shared {NAMES[s.library]}")  # before any CUDA call
        follow(s.ordinal, module(s.library).current_stream(s.ordinal), s.stream)
        fn, (block,) = buffers.reduction(s.block)
        if fn is not wire.abuf:
            raise HandoffError(f"a shared tensor's block travels as {fn.__name__}, not abuf")
        return (wire.tshr, ((VERSION, s.meta.wire(), block),))
    except Exception as exc:
        return unsent.unsent(NAMES[s.library], exc)


# ---- the receiver's side ----
def rebuild_shared(payload: object) -> Any:
    """Rebuild body of :func:`gpu_serde.wire.tshr`: a tensor over the block, mapped here (the
    region once per process), on this process's ordinal of the same GPU.

    Raises:
        PayloadError: malformed; DeviceNotVisibleError: the GPU is not visible here;
        HandoffError: the library is missing here, and as an arena buffer's rebuild
            (``OtherHostError``, ``ExporterGoneError``, ``TokenRefusedError``).
    """
    p = decode_tshr(payload)
    what = f"a shared {NAMES[p.meta.library]}"
    region = p.block.region
    if not arena_importer.is_attached(region):  # the host and the GPU, before anything else
        lifetime.local_ordinal(region.device, region.boot, what)
    m = module(p.meta.library)
    if p.meta.library == "torch":  # before the hold: nothing taken for a tensor it cannot build
        need_torch_cuda(what, NOT_HERE, region.device)
    block = payload[2]  # type: ignore[index]  # decode checked: a tuple
    buf = arena_importer.receive(p.block, block, what)
    t = m.over(buf, p.meta, int(buf.device_id))
    with contextlib.suppress(TypeError):  # not weakly referenceable: sent on by value
        lifetime.forward_as(t, (wire.tshr, (payload,)))  # sent on, it is the same memory
    return t


def shared_kind(payload: object) -> str:
    """What a shared payload is, for messages."""
    p = decode_tshr(payload)
    return f"shared {NAMES[p.meta.library]}"


def in_gpu_serde_memory(x: Any) -> Shared | None:
    """``x`` as :class:`Shared` if it lies in a block this process allocated for tensors (no
    copy), else None."""
    library = library_of(x)
    if library is None:
        return None
    m = module(library)
    if not m.is_cuda(x):
        return None
    storage, first = m.storage_of(x)
    hit = block_at(storage)
    if hit is None:
        return None
    buf, stream = hit
    meta = _over_block(m.meta_of(x), first - int(buf.handle), int(buf.size))
    return None if meta is None else Shared(buf, meta, False, library, m.device_of(x), stream)
