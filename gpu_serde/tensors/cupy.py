"""CuPy arrays by GPU UUID: their reducer and the CuPy half of every rebuild, side by side.

Imported only once the user has imported CuPy (:mod:`gpu_serde.tensors.lazy`). A
``cupy.ndarray`` pickled anywhere (pickle, cloudpickle, Ray, Dask task arguments,
``multiprocessing``) travels by value with its GPU's UUID (``gpu_serde.wire.tval``); wrapped by
:func:`gpu_serde.share`, without a copy (``gpu_serde.wire.tshr``). Arrays gpu_serde does not
carry (structured or object dtypes, strides that are not whole elements) keep CuPy's own
reduction. Strides may be negative (``x[::-1]``): the payload's offset says where element
[0, ..., 0] lies.
"""

from __future__ import annotations

import re
from typing import Any

import cupy
import numpy as np

from gpu_serde import wire
from gpu_serde.device import device_payload
from gpu_serde.errors import PayloadError
from gpu_serde.format.device import VERSION
from gpu_serde.format.tensor import MetaPayload, TvalPayload
from gpu_serde.memory import driver as _driver
from gpu_serde.tensors.common import Carried, kept_lead

LIBRARY = "cupy"
_TYPESTR = re.compile(r"[<>|=][biufc][0-9]{1,2}")


def is_cuda(x: Any) -> bool:
    """True for an array gpu_serde carries: a ``cupy.ndarray`` of a numeric or bool dtype whose
    strides and offset are whole elements."""
    if type(x) is not cupy.ndarray or x.dtype.kind not in "biufc":
        return False
    size = x.dtype.itemsize
    return all(s % size == 0 for s in x.strides) and (x.data.ptr - x.data.mem.ptr) % size == 0


