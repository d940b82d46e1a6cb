"""gpu_serde: send cuda.core GPU objects between processes by GPU UUID, not by ordinal.

Public names::

    install(strict=False) / uninstall()   pickle cuda.core objects by UUID in this process
    visible_devices()                     the GPUs this process sees (DeviceInfo list)
    resolve(obj)                          a received object, or its typed error
    portable(buf)                         a Buffer that reaches any host (mapped, or a copy)
    share(x)                              a CUDA torch tensor or CuPy array, no copy on one host
                                          (Shared; SharedCopyWarning; more in gpu_serde.tensors)
    DeviceInfo, UnresolvedDevice, UnresolvedObject, canonical_uuid
    DeviceNotVisibleError, PayloadError, CompatibilityError, PlacementError
    HandoffError and its kinds: OtherHostError, ExporterGoneError, TokenRefusedError,
    NotIPCEnabledError, HostCopyError, ArenaFullError (memory hand-off)
    ArenaMemoryResource(device, size)     device memory whose buffers hand off as offsets

Engine adapters live in :mod:`gpu_serde.ray` and :mod:`gpu_serde.dask`; simulated GPUs for
CPU-only tests in :mod:`gpu_serde.testing`; the command line in :mod:`gpu_serde.tools`. The
package's folders: the flat core here (``wire`` and ``errors``, which pickles name; ``dispatch``,
the table of handled types; ``registry``, ``placeholders``, ``device``, ``inventory``,
``identity``, ``hostid``, ``text``, ``compat``, ``routing``), ``format/`` (the payloads),
``memory/`` (GPU memory across processes), ``tensors/`` (torch tensors and CuPy arrays),
``ray/``, ``dask/``, ``tools/``, ``testing/``.
``docs/how-it-works.md`` shows the path of a Device and of a Buffer.
"""

from gpu_serde import dispatch as _dispatch  # noqa: F401  (fills the tables: types, rebuilds)
from gpu_serde._version import __version__
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
from gpu_serde.identity import DeviceInfo, canonical_uuid
from gpu_serde.inventory import visible_devices
from gpu_serde.memory.arena import ArenaMemoryResource
from gpu_serde.memory.portable import PortableBuffer, portable
from gpu_serde.placeholders import UnresolvedDevice, UnresolvedObject, resolve
from gpu_serde.registry import install, uninstall
from gpu_serde.tensors import Shared, SharedCopyWarning, share

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
    "Shared",
    "SharedCopyWarning",
    "TokenRefusedError",
    "UnresolvedDevice",
    "UnresolvedObject",
    "__version__",
    "canonical_uuid",
    "install",
    "portable",
    "resolve",
    "share",
    "uninstall",
    "visible_devices",
]
