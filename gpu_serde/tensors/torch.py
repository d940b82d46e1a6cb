"""torch tensors by GPU UUID: their reducers and the torch half of every rebuild, side by side.

Imported only once the user has imported torch (:mod:`gpu_serde.tensors.lazy`), never by
gpu_serde itself before that. What a CUDA ``torch.Tensor`` (or ``nn.Parameter``) becomes:

- pickled by anyone but torch itself (pickle, cloudpickle, Ray, Dask task arguments):
  :func:`reduce_tensor`, by value: its bytes, its GPU by UUID (``gpu_serde.wire.tval``);
- through ``multiprocessing`` (``torch.multiprocessing``): :func:`reduce_tensor_mp`, torch's own
  CUDA IPC with the device by UUID (``gpu_serde.wire.tipc``);
- wrapped by :func:`gpu_serde.share`: an arena block, without a copy (``gpu_serde.wire.tshr``).

CPU tensors, tensors that torch pickles itself (``torch.save``: see
:func:`~gpu_serde.tensors.common.torch_pickles`), and what gpu_serde does not carry (sparse,
quantized, nested tensors, subclasses and tensors with Python attributes) keep torch's own
reduction.
"""

from __future__ import annotations

from typing import Any

import torch
from cuda.bindings import driver
from cuda.core import Device
from torch.utils.dlpack import from_dlpack

from gpu_serde import wire
from gpu_serde.device import device_payload
from gpu_serde.errors import PayloadError
from gpu_serde.format.device import VERSION
from gpu_serde.format.tensor import MetaPayload, TipcPayload, TvalPayload
from gpu_serde.hostid import host_id
from gpu_serde.memory import driver as _driver
from gpu_serde.memory.bycopy import host_memory_available
from gpu_serde.tensors.common import Carried, kept_lead, torch_pickles

LIBRARY = "torch"
_CHECK_ABOVE = 64 << 20  # smaller copies do not read /proc/meminfo first
_KINDS = {torch.Tensor: "Tensor", torch.nn.Parameter: "Parameter"}


def carried(t: Any) -> bool:
    """True for a tensor gpu_serde carries: a dense CUDA ``Tensor`` or ``Parameter`` without
    Python attributes of its own."""
    return (
        type(t) in _KINDS
        and t.is_cuda
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not getattr(t, "__dict__", None)  # Python attributes: torch's own reduction
    )


def meta_of(t: Any, offset: int | None = None) -> MetaPayload:
    """How ``t`` lies over its storage (or, with ``offset``, over memory where element
    [0, ..., 0] is ``offset`` elements in)."""
    return MetaPayload(
        LIBRARY,
        _KINDS.get(type(t), "Tensor"),
        str(t.dtype).removeprefix("torch."),
        int(t.element_size()),
        tuple(int(d) for d in t.shape),
        tuple(int(s) for s in t.stride()),
        int(t.storage_offset()) if offset is None else offset,
        bool(t.requires_grad),
    )


def dtype_of(meta: MetaPayload) -> Any:
    """The torch dtype a payload names.

    Raises:
        PayloadError: no torch dtype has that name and itemsize, or requires_grad on a dtype
            that cannot have gradients.
    """
    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype) or dtype.itemsize != meta.itemsize:
        raise PayloadError(
            f"invalid gpu_serde payload: this torch {torch.__version__} has no dtype "
            f"{meta.dtype!r} of {meta.itemsize} bytes (a newer torch sent it?)"
        )
    if meta.requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise PayloadError(f"invalid gpu_serde payload: a {meta.dtype} tensor cannot require grad")
    return dtype


def finish(t: Any, meta: MetaPayload) -> Any:
    """``t`` as the kind the payload names, with its ``requires_grad``."""
    if meta.kind == "Parameter":
        return torch.nn.Parameter(t, requires_grad=meta.requires_grad)
    if meta.requires_grad:
        t.requires_grad_(True)
    return t


#: torch's own getter of a current stream's raw handle (what its compiled kernels launch on),
#: read on every send: ``torch.cuda.current_stream(i).cuda_stream`` builds a Stream object each
#: time. Absent from a torch without CUDA or a future torch: then the public call, which gives
#: the same handle (a GPU test checks that they agree).
_RAW_CURRENT = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(ordinal: int) -> int:
    """The handle of torch's current stream on device ``ordinal`` in this thread, as the driver
    reads it (torch's 0 is the legacy default stream)."""
    if _RAW_CURRENT is not None and torch.cuda.is_initialized():
        return _driver.raw_stream(int(_RAW_CURRENT(ordinal)))
    return _driver.raw_stream(int(torch.cuda.current_stream(ordinal).cuda_stream))


