"""What a sender could not send (``gpu_serde.wire.unsent``): the typed error, which the receiver
raises when it uses the object. A sender never fails (a Dask serializer that raises leaves the
receiver waiting for ever; a scheduler that cannot re-pickle a task argument drops the workers),
so a buffer that cannot be sent travels as this instead.
"""

from __future__ import annotations

from typing import Any

from gpu_serde import wire
from gpu_serde.errors import (
    ExporterGoneError,
    HandoffError,
    HostCopyError,
    NotIPCEnabledError,
    OtherHostError,
    TokenRefusedError,
)
from gpu_serde.format.device import VERSION
from gpu_serde.format.memory import UnsentPayload, decode_unsent
from gpu_serde.text import safe

_UNSENT_ERRORS: dict[str, type[HandoffError]] = {
    cls.__name__: cls
    for cls in (
        HandoffError,
        HostCopyError,
        NotIPCEnabledError,
        OtherHostError,
        ExporterGoneError,
        TokenRefusedError,
    )
}


def unsent(what: str, error: Exception) -> tuple[Any, ...]:
    """``(gpu_serde.wire.unsent, (payload,))``: ``what`` could not be sent, for ``error`` (a
    typed error keeps its type at the receiver; any other is a ``HandoffError`` there)."""
    known = type(error).__name__ in _UNSENT_ERRORS
    kind = type(error).__name__ if known else "HandoffError"
    message = str(error) if known else f"{type(error).__name__}: {error}"
    return (wire.unsent, (UnsentPayload(VERSION, what, kind, message).wire(),))


def rebuild_unsent(payload: object) -> None:
    """Rebuild body of :func:`gpu_serde.wire.unsent`: always raises the sender's error.

    Raises:
        HandoffError: of the sender's type (:class:`~gpu_serde.HostCopyError`, ...), saying that
            the sender could not send it and why; PayloadError: malformed.
    """
    p = decode_unsent(payload)
    cls = _UNSENT_ERRORS.get(p.error, HandoffError)
    raise cls(f"the sender could not send this {safe(p.what)}: {safe(p.message)}")
