"""Ray Direct Transport (RDT) for ``cuda.core.Buffer``: actor to actor, outside the object store.

Ray 2.55 and later let actors return GPU objects through a *tensor transport*: the object stays in
the sending actor, only metadata travels with the reference, and the receiver fetches the object
when a task needs it. gpu_serde registers one for ``cuda.core.Buffer``, named :data:`TRANSPORT`:

- on the sender's host, the receiver maps the sender's memory without a copy (the zero-copy payload
  and the descriptor broker, as for pickled buffers; the same lifetime rules);
- on another host, the receiver asks the sending actor for a copy of the bytes (a task on the
  actor's ``_ray_system`` concurrency group, whose result travels through Ray's object store) and
  uploads it to a pool of its own, on the same GPU if it sees it.

Use it on actors declared with ``enable_tensor_transport=True``:

.. code-block:: python

    @ray.remote(num_gpus=1, enable_tensor_transport=True)
    class Producer:
        @ray.method(tensor_transport=gpu_serde.ray.TRANSPORT)
        def make(self): ...  # returns cuda.core Buffers (anywhere in the value)

:func:`register` runs in the driver (:func:`gpu_serde.ray.init`, the runtime_env hook) and in every
worker (:func:`gpu_serde.ray.setup_worker`): Ray hands a transport to an actor when the actor is
created, so the driver must register it before it creates actors, and before it defines classes
that name it. On Ray before 2.55 there is no such API and :func:`register` does nothing.

Ray's rules apply: a reference must be a top-level positional argument of an actor method (a plain
task cannot receive one), and the receiving method runs on another thread than the fetch (make
the buffer's device current there before using it). A buffer that a driver or a task ``ray.put``
with this transport has no actor to copy it: it can be read on its host only (``OtherHostError``
elsewhere); send a :func:`gpu_serde.portable` buffer through the object store instead.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import ray
from cuda.core import Buffer

from gpu_serde.errors import NotIPCEnabledError, OtherHostError
from gpu_serde.format.device import VERSION
from gpu_serde.format.memory import decode_hbuf
from gpu_serde.hostid import host_id
from gpu_serde.memory import buffers, bycopy

#: The transport's name, as ``@ray.method(tensor_transport=...)`` and ``.options(...)`` take it.
TRANSPORT = "GPU_SERDE"

try:  # Ray 2.55 and later
    from ray.experimental import (
        CommunicatorMetadata,
        TensorTransportManager,
        TensorTransportMetadata,
        register_tensor_transport,
    )
except ImportError:  # pragma: no cover - Ray before 2.55 (the version matrix's low leg)
    TensorTransportManager = TensorTransportMetadata = None
    register_tensor_transport = None

_lock = threading.Lock()
_registered = False
_served: dict[tuple[str, int], Buffer] = {}  # (object id, index) -> a buffer this actor sent


def supported() -> bool:
    """True when this Ray has custom tensor transports (2.55 and later)."""
    return register_tensor_transport is not None


def register() -> bool:
    """Register :data:`TRANSPORT` for ``cuda.core.Buffer`` in this process (once; later calls do
    nothing); False where Ray has no custom tensor transports (before 2.55)."""
    global _registered
    if not supported():
        return False
    with _lock:
        if not _registered:
            try:
                register_tensor_transport(TRANSPORT, ["cuda"], BufferTransport, Buffer)
            except ValueError as exc:  # registered already in this process (by another route)
                if "already registered" not in str(exc):
                    raise
            _registered = True
    return True


def _host_copy(actor: Any, obj_id: str, index: int) -> Any:
    """Runs in the sending actor (``__ray_call__``): a copy of a buffer it sent, as a NumPy array
    (Ray's object store carries it without another copy)."""
    buf = _served.get((obj_id, index))
    if buf is None:
        raise OtherHostError(
            f"the sending actor no longer holds buffer {index} of object {obj_id[:16]}: it was "
            "freed before this receiver on another host fetched a copy"
        )
    return bycopy.to_host(buf).obj  # the NumPy array the copy is in


# Ray's base where it has one (before 2.55 nothing registers a transport: the class is inert)
_Manager: Any = TensorTransportManager if TensorTransportManager is not None else object


class OneSidedTransport(_Manager):  # type: ignore[misc]
    """What gpu_serde's transports share: one-sided (receivers fetch), never aborted, no
    communicator; a subclass names itself (:attr:`name`), keeps what it sent in
    :attr:`served` (``(object id, index) -> object``) and writes the metadata and the
    receiving side."""

    name = ""  #: the transport's name
    served: ClassVar[dict[tuple[str, int], Any]] = {}  #: what this actor sent (object, index)

    @property
    def tensor_transport_backend(self) -> str:
        return self.name

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> Any:
        return CommunicatorMetadata()

    def send_multiple_tensors(self, tensors: Any, meta: Any, comm: Any) -> None:
        raise NotImplementedError("gpu_serde's transports are one-sided: receivers fetch")

    def garbage_collect(self, obj_id: str, meta: Any, tensors: Any) -> None:
        """Runs in the sender once the object's last reference is gone."""
        for i in range(len(meta.payloads)):
            self.served.pop((obj_id, i), None)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        """Nothing to abort (never called: :meth:`can_abort_transport` is False)."""


if TensorTransportManager is not None:

    @dataclass
    class BufferMetadata(TensorTransportMetadata):  # type: ignore[misc]
        """What travels with a reference: per buffer, its zero-copy kind and payload (or None)
        and its host copy's device payload and size; the sender's host and actor."""

        payloads: list[Any] = field(default_factory=list)
        copies: list[Any] = field(default_factory=list)
        host: bytes = b""
        source: Any = None

    class BufferTransport(OneSidedTransport):
        """gpu_serde's one-sided tensor transport for ``cuda.core.Buffer`` (see the module)."""

        name = TRANSPORT
        served = _served

        def extract_tensor_transport_metadata(
            self, obj_id: str, rdt_object: list[Buffer]
        ) -> BufferMetadata:
            """Runs in the sender: each buffer's zero-copy payload (held for importers)."""
            payloads: list[tuple[str, Any] | None] = []
            copies: list[tuple[bytes | None, int]] = []
            for i, buf in enumerate(rdt_object):
                try:
                    payloads.append(buffers.zero_copy(buf))
                except NotIPCEnabledError:
                    payloads.append(None)  # only a copy can reach another process
                copies.append((bycopy.device_of(buf), int(buf.size)))
                _served[(obj_id, i)] = buf
            ctx = ray.get_runtime_context()
            return BufferMetadata(
                tensor_meta=[((int(b.size),), "uint8") for b in rdt_object],
                tensor_device="cuda",
                payloads=payloads,
                copies=copies,
                host=host_id(),
                source=ctx.current_actor if ctx.get_actor_id() else None,
            )

        def recv_multiple_tensors(
            self,
            obj_id: str,
            tensor_transport_metadata: BufferMetadata,
            communicator_metadata: Any,
            target_buffers: Any = None,
        ) -> list[Buffer]:
            """Runs in the receiver: each buffer mapped (on the sender's host) or uploaded."""
            meta = tensor_transport_metadata
            same_host = meta.host == host_id()
            return [
                _receive(obj_id, i, meta, same_host and meta.payloads[i] is not None)
                for i in range(len(meta.copies))
            ]


def _receive(obj_id: str, index: int, meta: Any, mapped: bool) -> Buffer:
    if mapped:
        kind, payload = meta.payloads[index]
        return buffers.rebuild_zero_copy(kind, payload)
    if meta.source is None:
        raise OtherHostError(
            f"a Buffer that a Ray driver or task put with the {TRANSPORT} transport reached "
            f"another host (pid {os.getpid()}): no actor holds it to copy it from. Put "
            "gpu_serde.portable(buf) in the object store instead, or return buffers from an actor."
        )
    array = ray.get(
        meta.source.__ray_call__.options(concurrency_group="_ray_system").remote(
            _host_copy, obj_id, index
        )
    )
    device, size = meta.copies[index]
    return bycopy.upload(decode_hbuf((VERSION, device, size, array)))