# ---- by value: pickle, cloudpickle, Ray, Dask ----
def value_payload(t: Any, device: bytes | None = None) -> TvalPayload:
    """``t``'s by-value payload: the bytes of the elements it touches (not the rest of its
    storage), copied to host memory after the work queued on torch's current stream, and its GPU
    (``device``, a device payload: by default that of ``t``'s own GPU; given, ``t`` may be a CPU
    tensor, as :func:`gpu_serde.testing.sent_tensor` makes one).

    Raises:
        HostCopyError: the copy does not fit in this host's available memory.
    """
    from gpu_serde.errors import HostCopyError

    kind, grad = _KINDS[type(t)], bool(t.requires_grad)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    meta = meta_of(t)._replace(kind=kind, requires_grad=grad)
    low, high = meta.span()
    nbytes = (high - low) * meta.itemsize
    if nbytes > _CHECK_ABOVE and nbytes > host_memory_available():
        raise HostCopyError(
            f"sending a CUDA tensor of {nbytes} bytes by value needs as much host memory; this "
            "host has less available. Share it instead (gpu_serde.share), or send less."
        )
    flat = t.as_strided((high - low,), (1,), low)
    host = flat.cpu() if high > low else torch.empty((0,), dtype=t.dtype)
    view = memoryview(host.view(torch.uint8).numpy()).cast("B")
    if device is None:
        device = device_payload(Device(t.device.index))
    return TvalPayload(VERSION, device, meta, low, nbytes, view)


def reduce_tensor(t: Any) -> tuple[Any, ...]:
    """``copyreg`` reducer for ``torch.Tensor`` and ``nn.Parameter`` while gpu_serde is
    installed: a CUDA tensor by value, its GPU by UUID (``gpu_serde.wire.tval``); anything else,
    and any tensor torch pickles itself, as torch reduces it. Never raises for a CUDA tensor: one
    that cannot be sent travels as its error."""
    if not carried(t) or torch_pickles():
        return t.__reduce_ex__(2)  # type: ignore[no-any-return]  # torch ignores the protocol
    from gpu_serde.memory import lifetime, unsent

    origin = lifetime.forwarded(t)
    if origin is not None:  # a shared tensor received here travels on as it came
        return origin
    try:
        p = value_payload(t)
    except Exception as exc:
        return unsent.unsent("torch.Tensor", exc)
    return (wire.tval, (p._replace(data=Carried(p.data)).wire(),))


