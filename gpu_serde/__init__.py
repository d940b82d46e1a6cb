"""gpu_serde: send cuda.core GPU objects between processes by GPU UUID, not by ordinal.

Public names::

    install(strict=False) / uninstall()   pickle cuda.core objects by UUID in this process
    visible_devices()                     the GPUs this process sees (DeviceInfo list)
    resolve(obj)                          a received object, or its typed error
    portable(buf)                         a Buffer that reaches any host (mapped, or a copy)
    DeviceInfo, UnresolvedDevice, UnresolvedObject, canonical_uuid
    DeviceNotVisibleError, PayloadError, CompatibilityError, PlacementError
    HandoffError and its kinds: OtherHostError, ExporterGoneError, TokenRefusedError,
    NotIPCEnabledError, HostCopyError, ArenaFullError (memory hand-off)
    ArenaMemoryResource(device, size)     device memory whose buffers hand off as offsets

Engine adapters live in :mod:`gpu_serde.ray` and :mod:`gpu_serde.dask`; simulated GPUs for
CPU-only tests in :mod:`gpu_serde.testing`. ``docs/how-it-works.md`` shows the modules.
"""

from gpu_serde import handled as _handled  # noqa: F401  (fills the tables: types, rebuilds)
from gpu_serde._version import __version__
from gpu_serde.arena import ArenaMemoryResource
from gpu_serde.errors import (
    ArenaFullError,
    CompatibilityError,
    DeviceNotVisibleError,
    ExporterGoneError,
    HandoffError,
    HostCopyError,
    NotIPCEnabledError,
    OtherHostError,
    PayloadError,
    PlacementError,
    TokenRefusedError,
)
from gpu_serde.hostcopy import PortableBuffer, portable
from gpu_serde.identity import DeviceInfo, canonical_uuid
from gpu_serde.inventory import visible_devices
from gpu_serde.placeholders import UnresolvedDevice, UnresolvedObject, resolve
from gpu_serde.registry import install, uninstall

__all__ = [
    "ArenaFullError",
    "ArenaMemoryResource",
    "CompatibilityError",
    "DeviceInfo",
    "DeviceNotVisibleError",
    "ExporterGoneError",
    "HandoffError",
    "HostCopyError",
    "NotIPCEnabledError",
    "OtherHostError",
    "PayloadError",
    "PlacementError",
    "PortableBuffer",
    "TokenRefusedError",
    "UnresolvedDevice",
    "UnresolvedObject",
    "__version__",
    "canonical_uuid",
    "install",
    "portable",
    "resolve",
    "uninstall",
    "visible_devices",
]
