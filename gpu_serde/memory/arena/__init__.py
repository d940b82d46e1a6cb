"""``ArenaMemoryResource``: one region of device memory, exported once, sub-allocated, mapped once
per receiving process; its buffers hand off as an offset. The exporter's side is
:mod:`~gpu_serde.memory.arena.exporter`, the receiver's :mod:`~gpu_serde.memory.arena.importer`,
the free-block bookkeeping :mod:`~gpu_serde.memory.arena.ranges`."""

from gpu_serde.memory.arena.exporter import ArenaMemoryResource

__all__ = ["ArenaMemoryResource"]
