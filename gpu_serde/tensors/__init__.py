"""torch tensors and CuPy arrays by GPU UUID (docs/tensors.md).

Importing gpu_serde imports neither torch nor CuPy: :func:`watch` (run with gpu_serde's dispatch
table, :data:`gpu_serde.dispatch.LAZY_TYPES`) registers their reducers when the user imports them
(:mod:`~gpu_serde.tensors.lazy`), as distributed's ``protocol/`` registers its per-library
serializers lazily. Then, while gpu_serde
is installed:

- a CUDA ``torch.Tensor`` or ``nn.Parameter``, or a ``cupy.ndarray``, pickled by pickle,
  cloudpickle, Ray or Dask travels by value with its GPU's UUID, and arrives on the same physical
  GPU (a placeholder that raises ``DeviceNotVisibleError`` where that GPU is not visible);
- through ``torch.multiprocessing``, a CUDA tensor travels as torch's own CUDA IPC handle with
  the device by UUID;
- :func:`share` makes one travel without a copy to processes of the same host.

Public names::

    share(x) -> Shared                     (also gpu_serde.share) no copy on one host
    empty(shape, dtype=None, device=None, *, arena=None)    a torch tensor in gpu_serde memory
    to_arena(model, arena=None)            a model's parameters and buffers moved there, once
    cupy_allocator(arena=None)             CuPy arrays allocated there (cupy.cuda.using_allocator)
    place(x, device)                       what arrived by value, on the device you name
    Shared, SharedCopyWarning

The modules: :mod:`~gpu_serde.tensors.sharing` (``share``, its reduce and rebuild),
:mod:`~gpu_serde.tensors.values` (the torch-free halves of the by-value and
``torch.multiprocessing`` rebuilds), :mod:`~gpu_serde.tensors.torch` and
:mod:`~gpu_serde.tensors.cupy` (each library's reducers and its half of every rebuild, imported
only once the library is), :mod:`~gpu_serde.tensors.common`, :mod:`~gpu_serde.tensors.lazy`.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

from gpu_serde import registry
from gpu_serde.errors import DeviceNotVisibleError
from gpu_serde.listing import lister
from gpu_serde.memory.arena import ArenaMemoryResource
from gpu_serde.tensors.lazy import when_imported
from gpu_serde.tensors.sharing import (
    Shared,
    SharedCopyWarning,
    allocate,
    check_arena,
    module,
    share,
)
from gpu_serde.tensors.values import place
from gpu_serde.text import quoted, safe

__dir__ = lister(globals())  # dir() leaves out the imports above

__all__ = [
    "Shared",
    "SharedCopyWarning",
    "cupy_allocator",
    "empty",
    "place",
    "share",
    "to_arena",
]


_watching = False


def watch(types: dict[str, tuple[str, str, str]]) -> None:
    """Register each type of ``types`` (``"library.Type"`` -> (reducers' module, reducer,
    ``multiprocessing`` reducer): :data:`gpu_serde.dispatch.LAZY_TYPES`) with gpu_serde's table
    once its library is imported (now, for one imported already). Idempotent; imports nothing.
    """
    global _watching
    if _watching:
        return
    _watching = True
    libraries: dict[str, list[tuple[str, tuple[str, str, str]]]] = {}
    for name, how in types.items():
        libraries.setdefault(name.partition(".")[0], []).append((name, how))
    for library, entries in libraries.items():
        when_imported(library, functools.partial(_register, entries))


def _register(entries: list[tuple[str, tuple[str, str, str]]], library: ModuleType) -> None:
    """Register the reducers of ``entries`` for their types (``library`` is imported)."""
    for name, (where, reducer, mp) in entries:
        cls: Any = library
        for part in name.split(".")[1:]:
            cls = getattr(cls, part)
        reducers = importlib.import_module(where)
        registry.register(cls, getattr(reducers, reducer), mp=getattr(reducers, mp))


def _ordinal(device: Any) -> int:
    """This process's ordinal of ``device`` for gpu_serde memory: what it names is checked
    first, then that torch here has a GPU.

    Raises:
        TypeError, ValueError: ``device`` names no device, or not a GPU.
        DeviceNotVisibleError: torch here has no GPU.
    """
    import torch

    named: Any = None
    if isinstance(device, bool):
        raise TypeError("device must be a torch.device, a device string, an ordinal or a Device")
    if device is not None and not isinstance(device, int) and not hasattr(device, "device_id"):
        try:
            named = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as exc:
            raise ValueError(f"{quoted(device)} names no torch device ({safe(str(exc))})") from None
        if named.type != "cuda":
            raise ValueError(f"gpu_serde memory is GPU memory, not {named.type}")
    if isinstance(device, int) and device < 0:
        raise ValueError(f"a GPU's ordinal is 0 or more, not {device}")
    if not torch.cuda.is_available():
        raise DeviceNotVisibleError(
            "gpu_serde memory is GPU memory, and torch here has no GPU (torch.cuda.is_available() "
            "is False: a CPU-only torch build, or no GPU visible to this process; simulated GPUs "
            "run no torch CUDA either, docs/testing.md). Run this on a GPU worker"
        )
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    if named is None:  # a cuda.core Device
        return int(device.device_id)
    return int(torch.cuda.current_device() if named.index is None else named.index)


def empty(
    shape: Any, dtype: Any = None, device: Any = None, *, arena: ArenaMemoryResource | None = None
) -> Any:
    """A new contiguous torch tensor (uninitialised, like ``torch.empty``) in gpu_serde memory:
    :func:`share` sends it without a copy, however often.

    Args:
        shape: its shape (a tuple, a ``torch.Size``, or an int for one dimension).
        dtype: a ``torch.dtype`` (default: torch's default dtype).
        device: the GPU (a ``torch.device``, ``"cuda:1"``, an ordinal or a cuda.core
            ``Device``; default: torch's current device).
        arena: the :class:`~gpu_serde.ArenaMemoryResource` to allocate from (it must be on that
            GPU); default: arenas gpu_serde makes for sharing (1 GiB each, or the tensor's size
            if larger; ``GPU_SERDE_SHARE_ARENA_MIB`` sets it).

    Raises:
        ArenaFullError: ``arena`` has no free block that large.
        TypeError: ``shape`` or ``dtype`` is not one (torch's own error), or ``arena`` is not
            an ArenaMemoryResource.
        ValueError: ``device`` is not a GPU, or ``arena`` is on another GPU.
        DeviceNotVisibleError: torch here has no GPU (a CPU-only build, or none visible).
    """
    m = module("torch", "gpu_serde.tensors.empty()")
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)  # as torch.empty(4)
    nbytes = m.nbytes_of(shape, dtype)  # a shape or dtype that is none: torch's TypeError first
    if arena is not None:
        check_arena(arena)  # before asking torch for a GPU, as the other arguments
    ordinal = _ordinal(device)
    buf = allocate(ordinal, nbytes, arena)
    return m.empty(shape, dtype, buf, ordinal)


def to_arena(model: Any, arena: ArenaMemoryResource | None = None) -> Any:
    """Move a torch module's CUDA parameters and buffers (or one CUDA tensor) into gpu_serde
    memory: one device-to-device copy each, now; afterwards :func:`share` sends them without a
    copy, step after step (the weight-sync recipe in docs/tensors.md). Parameters stay the same
    ``nn.Parameter`` objects (their ``.data`` moves), so optimizers keep working.

    Returns:
        ``model`` (for a module), or the new tensor (for a tensor).

    Raises:
        ArenaFullError: ``arena`` has no room for them.
        TypeError: ``model`` is neither a ``torch.nn.Module`` nor a ``torch.Tensor``, or
            ``arena`` is not an ArenaMemoryResource made in this process.
        ValueError: it holds tensors, and none on a GPU (move it to its GPU first:
            ``model.cuda()``); a module's tensors on the CPU stay there, and a module with no
            tensor comes back as it was.
    """
    import torch

    if arena is not None:
        check_arena(arena)  # before anything moves (a module with no tensor too)

    def moved(t: Any) -> Any:
        new = empty(t.shape, t.dtype, t.device, arena=arena)
        new.copy_(t.detach())
        return new

    def none_on_a_gpu(what: str) -> ValueError:
        return ValueError(
            f"gpu_serde.tensors.to_arena: {what} holds no CUDA tensor, and only CUDA tensors go "
            "to gpu_serde memory: move it to its GPU first (.cuda() or .to('cuda:N'))"
        )

    if isinstance(model, torch.Tensor):
        if not model.is_cuda:
            raise none_on_a_gpu(f"this tensor (on {model.device})")
        return moved(model)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "gpu_serde.tensors.to_arena takes a torch.nn.Module or a torch.Tensor, not "
            f"{type(model).__name__}"
        )
    tensors = [*model.parameters(), *model.buffers()]
    if tensors and not any(t.is_cuda for t in tensors):
        raise none_on_a_gpu(f"this {type(model).__name__}")
    with torch.no_grad():
        for p in model.parameters():
            if p.is_cuda:
                p.data = moved(p.data)
        for owner in model.modules():
            for name, b in list(owner.named_buffers(recurse=False)):
                if b is not None and b.is_cuda:
                    setattr(owner, name, moved(b))
    return model


def cupy_allocator(arena: ArenaMemoryResource | None = None) -> Any:
    """A CuPy allocator that puts new arrays in gpu_serde memory, for
    ``cupy.cuda.using_allocator(gpu_serde.tensors.cupy_allocator())`` (one block) or
    ``cupy.cuda.set_allocator(...)``: :func:`share` then sends those arrays without a copy.

    Args:
        arena: the :class:`~gpu_serde.ArenaMemoryResource` to allocate from (on the current
            device); default: arenas gpu_serde makes for sharing.

    Raises:
        HandoffError: CuPy is not installed in this process.
        TypeError: ``arena`` is not an ArenaMemoryResource made in this process.
    """
    m = module("cupy", "gpu_serde.tensors.cupy_allocator()")
    if arena is not None:
        check_arena(arena)
    return m.allocator(arena)
