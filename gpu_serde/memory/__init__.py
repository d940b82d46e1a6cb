"""GPU memory across processes.

- :mod:`~gpu_serde.memory.lifetime`: the one protocol every memory kind uses (the exporter's
  holds, the importer's acquire, hold, release on failure and tracking, the release thread);
- :mod:`~gpu_serde.memory.driver`: the driver calls (contexts, VMM mappings, events);
- :mod:`~gpu_serde.memory.broker`: descriptors and holds between processes of one host;
- one module per memory kind, reduce and rebuild side by side: :mod:`~gpu_serde.memory.pools`
  (IPC-enabled pools), :mod:`~gpu_serde.memory.vmm` (``VirtualMemoryResource``),
  :mod:`~gpu_serde.memory.arena` (``ArenaMemoryResource``), :mod:`~gpu_serde.memory.bycopy`
  (a host copy, beyond the host), :mod:`~gpu_serde.memory.portable` (both),
  :mod:`~gpu_serde.memory.unsent` (what a sender could not send);
- :mod:`~gpu_serde.memory.buffers`: a ``Buffer`` by the kind of its memory resource;
- :mod:`~gpu_serde.memory.background`: the daemon threads a process starts on first use.
"""
