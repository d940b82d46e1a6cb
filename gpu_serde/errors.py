"""Errors raised by gpu_serde."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_serde.identity import DeviceInfo


class DeviceNotVisibleError(RuntimeError):
    """The GPU an object was sent for is not visible in this process.

    Attributes:
        uuid: canonical UUID of the GPU that was meant (``GPU-...`` or ``MIG-...``).
        host: host name of the process that sent it (where the GPU lives).
        visible: the GPUs this process can see, as :class:`~gpu_serde.DeviceInfo` tuples.
    """

    def __init__(
        self, message: str, uuid: str = "", host: str = "", visible: tuple[DeviceInfo, ...] = ()
    ) -> None:
        super().__init__(message)
        self.uuid = uuid
        self.host = host
        self.visible = tuple(visible)

    def __reduce__(
        self,
    ) -> tuple[type[DeviceNotVisibleError], tuple[str, str, str, tuple[DeviceInfo, ...]]]:
        # keeps .uuid/.host/.visible across Ray and Dask
        return (type(self), (str(self), self.uuid, self.host, self.visible))


class PayloadError(ValueError):
    """A gpu_serde payload is malformed, truncated, of an unknown version, or not gpu_serde's.

    Raised when the placeholder that such a payload became is used (or at unpickling under
    ``install(strict=True)``), never inside an engine's unpickler.
    """


class HandoffError(RuntimeError):
    """A memory hand-off between processes failed (base of the descriptor broker's errors)."""


class ExporterGoneError(HandoffError):
    """The exporting process is gone, or its descriptor broker did not answer within the timeout."""


class TokenRefusedError(HandoffError):
    """The exporter's broker refused the request: unknown or released token, or another user."""


class NotIPCEnabledError(HandoffError, TypeError):
    """A memory resource or buffer that cannot cross processes (its pool is not IPC-enabled)."""


class OtherHostError(HandoffError):
    """GPU memory sent to a process on another host (memory crosses processes only on its host)."""


class HostCopyError(HandoffError):
    """A buffer could not be copied to host memory to travel to another host: the copy does not
    fit in the host's available memory, or the driver refused the copy."""


class ArenaFullError(HandoffError, MemoryError):
    """An :class:`~gpu_serde.ArenaMemoryResource` has no free block as large as asked: it is
    full, too fragmented, or its memory is still held for importers.

    A ``MemoryError`` (what running out of memory is in Python) and a :class:`HandoffError`
    (gpu_serde's memory errors). The message says what was asked, what is free, the largest free
    block, the region's size, the GPU, and the size to create the resource with instead.

    Attributes:
        requested: bytes asked for.
        free: bytes free in the region (in blocks of any size).
        largest: the largest free block, in bytes: the most one allocation can get now.
        held: bytes of buffers sent and still held for importers (given back once every importer
            released them and the grace period, ``GPU_SERDE_RELEASE_GRACE_S``, has passed).
        size: the region's size, in bytes.
        uuid: the GPU's UUID (``GPU-...``).
        suggested: a region size that would have room (``ArenaMemoryResource(device, size=...)``);
            0 when the request is larger than the GPU's whole memory.
    """

    def __init__(
        self,
        message: str,
        *,
        requested: int = 0,
        free: int = 0,
        largest: int = 0,
        held: int = 0,
        size: int = 0,
        uuid: str = "",
        suggested: int = 0,
    ) -> None:
        super().__init__(message)
        self.requested, self.free, self.largest, self.held = requested, free, largest, held
        self.size, self.uuid, self.suggested = size, uuid, suggested

    def __reduce__(self) -> tuple[Any, ...]:
        # keeps the attributes across Ray and Dask (keyword-only arguments need a helper)
        return (_arena_full, (str(self), self.__dict__.copy()))


def _arena_full(message: str, attributes: dict[str, Any]) -> ArenaFullError:
    error = ArenaFullError(message)
    error.__dict__.update(attributes)
    return error


class CompatibilityError(RuntimeError):
    """An installed library (cuda.core, Python's multiprocessing) lacks a private name that
    gpu_serde needs; the message names it and the versions known to work."""


class PlacementError(RuntimeError):
    """``gpu_serde.dask.on`` / ``gpu_serde.ray.on`` cannot place the work as asked: objects on
    different GPUs, or a guarantee the engine cannot give (the message says what to do)."""
