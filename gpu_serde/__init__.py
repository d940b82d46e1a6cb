"""gpu_serde: send cuda.core GPU objects between processes by GPU UUID, not by ordinal.

Public names::

    install(strict=False) / uninstall()   pickle cuda.core objects by UUID in this process
    visible_devices()                     the GPUs this process sees (DeviceInfo list)
    resolve(obj)                          a received object, or DeviceNotVisibleError
    DeviceInfo, UnresolvedDevice, DeviceNotVisibleError, PayloadError, canonical_uuid
    HandoffError and its kinds: OtherHostError, ExporterGoneError, TokenRefusedError,
    NotIPCEnabledError (memory hand-off, :mod:`gpu_serde.memory`)

Engine adapters live in :mod:`gpu_serde.ray` and :mod:`gpu_serde.dask`; simulated GPUs for
CPU-only tests in :mod:`gpu_serde.testing`.
"""

from gpu_serde._version import __version__
from gpu_serde.errors import (
    DeviceNotVisibleError,
    ExporterGoneError,
    HandoffError,
    NotIPCEnabledError,
    OtherHostError,
    PayloadError,
    TokenRefusedError,
)
from gpu_serde.identity import DeviceInfo, canonical_uuid
from gpu_serde.inventory import visible_devices
from gpu_serde.reducers import install, resolve, uninstall
from gpu_serde.wire import UnresolvedDevice, UnresolvedObject

__all__ = [
    "DeviceInfo",
    "DeviceNotVisibleError",
    "ExporterGoneError",
    "HandoffError",
    "NotIPCEnabledError",
    "OtherHostError",
    "PayloadError",
    "TokenRefusedError",
    "UnresolvedDevice",
    "UnresolvedObject",
    "__version__",
    "canonical_uuid",
    "install",
    "resolve",
    "uninstall",
    "visible_devices",
]
