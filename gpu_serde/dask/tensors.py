"""Dask: CUDA torch tensors and CuPy arrays as task results and scattered data, by GPU UUID.

distributed serializes data (a result another worker fetches, scattered data, a result the
client gathers) with its ``dask`` serializer family. Its own entries for torch
(``distributed/protocol/torch.py``) cannot carry a CUDA tensor at all (``t.numpy()`` fails; the
future never settles: dask/distributed#6111, #8001), and the one for CuPy puts the array on the
receiver's current device (by index). gpu_serde registers ``dask`` entries for
``torch.Tensor``, ``torch.nn.Parameter`` and ``cupy.ndarray`` in their place, once the library is
imported (distributed's own registered first, so that they can be kept):

- a CUDA tensor or a CuPy array travels as gpu_serde's reduction (by value with its GPU's UUID:
  ``gpu_serde.wire.tval``; a shared tensor received here travels on as it came), its bytes as
  out-of-band frames; the receiver rebuilds it on the same GPU, or a placeholder that raises
  ``DeviceNotVisibleError`` when used;
- a CPU tensor, and anything gpu_serde does not carry, goes through distributed's own entry,
  unchanged (its header marked so that the receiver hands it back to distributed's own); one
  that distributed's entry cannot serialize (a bfloat16 CPU tensor, which has no NumPy dtype)
  goes by the library's own pickling, where it would otherwise leave its receiver waiting.

Neither the serializer nor the deserializer raises (a serializer that raises leaves the receiver
waiting for ever; a deserializer that raises loses the worker): what cannot be sent travels as its
error, what cannot be rebuilt is a placeholder. Task arguments are pickled, not serialized here:
gpu_serde's ``copyreg`` reducers carry them (:mod:`gpu_serde.tensors`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from distributed.protocol.serialize import dask_deserialize, dask_serialize

from gpu_serde import wire
from gpu_serde.dask.serializers import FORMAT, from_frames, to_frames
from gpu_serde.memory import unsent
from gpu_serde.tensors.lazy import when_imported

logger = logging.getLogger("gpu_serde.dask")
OWN = "gpu_serde-tensor"  #: the header key that marks gpu_serde's own frames
THEIRS = "gpu_serde-theirs"  #: the header key that names the type distributed's entry serialized

#: type -> (distributed's serializer, its deserializer, gpu_serde's reducer, its carry test)
_entries: dict[type, tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Any]] = {}
_names: dict[str, type] = {}  # "module.qualname" -> type, for THEIRS


def serialize_tensor(x: Any) -> tuple[dict[str, Any], list[Any]]:
    """distributed ``dask`` serializer for torch tensors, parameters and CuPy arrays (see the
    module). Never raises for an object gpu_serde carries."""
    theirs, _, reduce, carries = _entries[type(x)]
    if not carries(x):
        try:
            header, frames = theirs(x)
        except Exception:  # distributed cannot (a bfloat16 CPU tensor: no NumPy dtype for it):
            return {OWN: FORMAT}, to_frames(x.__reduce_ex__(5))  # the library's own pickling can
        return {**header, THEIRS: _name(type(x))}, frames
    try:
        reduction = reduce(x)
    except Exception as exc:  # raising here would leave the receiver waiting for ever
        reduction = unsent.unsent(type(x).__name__, exc)
    return {OWN: FORMAT}, to_frames(reduction)


def deserialize_tensor(header: Any, frames: list[Any]) -> Any:
    """distributed ``dask`` deserializer for what :func:`serialize_tensor` sent: gpu_serde's
    frames rebuilt (a placeholder where they cannot be), distributed's handed to its own."""
    if isinstance(header, dict) and THEIRS in header and OWN not in header:
        cls = _names.get(str(header[THEIRS]))
        if cls is not None:
            return _entries[cls][1](header, frames)  # distributed's own, as it sent it
    return from_frames(header, frames, OWN, "tensor", wire.tval)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _register(cls: type, reduce: Callable[..., Any], carries: Any) -> None:
    if cls in _entries:  # registered already: distributed's own are kept from the first time
        return
    _entries[cls] = (dask_serialize.dispatch(cls), dask_deserialize.dispatch(cls), reduce, carries)
    _names[_name(cls)] = cls
    dask_serialize.register(cls)(serialize_tensor)
    dask_deserialize.register(cls)(deserialize_tensor)


def _torch_imported(torch: ModuleType) -> None:
    import distributed.protocol.torch  # noqa: F401  (distributed's own entries, kept for CPU)

    from gpu_serde.tensors import torch as reducers

    for cls in (torch.Tensor, torch.nn.Parameter):
        _register(cls, reducers.reduce_tensor, reducers.carried)


def _cupy_imported(cupy: ModuleType) -> None:
    import distributed.protocol.cupy  # noqa: F401  (distributed's own entries)

    from gpu_serde.tensors import cupy as reducers

    _register(cupy.ndarray, reducers.reduce_array, reducers.is_cuda)


_watching = False


def register() -> None:
    """Put gpu_serde's ``dask`` entries for torch and CuPy in place once each is imported (now,
    for one imported already). Idempotent; imports neither."""
    global _watching
    if not _watching:
        _watching = True
        when_imported("torch", _torch_imported)
        when_imported("cupy", _cupy_imported)
