"""Tensor and array payloads: torch tensors and CuPy arrays, as plain tuples on the wire.

Nothing here imports torch or CuPy: a payload is validated the same way in a process that has
neither (a Dask scheduler, a CPU-only client), and such a process forwards it unchanged. On the
wire each is a plain ``tuple`` (never a nested pickle, never a named tuple); each decodes, once
validated, into the named tuple below. The fields, in wire order::

    meta   (library ("torch" | "cupy"), kind ("Tensor" | "Parameter" | "ndarray"), dtype name,
            itemsize, shape, strides (in elements), offset (in elements), requires_grad)
           what a tensor looks like over its storage (torch) or allocation (CuPy): element
           [0, ..., 0] is ``offset`` elements from its start, every element lies inside it
    tval   (1, device payload, meta, start, nbytes, bytes)   by value (gpu_serde.wire.tval): the
           bytes of the elements from the first the tensor touches (``start``) to the last; the
           receiver's storage reaches to the last, so that the offset is kept
    tshr   (1, meta, abuf payload)                          shared without a copy: an arena block
                                                            (gpu_serde.wire.tshr)
    tipc   (1, device payload, boot_id, meta, IPC handle | None, storage bytes, storage offset
            in bytes, ref-counter handle, ref-counter offset, event handle | None, event sync
            required)                                       torch.multiprocessing's own CUDA IPC,
                                                            the device by UUID (gpu_serde.wire.tipc)

The dtype is torch's name without ``torch.`` (``"bfloat16"``) or NumPy's type string (``"<f4"``);
the receiver checks it against its library and the itemsize. ``tval``'s bytes are any contiguous
bytes-like object of ``nbytes`` (a pickle-5 out-of-band buffer arrives as one). Each kind is one
named tuple whose ``wire()`` is the encoder, followed by its ``decode_*``; every decoder raises
:class:`~gpu_serde.PayloadError` for anything else.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from gpu_serde.format.device import VERSION, fail, fields, validate_device
from gpu_serde.format.memory import MAX_SIZE, AbufPayload, decode_abuf

LIBRARIES = {"torch": ("Tensor", "Parameter"), "cupy": ("ndarray",)}
MAX_DIMS = 64  #: the most dimensions a payload's shape has (NumPy's limit)
MAX_ITEMSIZE = 64
DTYPE_MAX = 32  #: the longest dtype name
HANDLE_MAX = 4096  #: the longest IPC or ref-counter handle torch hands out
IPC_EVENT_BYTES = 64


def _int(value: object) -> bool:
    return type(value) is int and -MAX_SIZE < value < MAX_SIZE


def _dtype_name(value: object) -> bool:
    return (
        type(value) is str
        and 0 < len(value) <= DTYPE_MAX
        and value.isascii()
        and value.isprintable()
        and " " not in value
    )


class MetaPayload(NamedTuple):
    """How a tensor or array lies over the memory it is carried in."""

    library: str
    kind: str
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    requires_grad: bool

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return tuple(self)

    @property
    def numel(self) -> int:
        """The number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    def span(self) -> tuple[int, int]:
        """The lowest and one past the highest element index it touches (``(offset, offset)``
        for no element)."""
        if self.numel == 0:
            return self.offset, self.offset
        low = high = self.offset
        for n, s in zip(self.shape, self.strides, strict=True):
            reach = s * (n - 1)
            if reach < 0:
                low += reach
            else:
                high += reach
        return low, high + 1


def decode_meta(p: object, nbytes: int, payload: object = None, start: int = 0) -> MetaPayload:
    """Validate a meta tuple whose elements lie inside ``nbytes`` bytes of memory that begin at
    element ``start``.

    Raises:
        PayloadError: malformed, or an element outside the memory.
    """
    whole = p if payload is None else payload
    if type(p) is not tuple or len(p) != 8:
        raise fail("a tensor's meta is a tuple of 8 fields", whole)
    library, kind, dtype, itemsize, shape, strides, offset, grad = p
    if library not in LIBRARIES or type(library) is not str:
        raise fail(f"the library must be one of {tuple(LIBRARIES)}", whole)
    if type(kind) is not str or kind not in LIBRARIES[library]:
        raise fail(f"a {library} payload's kind must be one of {LIBRARIES[library]}", whole)
    if not _dtype_name(dtype):
        raise fail(f"the dtype must be a name of at most {DTYPE_MAX} printable characters", whole)
    if type(itemsize) is not int or not 0 < itemsize <= MAX_ITEMSIZE:
        raise fail(f"the itemsize must be an int from 1 to {MAX_ITEMSIZE}", whole)
    if (
        type(shape) is not tuple
        or type(strides) is not tuple
        or len(shape) > MAX_DIMS
        or len(shape) != len(strides)
        or not all(_int(d) and d >= 0 for d in shape)
        or not all(_int(s) for s in strides)
    ):
        raise fail(
            f"the shape and strides must be tuples of ints of the same length (at most "
            f"{MAX_DIMS}), the shape's >= 0",
            whole,
        )
    if not _int(offset) or offset < 0 or type(grad) is not bool:
        raise fail("the offset must be an int >= 0 and requires_grad a bool", whole)
    meta = MetaPayload(library, kind, dtype, itemsize, shape, strides, offset, grad)
    low, high = meta.span()
    if low < start or (high - start) * itemsize > nbytes:
        raise fail("the tensor does not lie inside the memory it is carried in", whole)
    return meta


