"""The one table of the cuda.core types gpu_serde handles, and the reducer of each.

Read it top to bottom: each line names a type and the function that pickles it by GPU UUID while
gpu_serde is installed (:func:`gpu_serde.install`). Each reducer sits beside its rebuild in its
type module; those modules define their rebuilds for :mod:`gpu_serde.wire` when imported here.
"""

from __future__ import annotations

from typing import Any

from cuda.core import (
    Buffer,
    Device,
    DeviceMemoryResource,
    PinnedMemoryResource,
    VirtualMemoryResource,
    VirtualMemoryResourceOptions,
)

from gpu_serde import arena, device, handoff, pools, registry, vmm
from gpu_serde.errors import HandoffError, NotIPCEnabledError

#: A ``Buffer`` travels by the kind of its memory resource.
BUFFERS = {
    DeviceMemoryResource: pools.reduce_buffer,
    PinnedMemoryResource: pools.reduce_buffer,
    VirtualMemoryResource: vmm.reduce_buffer,
    arena.ArenaMemoryResource: arena.reduce_buffer,
}


def reduce_buffer(buf: Buffer) -> tuple[Any, ...]:
    """Reducer for ``Buffer``: by its memory resource (:data:`BUFFERS`); a received buffer
    travels on as it came.

    Raises:
        HandoffError: the buffer is closed.
        NotIPCEnabledError: its memory resource cannot cross processes (see :data:`BUFFERS`).
    """
    if not buf.handle:  # a received one would forward a token its exporter may have let go
        raise HandoffError(
            "this Buffer is closed: a closed buffer cannot be sent; send it before you close it"
        )
    origin = handoff.forwarded(buf)
    if origin is not None:
        return origin
    mr = buf.memory_resource
    for kind, reducer in BUFFERS.items():
        if isinstance(mr, kind):
            return reducer(buf, mr)
    raise NotIPCEnabledError(
        f"{buf!r} cannot be sent to another process without a copy: only buffers allocated "
        "from an IPC-enabled DeviceMemoryResource or PinnedMemoryResource (or a "
        "VirtualMemoryResource, or a gpu_serde.ArenaMemoryResource) can"
    )


registry.register(Device, device.reduce_device)
registry.register(DeviceMemoryResource, pools.reduce_pool)
registry.register(PinnedMemoryResource, pools.reduce_pool)
registry.register(Buffer, reduce_buffer)
registry.register(VirtualMemoryResource, vmm.reduce_resource)
registry.register(VirtualMemoryResourceOptions, vmm.reduce_options)
registry.register(arena.ArenaMemoryResource, arena.reduce_arena)
