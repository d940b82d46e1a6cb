"""Ray Direct Transport (RDT) for torch tensors by GPU UUID: actor to actor, outside the object
store, wherever the receiver sees the sender's GPU.

Ray's own ``cuda_ipc`` transport finds the receiver's device through ``ray.get_gpu_ids()``: it
refuses actors on different GPUs of one node (``ValueError``) and breaks under
``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``. gpu_serde's, named :data:`TENSOR_TRANSPORT`,
carries each tensor's GPU by UUID:

- a tensor in gpu_serde memory (:func:`gpu_serde.tensors.empty`,
  :func:`gpu_serde.tensors.to_arena`) as its arena block, without a copy (the payload of
  :func:`gpu_serde.share`);
- any other CUDA tensor as torch's own CUDA IPC handle (the payload ``torch.multiprocessing``
  sends with gpu_serde installed), opened on this process's ordinal of the same GPU: an actor on
  another GPU of the node that sees the sender's GPU (peer access; ``NOSET``) gets the tensor on
  the sender's GPU;
- to a receiver that does not see the sender's GPU, or on another host, a copy: the receiver asks
  the sending actor for the bytes (through Ray's object store) and puts them on its own current
  device.

Use it on actors declared with ``enable_tensor_transport=True``::

    @ray.remote(num_gpus=1, enable_tensor_transport=True)
    class Trainer:
        @ray.method(tensor_transport=gpu_serde.ray.TENSOR_TRANSPORT)
        def weights(self): ...  # returns CUDA torch tensors (anywhere in the value)

Ray keeps the returned tensors in the sending actor until the reference is gone. :func:`register`
runs in the driver and every worker (:func:`gpu_serde.ray.init`, the worker hook) and registers
the transport once torch is imported there; on Ray before 2.55 it does nothing.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import ray

from gpu_serde.errors import OtherHostError
from gpu_serde.hostid import host_id
from gpu_serde.ray.transport import OneSidedTransport, supported
from gpu_serde.tensors.lazy import when_imported

try:  # Ray 2.55 and later
    from ray.experimental import TensorTransportMetadata, register_tensor_transport
except ImportError:  # pragma: no cover - Ray before 2.55 (the version matrix's low leg)
    TensorTransportMetadata = register_tensor_transport = None

#: The transport's name, as ``@ray.method(tensor_transport=...)`` and ``.options(...)`` take it.
TENSOR_TRANSPORT = "GPU_SERDE_TENSOR"

_lock = threading.Lock()
_registered = False
_served: dict[tuple[str, int], Any] = {}  # (object id, index) -> a tensor this actor sent


def register() -> bool:
    """Register :data:`TENSOR_TRANSPORT` for ``torch.Tensor`` in this process once torch is
    imported (now, if it is); False where Ray has no custom tensor transports (before 2.55)."""
    if not supported():
        return False
    when_imported("torch", _torch_imported)
    return True


def _torch_imported(torch: ModuleType) -> None:
    global _registered
    with _lock:
        if _registered:
            return
        try:
            register_tensor_transport(TENSOR_TRANSPORT, ["cuda"], TensorTransport, torch.Tensor)
        except ValueError as exc:  # registered already in this process (by another route)
            if "already registered" not in str(exc):
                raise
        _registered = True


def _host_copy(actor: Any, obj_id: str, index: int) -> Any:
    """Runs in the sending actor (``__ray_call__``): a tensor it sent, by value (its payload,
    whose bytes Ray's object store carries)."""
    from gpu_serde.tensors import torch as reducers

    t = _served.get((obj_id, index))
    if t is None:
        raise OtherHostError(
            f"the sending actor no longer holds tensor {index} of object {obj_id[:16]}: it was "
            "freed before this receiver fetched a copy"
        )
    p = reducers.value_payload(t)
    return (p.meta.wire(), p.start, p.nbytes, p.data)


if TensorTransportMetadata is not None:

    @dataclass
    class TensorMetadata(TensorTransportMetadata):  # type: ignore[misc]
        """What travels with a reference: per tensor, its zero-copy kind and payload (``tshr``
        or ``tipc``, or None) and its device payload; the sender's host and actor."""

        payloads: list[Any] = field(default_factory=list)
        devices: list[Any] = field(default_factory=list)
        host: bytes = b""
        source: Any = None

    class TensorTransport(OneSidedTransport):
        """gpu_serde's one-sided tensor transport for torch tensors (see the module)."""

        name = TENSOR_TRANSPORT
        served = _served

        def extract_tensor_transport_metadata(
            self, obj_id: str, rdt_object: list[Any]
        ) -> TensorMetadata:
            """Runs in the sender: each tensor's zero-copy payload and GPU."""
            from cuda.core import Device

            from gpu_serde.device import device_payload

            payloads, devices = [], []
            for i, t in enumerate(rdt_object):
                payloads.append(_zero_copy(t))
                devices.append(device_payload(Device(int(t.device.index))) if t.is_cuda else None)
                _served[(obj_id, i)] = t
            ctx = ray.get_runtime_context()
            return TensorMetadata(
                tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
                tensor_device="cuda",
                payloads=payloads,
                devices=devices,
                host=host_id(),
                source=ctx.current_actor if ctx.get_actor_id() else None,
            )

        def recv_multiple_tensors(
            self,
            obj_id: str,
            tensor_transport_metadata: TensorMetadata,
            communicator_metadata: Any,
            target_buffers: Any = None,
        ) -> list[Any]:
            """Runs in the receiver: each tensor mapped (the sender's GPU visible here, on its
            host) or copied to this process's current device."""
            meta = tensor_transport_metadata
            same_host = meta.host == host_id()
            return [_receive(obj_id, i, meta, same_host) for i in range(len(meta.payloads))]


def _zero_copy(t: Any) -> tuple[str, Any] | None:
    """``(kind, payload)`` that maps ``t`` on this host without a copy, or None."""
    from gpu_serde import wire
    from gpu_serde.tensors import sharing
    from gpu_serde.tensors import torch as reducers

    if not reducers.carried(t):
        return None
    s = sharing.in_gpu_serde_memory(t)
    fn, (payload,) = (
        sharing.reduce_shared(s) if s is not None else reducers.reduce_tensor_mp(t.detach())
    )
    if fn is wire.tshr:
        return ("tshr", payload)
    if fn is wire.tipc:
        return ("tipc", payload)
    return None


def _receive(obj_id: str, index: int, meta: Any, same_host: bool) -> Any:
    from gpu_serde import inventory
    from gpu_serde.format.device import raw_uuid
    from gpu_serde.tensors import sharing, values

    found = meta.payloads[index]
    device = meta.devices[index]
    visible = device is not None and inventory.local_ordinal(raw_uuid(device)) is not None
    if same_host and found is not None and visible:
        kind, payload = found
        return sharing.rebuild_shared(payload) if kind == "tshr" else values.rebuild_ipc(payload)
    if meta.source is None:
        raise OtherHostError(
            f"a tensor that a Ray driver or task put with the {TENSOR_TRANSPORT} transport "
            f"cannot be mapped here (pid {os.getpid()}: another host, or its GPU is not "
            "visible), and no actor holds it to copy it from: return tensors from an actor"
        )
    wire_meta, start, nbytes, data = ray.get(
        meta.source.__ray_call__.options(concurrency_group="_ray_system").remote(
            _host_copy, obj_id, index
        )
    )
    return _placed(wire_meta, start, nbytes, data)


def _placed(wire_meta: Any, start: int, nbytes: int, data: Any) -> Any:
    """A copy's tensor on this process's current device."""
    import torch

    from gpu_serde.format.device import VERSION
    from gpu_serde.format.tensor import TvalPayload, decode_meta
    from gpu_serde.tensors import torch as reducers

    m = decode_meta(wire_meta, nbytes, None, start)
    p = TvalPayload(VERSION, b"", m, start, nbytes, data)
    return reducers.place_value(p, torch.device("cuda", torch.cuda.current_device()))
