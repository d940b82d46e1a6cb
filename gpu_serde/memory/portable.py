"""Portable buffers: a ``Buffer`` that reaches any host (``gpu_serde.wire.pbuf``), reduce and
rebuild side by side.

A portable payload carries the buffer's zero-copy payload (pool, VMM or arena buffer) and a host
copy (:mod:`gpu_serde.memory.bycopy`). The receiver maps the memory on the exporter's host, and
uploads the copy elsewhere, and wherever the zero-copy part cannot be used (the exporter is gone,
the GPU is not visible, the part is malformed). :func:`portable` makes one; Ray (tasks, actors,
``ray.put``) and Dask carry it as they carry any pickle, the copy in their own bulk path (pickle
protocol 5 out-of-band buffers: Ray's object store, Dask's frames).
"""

from __future__ import annotations

import contextlib
from typing import Any

from cuda.core import Buffer, MemoryResource, Stream

from gpu_serde import wire
from gpu_serde.format.device import VERSION, decode_device
from gpu_serde.format.memory import PortablePayload, decode_pbuf
from gpu_serde.memory import buffers, lifetime, unsent
from gpu_serde.memory.bycopy import data, host_payload, to_host, upload
from gpu_serde.text import quoted


class PortableBuffer:
    """A ``Buffer`` wrapped to travel anywhere: made by :func:`portable`.

    Pickled, it carries the zero-copy payload (when the buffer's memory can be shared) and a copy
    of the bytes, taken at pickling, after the work queued on the buffer's device. The receiver
    gets a ``Buffer``: the exporter's memory, mapped, on the exporter's host; a new buffer with the
    copy on a GPU of its own elsewhere (the same GPU if it sees it), also where mapping fails.
    In the sending process it is only a wrapper: :attr:`buffer` is the buffer.
    """

    __slots__ = ("buffer",)

    def __init__(self, buffer: Buffer) -> None:
        if not isinstance(buffer, Buffer):
            raise TypeError(
                f"gpu_serde.portable() takes a cuda.core Buffer, not {type(buffer).__name__}"
            )
        self.buffer = buffer  #: the wrapped buffer

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        try:
            return (wire.pbuf, (portable_payload(self.buffer, int(protocol)),))
        except Exception as exc:  # no copy (too large for host memory, a closed buffer): a
            return unsent.unsent("Buffer", exc)  # sender never fails; raised where it is used

    def __repr__(self) -> str:
        return f"<PortableBuffer of {self.buffer!r}>"


def portable(buf: Buffer) -> PortableBuffer:
    """Wrap ``buf`` so that it reaches a process on any host: mapped without a copy on the
    exporter's host, as a copy of its bytes elsewhere.

    Use it where the receiver's host is not known when the buffer is pickled: a Ray task argument,
    ``ray.put``, a Dask task argument, a ``multiprocessing`` queue to a process that may be in
    another container. Every pickle of it copies the bytes to host memory (once per pickle), and
    the engine carries the copy in its own bulk path (Ray's object store, Dask's frames). The
    receiver gets a ``Buffer``. Dask sends buffers that are task results or scattered data by
    value to other hosts by itself: they need no wrapper.

    Args:
        buf: a cuda.core ``Buffer`` of device memory (any memory resource) or pinned host memory.

    Returns:
        A :class:`PortableBuffer` (pickle it; it is not a ``Buffer`` in the sending process).

    Pickling it never raises. Where the copy cannot be made (it does not fit in this host's
    available memory: ``HostCopyError``; the buffer is closed: ``HandoffError``), it travels as
    that error, which the receiver raises when it uses it.

    Raises:
        TypeError: ``buf`` is not a ``Buffer``.
    """
    return PortableBuffer(buf)


def portable_payload(buf: Buffer, protocol: int = 5) -> tuple[Any, ...]:
    """The payload of :func:`portable`: ``(1, kind, zero-copy payload, host copy)``; kind and its
    payload are None for memory that cannot be shared without a copy.

    Raises:
        HostCopyError, HandoffError: as :func:`to_host`.
    """
    kind, inner = None, None
    with contextlib.suppress(Exception):  # no zero-copy part (any reason): only the copy travels
        kind, inner = buffers.zero_copy(buf)
    copy = host_payload(buf, data(to_host(buf), protocol))
    return PortablePayload(VERSION, kind, inner, copy).wire()


class Alias(MemoryResource):
    """The memory resource of a portable buffer that came back to its exporter: a second
    ``Buffer`` over the exporter's own buffer (kept alive while the alias lives), which travels
    on as the portable payload it came as. It cannot allocate; freeing it frees nothing."""

    def __init__(self, owner: Buffer) -> None:
        self._owner: Buffer | None = owner
        self.device_id_ = int(owner.device_id)
        self.owner_resource = owner.memory_resource  #: the exporter's memory resource

    def allocate(self, size: int, stream: Stream | None = None) -> Buffer:
        """Refused: allocate from the exporter's own memory resource.

        Raises:
            TypeError: always.
        """
        raise TypeError("an alias of a buffer cannot allocate: allocate from its pool")

    def deallocate(self, ptr: int, size: int, stream: Stream | None = None) -> None:
        """Let go of the exporter's buffer (its memory stays the exporter's)."""
        self._owner = None

    @property
    def device_id(self) -> int:
        return self.device_id_

    @property
    def is_device_accessible(self) -> bool:
        return bool(self.owner_resource.is_device_accessible)

    @property
    def is_host_accessible(self) -> bool:
        return bool(self.owner_resource.is_host_accessible)


def rebuild_portable(payload: object) -> Buffer:
    """Rebuild body of :func:`gpu_serde.wire.pbuf`: mapped when this process can map it, else the
    copy uploaded. Either way the buffer travels on as the same portable payload (a hop that
    passes it on, such as Dask's scheduler, keeps it portable).

    Raises:
        PayloadError: malformed; HandoffError: as :func:`upload`.
    """
    p = decode_pbuf(payload)
    got = None
    if p.kind is not None:
        # another host, the exporter gone, a refused token, a GPU not seen here, a malformed
        # zero-copy part: whatever keeps it from being mapped, the copy is used
        with contextlib.suppress(Exception):
            got = buffers.rebuild_zero_copy(p.kind, p.inner)
        if got is not None and lifetime.forwarded(got) is None:  # the exporter's own buffer
            got = Buffer.from_handle(int(got.handle), int(got.size), mr=Alias(got))
    if got is None:
        got = upload(p.copy)
    lifetime.forward_as(got, (wire.pbuf, (payload,)))
    return got


def portable_kind(payload: object) -> str:
    """What a portable payload is, for messages: its GPU, or pinned host memory."""
    d = decode_pbuf(payload).copy.device
    gpu = decode_device(d).canonical_uuid if d is not None else "pinned host memory"
    return f"portable Buffer ({quoted(gpu)})"
