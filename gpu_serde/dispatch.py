"""The one table of what gpu_serde handles: type -> reducer -> wire name -> rebuild.

Read it top to bottom. :data:`TYPES` names each cuda.core type and the reducer that pickles it by
GPU UUID while gpu_serde is installed (:func:`gpu_serde.install` registers them with ``copyreg``
and ``multiprocessing``). :data:`KINDS` names each wire name a pickle can carry
(:mod:`gpu_serde.wire`), the rebuild its reconstructor runs under the one guard of
:mod:`gpu_serde.placeholders`, and what the payload is called in messages. Each reducer sits beside
its rebuild in its type module; importing this module fills both tables. :data:`LAZY_TYPES` names
the torch and CuPy types, registered once the user imports those libraries.
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

from gpu_serde import device, registry, tensors, wire
from gpu_serde.errors import DeviceNotVisibleError, HandoffError, PayloadError
from gpu_serde.memory import buffers, bycopy, pools, portable, unsent, vmm
from gpu_serde.memory.arena import exporter as arena
from gpu_serde.memory.arena import importer as arena_importer
from gpu_serde.placeholders import Kind, define
from gpu_serde.tensors import sharing as shared
from gpu_serde.tensors import values

#: type -> the reducer that pickles it while gpu_serde is installed (a ``Buffer`` by the kind of
#: its memory resource: :data:`gpu_serde.memory.buffers.BY_RESOURCE`)
TYPES: dict[type, registry.Reducer] = {
    Device: device.reduce_device,
    DeviceMemoryResource: pools.reduce_pool,
    PinnedMemoryResource: pools.reduce_pool,
    VirtualMemoryResourceOptions: vmm.reduce_options,
    VirtualMemoryResource: vmm.reduce_resource,
    arena.ArenaMemoryResource: arena.reduce_arena,
    Buffer: buffers.reduce_buffer,
}

#: wire name -> how it rebuilds (its body, its name in messages, the error an unexpected failure
#: becomes)
KINDS: dict[Any, Kind] = {
    wire.dev: Kind("Device", device.rebuild_device, DeviceNotVisibleError),
    wire.pool: Kind("memory pool", pools.rebuild_pool, HandoffError, pools.pool_kind),
    wire.buf: Kind("Buffer", pools.rebuild_buffer),
    wire.vmo: Kind("VirtualMemoryResourceOptions", vmm.rebuild_options, PayloadError),
    wire.vmm: Kind("VirtualMemoryResource", vmm.rebuild_resource),
    wire.vbuf: Kind("Buffer", vmm.rebuild_buffer),
    wire.arena: Kind("ArenaMemoryResource", arena_importer.rebuild_arena),
    wire.abuf: Kind("Buffer", arena_importer.rebuild_buffer),
    wire.hbuf: Kind("Buffer (a host copy)", bycopy.rebuild_host_copy),
    wire.pbuf: Kind(
        "portable Buffer", portable.rebuild_portable, HandoffError, portable.portable_kind
    ),
    wire.unsent: Kind("unsent object", unsent.rebuild_unsent),
    wire.tval: Kind("tensor", values.rebuild_value, HandoffError, values.value_kind),
    wire.tshr: Kind("shared tensor", shared.rebuild_shared, HandoffError, shared.shared_kind),
    wire.tipc: Kind("torch.Tensor (torch.multiprocessing)", values.rebuild_ipc),
}

#: types of libraries gpu_serde never imports -> (the module of their reducers, the reducer, the
#: one in ``multiprocessing``'s table): registered like :data:`TYPES` once the user imports the
#: library (:func:`gpu_serde.tensors.watch`)
LAZY_TYPES: dict[str, tuple[str, str, str]] = {
    "torch.Tensor": ("gpu_serde.tensors.torch", "reduce_tensor", "reduce_tensor_mp"),
    "torch.nn.Parameter": ("gpu_serde.tensors.torch", "reduce_tensor", "reduce_tensor_mp"),
    "cupy.ndarray": ("gpu_serde.tensors.cupy", "reduce_array", "reduce_array"),
}

for _cls, _reducer in TYPES.items():
    registry.register(_cls, _reducer)
for _name, _kind in KINDS.items():
    define(_name, _kind)
tensors.watch(LAZY_TYPES)
