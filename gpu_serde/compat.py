"""The private names of other libraries that gpu_serde relies on, in one place.

Each is looked up by feature, not by version. If a later release moves one, the function here
fails with a message that names what is missing and which versions are known to work, instead of
an ``AttributeError`` deep inside a pickler.

cuda.core ships no type information (no ``py.typed``): its classes are ``Any`` to mypy, which is
configured once, in ``pyproject.toml`` (``[tool.mypy]``), not by ignores scattered in the code.
"""

from __future__ import annotations

import uuid
from multiprocessing.reduction import ForkingPickler
from typing import Any

from gpu_serde.errors import CompatibilityError

KNOWN_GOOD = "cuda-core 1.2 and Python 3.10 to 3.13"


def forking_reducers() -> dict[type, Any]:
    """``multiprocessing``'s table of extra reducers (``ForkingPickler._extra_reducers``).

    gpu_serde writes its reducers into this table (what ``ForkingPickler.register`` does), and
    reads it to save and restore the reducers it replaces (cuda.core's own ordinal-based ones).

    Raises:
        CompatibilityError: this Python's multiprocessing has no such table.
    """
    table = getattr(ForkingPickler, "_extra_reducers", None)
    if not isinstance(table, dict):
        raise CompatibilityError(
            "multiprocessing.reduction.ForkingPickler has no _extra_reducers table in this Python: "
            f"gpu_serde cannot replace cuda.core's reducers there (known to work: {KNOWN_GOOD})"
        )
    return table


def _ipc_init(name: str, purpose: str) -> Any:
    """``cuda.core._memory._ipc.<name>._init``, or a :class:`CompatibilityError` naming
    ``purpose``."""
    try:  # imported here: a cuda.core without the module gives this message, not an ImportError
        from cuda.core._memory import _ipc

        return getattr(_ipc, name)._init
    except (ImportError, AttributeError) as exc:
        raise CompatibilityError(
            f"the installed cuda.core has no cuda.core._memory._ipc.{name}._init, which gpu_serde "
            f"needs {purpose} (known to work: {KNOWN_GOOD}): {exc}"
        ) from None


def ipc_buffer_descriptor(reserved: bytes, size: int) -> Any:
    """cuda.core's ``IPCBufferDescriptor`` for a buffer's 64 exported bytes and size.

    cuda.core 1.2 has no public constructor for it (it pickles the descriptor as these bytes).

    Raises:
        CompatibilityError: the installed cuda.core has no ``IPCBufferDescriptor._init``.
    """
    return _ipc_init("IPCBufferDescriptor", "to map a received buffer")(reserved, size)


def allocation_handle(fd: int, pool_uuid: bytes) -> Any:
    """cuda.core's ``IPCAllocationHandle`` for an imported pool's descriptor ``fd``, named by the
    exporting pool's UUID: importing through it keeps ``mr.uuid`` as the sender's (as cuda.core's
    own multiprocessing path does) and registers the pool in cuda.core's registry. The handle owns
    ``fd`` from then on (closing the handle closes it).

    Raises:
        CompatibilityError: the installed cuda.core has no ``IPCAllocationHandle._init``.
    """
    init = _ipc_init("IPCAllocationHandle", "to import a received pool")
    return init(fd, uuid.UUID(bytes=pool_uuid))