def meta_of(x: Any, offset: int | None = None) -> MetaPayload:
    """How ``x`` lies over its allocation (or, with ``offset``, over memory where element
    [0, ..., 0] is ``offset`` elements in)."""
    size = int(x.dtype.itemsize)
    here = (x.data.ptr - x.data.mem.ptr) // size if offset is None else offset
    return MetaPayload(
        LIBRARY,
        "ndarray",
        x.dtype.str,
        size,
        tuple(int(d) for d in x.shape),
        tuple(int(s) // size for s in x.strides),
        int(here),
        False,
    )


def dtype_of(meta: MetaPayload) -> Any:
    """The NumPy dtype a payload names.

    Raises:
        PayloadError: not a numeric or bool type string of that itemsize.
    """
    if _TYPESTR.fullmatch(meta.dtype) is None:
        raise PayloadError(f"invalid gpu_serde payload: {meta.dtype!r} is not a CuPy dtype")
    dtype = np.dtype(meta.dtype)
    if dtype.itemsize != meta.itemsize:
        raise PayloadError(
            f"invalid gpu_serde payload: {meta.dtype!r} is not {meta.itemsize} bytes"
        )
    return dtype


def device_of(x: Any) -> int:
    """The ordinal of ``x``'s GPU in this process."""
    return int(x.device.id)


def current_stream(ordinal: int) -> int:
    """The handle of CuPy's current stream on device ``ordinal`` in this thread, as the driver
    reads it (CuPy's 0 is the legacy default stream)."""
    with cupy.cuda.Device(ordinal):
        return _driver.raw_stream(int(cupy.cuda.get_current_stream().ptr))


def storage_of(x: Any) -> tuple[int, int]:
    """The address of ``x``'s allocation and of its element [0, ..., 0]."""
    return int(x.data.mem.ptr), int(x.data.ptr)


def span(x: Any) -> tuple[MetaPayload, int, int, int]:
    """``x``'s meta over its allocation, the allocation's address, and the first element it
    touches and how many from there to the last."""
    meta = meta_of(x)
    low, high = meta.span()
    return meta, int(x.data.mem.ptr), low, high - low


def _strided(flat: Any, meta: MetaPayload, dtype: Any) -> Any:
    memptr = flat.data + meta.offset * meta.itemsize
    strides = tuple(s * meta.itemsize for s in meta.strides)
    return cupy.ndarray(meta.shape, dtype, memptr=memptr, strides=strides)


# ---- by value ----
def reduce_array(x: Any) -> tuple[Any, ...]:
    """Reducer for ``cupy.ndarray`` while gpu_serde is installed: by value, its GPU by UUID
    (``gpu_serde.wire.tval``); an array gpu_serde does not carry as CuPy reduces it. Never
    raises for a carried array: one that cannot be sent travels as its error."""
    if not is_cuda(x):
        return x.__reduce_ex__(2)  # type: ignore[no-any-return]
    from gpu_serde.memory import lifetime, unsent

    origin = lifetime.forwarded(x)
    if origin is not None:
        return origin
    try:
        meta, _, low, count = span(x)
        nbytes = count * meta.itemsize
        if nbytes:
            at = cupy.cuda.MemoryPointer(x.data.mem, low * meta.itemsize)
            raw = cupy.ndarray((nbytes,), cupy.uint8, memptr=at)
            host = raw.get()  # after the work queued on the current stream
        else:
            host = np.empty((0,), dtype=np.uint8)
        dev = device_payload(_device(device_of(x)))
        view = Carried(memoryview(host).cast("B"))
        p = TvalPayload(VERSION, dev, meta, low, nbytes, view)
    except Exception as exc:
        return unsent.unsent("cupy.ndarray", exc)
    return (wire.tval, (p.wire(),))


def _device(ordinal: int) -> Any:
    from cuda.core import Device

    return Device(ordinal)


def from_value(p: TvalPayload, ordinal: int) -> Any:
    """A new array on device ``ordinal`` with a by-value payload's bytes; its allocation reaches
    from the start to the last element, so that the offset is kept."""
    dtype = dtype_of(p.meta)
    lead = kept_lead(p.start, p.nbytes, p.meta.itemsize)
    skip = lead * p.meta.itemsize
    with cupy.cuda.Device(ordinal):
        flat = cupy.empty((skip + p.nbytes,), dtype=cupy.uint8)
        if p.nbytes:
            flat[skip:].set(np.frombuffer(p.data, dtype=np.uint8))
        return _strided(flat, p.meta._replace(offset=p.meta.offset - (p.start - lead)), dtype)


# ---- without a copy ----
def over(buf: Any, meta: MetaPayload, ordinal: int) -> Any:
    """An array over ``buf``'s memory (no copy), laid out as ``meta`` says; keeps ``buf`` alive
    while it lives."""
    dtype = dtype_of(meta)
    mem = cupy.cuda.UnownedMemory(int(buf.handle), int(buf.size), buf, ordinal)
    with cupy.cuda.Device(ordinal):
        at = cupy.cuda.MemoryPointer(mem, 0)
        flat = cupy.ndarray((int(buf.size),), cupy.uint8, memptr=at)
        return _strided(flat, meta, dtype)


def allocator(arena: Any = None) -> Any:
    """A CuPy allocator (``size -> MemoryPointer``) that puts arrays in arena blocks."""
    from gpu_serde.tensors.sharing import allocate

    def allocate_block(size: int) -> Any:
        ordinal = int(cupy.cuda.runtime.getDevice())
        buf = allocate(ordinal, size, arena)
        mem = cupy.cuda.UnownedMemory(int(buf.handle), int(size), buf, ordinal)
        return cupy.cuda.MemoryPointer(mem, 0)

    return allocate_block


def place_array(x: Any, device: Any) -> Any:
    """``x`` on ``device``: ``"cpu"`` gives a NumPy array, an ordinal a CuPy array there."""
    if device == "cpu":
        return x.get() if isinstance(x, cupy.ndarray) else x  # (a NumPy array is there)
    with cupy.cuda.Device(int(device)):
        return cupy.array(x, copy=True)


def place_value(p: TvalPayload, device: Any) -> Any:
    """A by-value payload's array on ``device`` (``"cpu"``: NumPy; an ordinal: CuPy)."""
    dtype = dtype_of(p.meta)
    if device != "cpu":
        return from_value(p, int(device))
    lead = kept_lead(p.start, p.nbytes, p.meta.itemsize)
    skip = lead * p.meta.itemsize
    flat = np.empty((skip + p.nbytes,), dtype=np.uint8)
    flat[skip:] = np.frombuffer(p.data, dtype=np.uint8)
    typed = flat.view(dtype)
    strides = tuple(s * p.meta.itemsize for s in p.meta.strides)
    offset = p.meta.offset - (p.start - lead)
    base = typed[offset:] if typed.size else typed
    return np.lib.stride_tricks.as_strided(base, p.meta.shape, strides)
