"""Dask: a ``Buffer`` that is a task result or scattered data reaches any worker, mapped without a
copy on its exporter's host and by value beyond it.

distributed serializes data (a result that another worker fetches, scattered data, a result a
client gathers) with its serializer families, and passes the ``dask`` family the comm's
``context``, whose ``"recipient"`` describes the peer. gpu_serde registers a ``dask`` serializer
for ``cuda.core.Buffer`` that picks, for each send, how the buffer travels:

- to a process on this host: the zero-copy payload (as pickling gives it:
  :mod:`gpu_serde.memory.buffers`);
- to a process on another host: a host copy (:mod:`gpu_serde.memory.bycopy`), uploaded there to a
  pool of the receiver's own, on the same GPU if it sees it;
- to a process whose host is not known (a scheduler that forwards the bytes to a worker or client
  of its choosing, a process without gpu_serde): both, the receiver maps or uploads, unless every
  gpu_serde process of the cluster is on this host (then zero copy).

A buffer whose memory cannot be shared (not from an IPC-enabled pool) travels by value everywhere.

Under a comm that carries GPU memory (UCX) with distributed's ``cuda`` serializer family, a
buffer of device memory travels as one device frame instead (:func:`cuda_serialize_buffer`): UCX
moves it GPU to GPU, and the receiver copies it into a pool of its own. That family gets no
context, so it copies on one host too.

Where a peer is comes from :mod:`gpu_serde.dask.hosts` (the comm's handshake and the cluster's
table).

A buffer nested in another object (a task argument, a dataclass) is pickled, not serialized here:
it travels by its zero-copy payload, which cannot be mapped on another host (``OtherHostError``
when used there). Scatter it, return it from a task, or wrap it in :func:`gpu_serde.portable`.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

from cuda.core import Buffer
from distributed.protocol.cuda import cuda_deserialize, cuda_serialize
from distributed.protocol.serialize import dask_deserialize, dask_serialize

from gpu_serde import wire
from gpu_serde.dask.hosts import peer_host, table
from gpu_serde.errors import HandoffError, NotIPCEnabledError, PayloadError
from gpu_serde.format.device import VERSION
from gpu_serde.format.memory import decode_hbuf
from gpu_serde.hostid import host_id
from gpu_serde.memory import buffers, bycopy, portable, unsent
from gpu_serde.placeholders import UnresolvedObject
from gpu_serde.text import safe

logger = logging.getLogger("gpu_serde.dask")

#: How a buffer was sent, as the serializer's header says: zero copy, by value, both, or not at
#: all (its error, raised where it is used).
SENT = ("ipc", "copy", "both", "unsent")
FORMAT = 1  # the header's "gpu_serde" entry
_warned_unshared = False


def choose(context: object) -> str:
    """How a buffer goes to the peer that ``context`` (distributed's serializer context) names:
    ``"ipc"`` (zero copy), ``"copy"`` (by value) or ``"both"``. No context (spilling to disk, in
    this process) is zero copy."""
    if not isinstance(context, dict):
        return "ipc"
    host = peer_host(context)
    if host is not None:
        return "ipc" if host == host_id() else "copy"
    return "ipc" if table.one_host() else "both"


class _Reduced:
    """Pickles as a reduction chosen beforehand."""

    __slots__ = ("reduction",)

    def __init__(self, reduction: tuple[Any, ...]) -> None:
        self.reduction = reduction

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduction


def to_frames(reduction: tuple[Any, ...]) -> list[Any]:
    """``reduction`` as distributed frames: its pickle (protocol 5), then its out-of-band buffers
    (the bytes, when they travel, without a copy)."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(_Reduced(reduction), protocol=5, buffer_callback=buffers.append)
    return [head, *(b.raw() for b in buffers)]


def from_frames(header: object, frames: list[Any], key: str, what: str, reconstructor: Any) -> Any:
    """What :func:`to_frames` sent, under a header whose ``key`` entry is :data:`FORMAT`; never
    raises (Dask would lose the worker): anything wrong gives a placeholder of ``what`` that
    raises :class:`~gpu_serde.PayloadError` when used (re-pickled, it names ``reconstructor``)."""
    try:
        if not isinstance(header, dict) or header.get(key) != FORMAT or not frames:
            raise PayloadError(
                f"invalid gpu_serde Dask frames (header {safe(header)}): sent by another "
                "gpu_serde version; install the same version on every process of the cluster"
            )
        return pickle.loads(frames[0], buffers=frames[1:])
    except Exception as exc:
        error = (
            exc
            if isinstance(exc, PayloadError)
            else PayloadError(f"invalid gpu_serde Dask frames: {type(exc).__name__}: {safe(exc)}")
        )
        return UnresolvedObject(what, reconstructor, (None,), error)


def _reduction(buf: Buffer, sent: str) -> tuple[str, tuple[Any, ...]]:
    global _warned_unshared
    if sent == "ipc":
        try:
            return sent, buffers.reduction(buf)
        except NotIPCEnabledError as exc:
            if not _warned_unshared:
                _warned_unshared = True
                logger.warning("gpu_serde: Dask sends such buffers by value (a copy): %s", exc)
            sent = "copy"
    if sent == "copy":
        return sent, bycopy.reduce_by_value(buf, 5)
    return sent, portable.PortableBuffer(buf).__reduce_ex__(5)


def serialize_buffer(buf: Buffer, context: object = None) -> tuple[dict[str, Any], list[Any]]:
    """distributed ``dask`` serializer for ``cuda.core.Buffer``: the header says how it was
    sent (:data:`SENT`); the frames are a pickle and its out-of-band buffers (the bytes, when
    they travel).

    Never raises: a buffer that cannot be sent (a copy that does not fit in host memory, a closed
    buffer) is sent as its error (``"unsent"``), which the receiver raises when it is used (a
    serializer that raises would leave the receiver waiting for ever).
    """
    try:
        sent, reduction = _reduction(buf, choose(context))
    except Exception as exc:  # raising here would leave the receiver waiting for ever
        logger.warning("gpu_serde: a Buffer could not be sent: %s", exc)
        sent, reduction = "unsent", unsent.unsent("Buffer", exc)
    return {"gpu_serde": FORMAT, "sent": sent}, to_frames(reduction)


def deserialize_buffer(header: object, frames: list[Any]) -> Any:
    """distributed ``dask`` deserializer for ``cuda.core.Buffer``: the buffer, mapped or uploaded
    here; never raises (Dask would lose the worker): anything wrong gives a placeholder."""
    return from_frames(header, frames, "gpu_serde", "Buffer", wire.hbuf)


dask_serialize.register(Buffer)(serialize_buffer)
dask_deserialize.register(Buffer)(deserialize_buffer)


class DeviceFrame:
    """A buffer's bytes as a device frame: ``__cuda_array_interface__`` of ``size`` bytes (what
    a comm that carries GPU memory, such as UCX, sends GPU to GPU). Keeps the buffer alive."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: Buffer) -> None:
        self.buffer = buffer

    @property
    def nbytes(self) -> int:
        """The frame's size in bytes."""
        return int(self.buffer.size)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        ptr = int(self.buffer.handle)
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def cuda_serialize_buffer(buf: Buffer) -> tuple[dict[str, Any], list[Any]]:
    """distributed ``cuda`` serializer for ``cuda.core.Buffer`` of device memory: one device
    frame, by value (the ``cuda`` family gets no context, so it cannot tell a peer on this host
    from one on another). Buffers of pinned host memory go to the next family (``dask``).

    Raises:
        NotImplementedError: pinned host memory, or a closed buffer (the next family decides).
    """
    if not buf.handle or int(buf.device_id) < 0:
        raise NotImplementedError("gpu_serde sends device memory only as device frames")
    header = {"gpu_serde": FORMAT, "device": bycopy.device_of(buf), "size": int(buf.size)}
    return header, [DeviceFrame(buf)]


def cuda_deserialize_buffer(header: object, frames: list[Any]) -> Any:
    """distributed ``cuda`` deserializer: the frame's bytes in a new buffer from this process's
    receiving pool (a device-to-device copy, or an upload for a host frame); never raises."""
    try:
        if not isinstance(header, dict) or header.get("gpu_serde") != FORMAT or len(frames) != 1:
            raise PayloadError(f"invalid gpu_serde device frames (header {safe(header)})")
        device, size, frame = header.get("device"), header.get("size"), frames[0]
        if hasattr(frame, "__cuda_array_interface__"):
            return bycopy.from_device(device, size, frame.__cuda_array_interface__)
        return bycopy.upload(decode_hbuf((VERSION, device, size, frame)))
    except Exception as exc:
        error = (
            exc
            if isinstance(exc, (PayloadError, HandoffError))
            else HandoffError(
                f"a Buffer sent as a device frame could not be received here: "
                f"{type(exc).__name__}: {safe(exc)}"
            )
        )
        return UnresolvedObject("Buffer", wire.hbuf, (None,), error)


cuda_serialize.register(Buffer)(cuda_serialize_buffer)
cuda_deserialize.register(Buffer)(cuda_deserialize_buffer)
