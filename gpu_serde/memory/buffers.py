"""A ``Buffer`` without a copy, by the kind of its memory resource, both ways.

:data:`BY_RESOURCE` says which memory kind sends a buffer (its reducer and wire name), and
:data:`ZERO_COPY` which rebuild a zero-copy kind's payload goes through: what a portable buffer, the
Dask serializer and the Ray transport use to send and receive the zero-copy part of a buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuda.core import Buffer, DeviceMemoryResource, PinnedMemoryResource, VirtualMemoryResource

from gpu_serde import wire
from gpu_serde.errors import HandoffError, NotIPCEnabledError
from gpu_serde.memory import lifetime, pools, unsent, vmm
from gpu_serde.memory.arena import exporter as arena
from gpu_serde.memory.arena import importer as arena_importer

#: memory resource kind -> (reducer body, zero-copy kind); the first that matches sends it
BY_RESOURCE: dict[type, tuple[Callable[[Buffer, Any], tuple[Any, ...]], str]] = {
    DeviceMemoryResource: (pools.reduce_buffer, "buf"),
    PinnedMemoryResource: (pools.reduce_buffer, "buf"),
    VirtualMemoryResource: (vmm.reduce_buffer, "vbuf"),
    arena.ArenaMemoryResource: (arena.reduce_buffer, "abuf"),
}

#: zero-copy kind -> (its wire name, its rebuild body)
ZERO_COPY: dict[str, tuple[Callable[..., Any], Callable[[object], Buffer]]] = {
    "buf": (wire.buf, pools.rebuild_buffer),
    "vbuf": (wire.vbuf, vmm.rebuild_buffer),
    "abuf": (wire.abuf, arena_importer.rebuild_buffer),
}


def reduction(buf: Buffer) -> tuple[Any, ...]:
    """``(wire name, (payload,))`` of ``buf`` without a copy; a received buffer travels on as it
    came.

    Raises:
        NotIPCEnabledError: its memory resource cannot cross processes without a copy.
        HandoffError: it is closed and no longer held for importers, the driver refused to
            export it, or this process was forked from the one whose memory it is.
    """
    origin = lifetime.forwarded(buf)
    if origin is not None:
        if not buf.handle:  # a received one would forward a hold its exporter may have let go
            raise HandoffError(
                "this Buffer was received from another process and closed here: send it before "
                "you close it (under Dask, a task that closes its argument closes the object the "
                "worker stores for that key, if it lives there: leave closing to Dask, which "
                "drops it when the key is released)"
            )
        return origin
    lifetime.not_forked("Buffer")  # its memory, and the broker that would hold it, are the parent's
    if not buf.handle:  # closed: cuda.core no longer says its memory resource
        return lifetime.sent_closed(buf)
    mr = buf.memory_resource
    for kind, (reducer, _) in BY_RESOURCE.items():
        if isinstance(mr, kind):
            return reducer(buf, mr)
    raise NotIPCEnabledError(
        f"this Buffer (from a {type(mr).__name__}) cannot be sent to another process without a "
        "copy: only buffers allocated "
        "from an IPC-enabled DeviceMemoryResource or PinnedMemoryResource (or a "
        "VirtualMemoryResource, or a gpu_serde.ArenaMemoryResource) can"
    )


def reduce_buffer(buf: Buffer) -> tuple[Any, ...]:
    """Reducer for ``Buffer`` while gpu_serde is installed: :func:`reduction`, and never raises.
    A buffer that cannot be sent travels as its typed error (:mod:`gpu_serde.memory.unsent`),
    which the receiver raises when it uses it: a sender's pickler that raises can cost a Dask
    cluster its workers (the scheduler re-pickles task arguments) or lose a
    ``multiprocessing.Queue`` item in its feeder thread."""
    try:
        return reduction(buf)
    except Exception as exc:
        return unsent.unsent("Buffer", exc)


def zero_copy(buf: Buffer) -> tuple[str, tuple[Any, ...]]:
    """``(zero-copy kind, payload)`` of ``buf``, as a portable buffer or the Ray transport
    carries it.

    Raises:
        NotIPCEnabledError, HandoffError: as :func:`reduction`.
    """
    fn, (payload,) = reduction(buf)
    for kind, (name, _) in ZERO_COPY.items():
        if fn is name:
            return kind, payload
    raise NotIPCEnabledError(
        f"this Buffer (from a {type(buf.memory_resource).__name__}) travels as {fn.__name__}, "
        "which is not zero copy"
    )


def rebuild_zero_copy(kind: str, payload: object) -> Buffer:
    """The buffer a ``(kind, payload)`` from :func:`zero_copy` names, mapped here; unguarded:
    raises the typed error instead of giving a placeholder.

    Raises:
        KeyError: ``kind`` is not a zero-copy kind (a decoder checked it).
        PayloadError, HandoffError, DeviceNotVisibleError: as the kind's rebuild.
    """
    return ZERO_COPY[kind][1](payload)