class TvalPayload(NamedTuple):
    """A tensor or array by value: its GPU, how it lies over its storage, and the bytes of the
    elements from index ``start`` on that it touches."""

    version: int
    device: bytes
    meta: MetaPayload
    start: int
    nbytes: int
    data: Any

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.device, self.meta.wire(), self.start, self.nbytes, self.data)


class TshrPayload(NamedTuple):
    """A tensor or array shared without a copy: how it lies over an arena block, and the
    block (a hold on it at its exporter)."""

    version: int
    meta: MetaPayload
    block: AbufPayload

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.meta.wire(), self.block.wire())


class TipcPayload(NamedTuple):
    """A torch CUDA tensor through ``torch.multiprocessing``: torch's own CUDA IPC arguments
    (``torch.multiprocessing.reductions.rebuild_cuda_tensor``'s), the device by UUID."""

    version: int
    device: bytes
    boot: bytes
    meta: MetaPayload
    handle: bytes | None
    storage_bytes: int
    storage_offset: int
    counter: bytes
    counter_offset: int
    event: bytes | None
    event_sync: bool

    def wire(self) -> tuple[Any, ...]:
        """The plain tuple that travels."""
        return (self.version, self.device, self.boot, self.meta.wire(), *self[4:])


def decode_tval(p: object) -> TvalPayload:
    """Validate a by-value tensor payload (what :func:`gpu_serde.wire.tval` carries).

    Raises:
        PayloadError: anything but a well-formed payload of this version, or bytes that are not
            a contiguous buffer of the stated size.
    """
    _, dev, meta, start, nbytes, data = fields("tensor by value", p, 6)
    validate_device(dev)
    if type(nbytes) is not int or not 0 <= nbytes < MAX_SIZE:
        raise fail("the size must be an int >= 0", p)
    if type(start) is not int or not 0 <= start < MAX_SIZE:
        raise fail("the first element's index must be an int >= 0", p)
    m = decode_meta(meta, nbytes, p, start)
    if nbytes % m.itemsize:
        raise fail("the size must be a whole number of elements", p)
    try:
        with memoryview(data) as view:
            ok = view.c_contiguous and view.nbytes == nbytes
    except Exception:
        ok = False
    if not ok:
        raise fail(f"the data must be a contiguous bytes-like object of {nbytes} bytes", p)
    return TvalPayload(VERSION, dev, m, start, nbytes, data)


def decode_tshr(p: object) -> TshrPayload:
    """Validate a shared tensor payload (what :func:`gpu_serde.wire.tshr` carries).

    Raises:
        PayloadError: anything else, or a tensor that does not lie inside its block.
    """
    _, meta, block = fields("shared tensor", p, 3)
    b = decode_abuf(block)
    return TshrPayload(VERSION, decode_meta(meta, b.size, p), b)


def decode_tipc(p: object) -> TipcPayload:
    """Validate a ``torch.multiprocessing`` CUDA IPC payload (:func:`gpu_serde.wire.tipc`).

    Raises:
        PayloadError: anything else, or a tensor that does not lie inside its storage.
    """
    (_, dev, boot, meta, handle, size, offset, counter, counter_offset, event, sync) = fields(
        "torch CUDA IPC", p, 11
    )
    validate_device(dev)
    if type(boot) is not bytes or len(boot) != 16:
        raise fail("the host's boot id must be 16 bytes", p)
    if handle is not None and (type(handle) is not bytes or not 0 < len(handle) <= HANDLE_MAX):
        raise fail(f"the IPC handle must be bytes (at most {HANDLE_MAX}) or None", p)
    if type(size) is not int or type(offset) is not int or not 0 <= size < MAX_SIZE:
        raise fail("the storage size must be an int >= 0", p)
    if not 0 <= offset < MAX_SIZE:
        raise fail("the storage offset must be an int >= 0", p)
    if type(counter) is not bytes or len(counter) > HANDLE_MAX or not _int(counter_offset):
        raise fail("the ref counter must be bytes and an int offset", p)
    if event is not None and (type(event) is not bytes or len(event) != IPC_EVENT_BYTES):
        raise fail(f"the event handle must be {IPC_EVENT_BYTES} bytes or None", p)
    if type(sync) is not bool:
        raise fail("event_sync_required must be a bool", p)
    m = decode_meta(meta, size, p)
    if m.library != "torch":
        raise fail("a torch CUDA IPC payload carries a torch tensor", p)
    return TipcPayload(
        VERSION, dev, boot, m, handle, size, offset, counter, counter_offset, event, sync
    )