def from_value(p: TvalPayload, ordinal: int) -> Any:
    """A new tensor on device ``ordinal`` with a by-value payload's bytes (copied in on the
    current stream, in order before any later work on it); its storage reaches from the start
    to the last element, so that the offset is kept
    (:data:`~gpu_serde.tensors.common.KEEP_OFFSET_BYTES` says when not)."""
    dtype = dtype_of(p.meta)
    device = torch.device("cuda", ordinal)
    lead = kept_lead(p.start, p.nbytes, p.meta.itemsize)
    dst = torch.empty((lead + p.nbytes // p.meta.itemsize,), dtype=dtype, device=device)
    if p.nbytes:
        src = memoryview(p.data).cast("B")
        at = dst.data_ptr() + lead * p.meta.itemsize
        with _driver.context(ordinal):
            _driver.check(
                "cuMemcpyHtoDAsync",
                driver.cuMemcpyHtoDAsync(at, src, p.nbytes, current_stream(ordinal)),
            )
    offset = p.meta.offset - (p.start - lead)
    return finish(dst.as_strided(p.meta.shape, p.meta.strides, offset), p.meta)


# ---- without a copy: over a Buffer (an arena block) ----
def over(buf: Any, meta: MetaPayload, ordinal: int) -> Any:
    """A tensor over ``buf``'s memory (no copy), laid out as ``meta`` says; keeps ``buf`` alive
    while it lives."""
    dtype = dtype_of(meta)
    count = int(buf.size) // meta.itemsize
    if count == 0 or meta.numel == 0:
        device = torch.device("cuda", ordinal)
        t = torch.empty_strided(meta.shape, meta.strides, dtype=dtype, device=device)
        return finish(t, meta)
    # the Buffer's own DLPack capsule: bytes on its GPU, the Buffer kept alive by the tensor's
    # storage (no __cuda_array_interface__ dict for torch to build and parse)
    if torch.cuda.current_device() == ordinal:  # the common case: no switch there and back
        raw = from_dlpack(buf.__dlpack__())
    else:  # torch makes no context on its current GPU for a tensor on another
        with torch.cuda.device(ordinal):
            raw = from_dlpack(buf.__dlpack__())
    whole = count * meta.itemsize
    if raw.numel() != whole:  # a block not a whole number of elements long
        raw = raw[:whole]
    flat = raw.view(dtype)
    return finish(flat.as_strided(meta.shape, meta.strides, meta.offset), meta)


def storage_of(t: Any) -> tuple[int, int]:
    """The address of ``t``'s storage and of its element [0, ..., 0]."""
    return int(t.untyped_storage().data_ptr()), int(t.data_ptr())


def span(t: Any) -> tuple[MetaPayload, int, int, int]:
    """``t``'s meta over its storage, the storage's address, and the first element it touches
    and how many from there to the last."""
    meta = meta_of(t)
    low, high = meta.span()
    return meta, int(t.untyped_storage().data_ptr()), low, high - low


def device_of(t: Any) -> int:
    """The ordinal of ``t``'s GPU in this process."""
    return int(t.device.index)


def is_cuda(t: Any) -> bool:
    """True for a CUDA tensor gpu_serde can share."""
    return carried(t)


def empty(shape: Any, dtype: Any, buf: Any, ordinal: int) -> Any:
    """A contiguous tensor of ``shape`` and ``dtype`` over ``buf`` (an arena block)."""
    dt = torch.get_default_dtype() if dtype is None else dtype
    size = torch.Size(shape)
    meta = MetaPayload(
        LIBRARY,
        "Tensor",
        str(dt).removeprefix("torch."),
        int(dt.itemsize),
        tuple(size),
        tuple(_contiguous_strides(size)),
        0,
        False,
    )
    return over(buf, meta, ordinal)


def _contiguous_strides(shape: Any) -> list[int]:
    strides, step = [], 1
    for d in reversed(list(shape)):
        strides.append(step)
        step *= max(int(d), 1)
    return list(reversed(strides))


def nbytes_of(shape: Any, dtype: Any) -> int:
    """The bytes a contiguous tensor of ``shape`` and ``dtype`` takes."""
    dt = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, not {type(dt).__name__}")
    n = 1
    for d in torch.Size(shape):
        n *= int(d)
    return n * int(dt.itemsize)


# ---- torch.multiprocessing: torch's own CUDA IPC, the device by UUID ----
def reduce_tensor_mp(t: Any) -> tuple[Any, ...]:
    """``multiprocessing`` reducer for ``torch.Tensor`` and ``nn.Parameter`` while gpu_serde is
    installed: torch's own (``torch.multiprocessing.reductions.reduce_tensor``: shared memory for
    CPU tensors, CUDA IPC for CUDA tensors), with a CUDA tensor's device carried by UUID instead
    of the index (``gpu_serde.wire.tipc``). A tensor in gpu_serde memory (which torch's IPC
    cannot share: torch did not allocate it) travels as :func:`gpu_serde.share` sends it, and a
    shared tensor received here as it came.

    Raises:
        RuntimeError: as torch's reducer (a non-leaf tensor that requires grad, ...).
    """
    from torch.multiprocessing import reductions

    from gpu_serde.memory import lifetime
    from gpu_serde.tensors import sharing

    if not carried(t):
        return reductions.reduce_tensor(t)  # type: ignore[no-any-return]
    origin = lifetime.forwarded(t)
    if origin is not None:  # a shared tensor received here travels on as it came
        return origin
    shared = sharing.in_gpu_serde_memory(t)  # torch cannot share memory it did not allocate
    if shared is not None:
        return sharing.reduce_shared(shared)
    fn, args = reductions.reduce_tensor(t)
    if fn is not reductions.rebuild_cuda_tensor:
        return fn, args
    (_, _, _, offset, _, _, index, handle, size, storage_offset, grad, counter, counter_offset,
     event, sync) = args  # fmt: skip
    p = TipcPayload(
        VERSION,
        device_payload(Device(int(index))),
        host_id(),
        meta_of(t, int(offset))._replace(requires_grad=bool(grad)),
        None if handle is None else bytes(handle),
        int(size),
        int(storage_offset),
        bytes(counter),
        int(counter_offset),
        None if event is None else bytes(event),
        bool(sync),
    )
    return (wire.tipc, (p.wire(),))


def from_ipc(p: TipcPayload, ordinal: int) -> Any:
    """The tensor a ``torch.multiprocessing`` payload names, opened by torch's own
    ``rebuild_cuda_tensor`` on device ``ordinal`` (this process's ordinal of the sender's GPU)."""
    from torch.multiprocessing import reductions

    dtype = dtype_of(p.meta)
    cls = torch.nn.Parameter if p.meta.kind == "Parameter" else torch.Tensor
    return reductions.rebuild_cuda_tensor(
        cls,
        torch.Size(p.meta.shape),
        p.meta.strides,
        p.meta.offset,
        torch.storage.TypedStorage,
        dtype,
        ordinal,
        p.handle,
        p.storage_bytes,
        p.storage_offset,
        p.meta.requires_grad,
        p.counter,
        p.counter_offset,
        p.event,
        p.event_sync,
    )


def place_value(p: TvalPayload, device: Any) -> Any:
    """A by-value payload's tensor on ``device`` (``"cpu"``, ``"cuda:1"``, a ``torch.device``,
    or an ordinal), whatever GPU it came from."""
    dtype = dtype_of(p.meta)
    where = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    count = p.nbytes // p.meta.itemsize
    lead = kept_lead(p.start, p.nbytes, p.meta.itemsize)
    full = torch.empty((lead + count,), dtype=dtype, device=where)
    if count:
        raw = torch.frombuffer(bytearray(memoryview(p.data).cast("B")), dtype=torch.uint8)
        full[lead:] = (raw if dtype == torch.uint8 else raw.view(dtype)).to(where)
    offset = p.meta.offset - (p.start - lead)
    return finish(full.as_strided(p.meta.shape, p.meta.strides, offset), p.meta)
