"""What the torch and CuPy modules share: finding the receiver's GPU by UUID and carrying bytes
out of band. Imports neither torch nor CuPy.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from gpu_serde import inventory as _inventory
from gpu_serde.errors import DeviceNotVisibleError, HandoffError
from gpu_serde.format.device import decode_device, raw_uuid
from gpu_serde.placeholders import not_visible_error
from gpu_serde.text import quoted, safe

#: How a library names a tensor or array in messages.
NAMES = {"torch": "torch.Tensor", "cupy": "cupy.ndarray"}

#: A tensor sent by value keeps its storage offset where the elements before the first it touches
#: take at most this many bytes, or as many as it carries; further in (a slice near the end of a
#: big tensor), its new storage starts at that first element: a receiver never allocates more than
#: twice what arrived, or this much, whatever a payload claims.
KEEP_OFFSET_BYTES = 1 << 20


def kept_lead(start: int, nbytes: int, itemsize: int) -> int:
    """How many of the ``start`` elements before a by-value tensor's first touched element its
    new storage keeps (all, or none: see :data:`KEEP_OFFSET_BYTES`)."""
    return start if start * itemsize <= max(nbytes, KEEP_OFFSET_BYTES) else 0


def local_ordinal(device: bytes, what: str) -> int:
    """This process's ordinal of the GPU a validated device payload names.

    Raises:
        DeviceNotVisibleError: this process does not see that GPU (``what`` names the object).
    """
    ordinal = _inventory.local_ordinal(raw_uuid(device))
    if ordinal is None:
        raise not_visible_error(decode_device(device), _inventory.inventory(), f"the {what}'s GPU")
    return ordinal


#: What to do with memory that stays in its sender's process, where torch here has no CUDA.
NOT_HERE = (
    "Its memory stays in the sender's process: receive it where torch has CUDA, or send the "
    "tensor by value (not shared) and use gpu_serde.tensors.place(x, 'cpu')."
)

_torch_cuda: list[bool] = []  # whether torch here has CUDA, once asked


def need_torch_cuda(what: str, then: str, device: bytes) -> None:
    """Refuse a torch CUDA tensor (``what``) for a GPU this process sees (``device``, its device
    payload) where torch has no CUDA (a CPU-only build, or simulated GPUs), which the driver's
    GPU alone cannot help: torch would fail with an untyped error. Asked of torch once per
    process.

    Raises:
        DeviceNotVisibleError: torch here has no CUDA (``uuid``, ``host`` and ``visible`` set as
            for a GPU this process does not see); ``then`` says what to do instead.
    """
    if not _torch_cuda:
        _torch_cuda.append(bool(sys.modules["torch"].cuda.is_available()))
    if not _torch_cuda[0]:
        d = decode_device(device)
        name = quoted(d.name) if d.name else "name unknown"
        raise DeviceNotVisibleError(
            f"{what} arrived for GPU {d.canonical_uuid} ({name}), which this process sees, "
            f"sent from host {quoted(d.host)}; torch here has no GPU "
            "(torch.cuda.is_available() is False: a CPU-only torch build, or simulated GPUs, "
            f"which run no torch CUDA). {then}",
            uuid=d.canonical_uuid,
            host=safe(d.host),
            visible=_inventory.inventory().devices,
        )


def need(library: str, caller: str | None = None) -> Any:
    """The module ``library`` (``"torch"`` or ``"cupy"``), imported: a tensor of it arrived, or
    ``caller`` (a gpu_serde function, named in the error) needs it.

    Raises:
        HandoffError: it is not installed in this process.
    """
    module = sys.modules.get(library)
    if module is not None:
        return module
    try:
        return __import__(library)
    except Exception as exc:
        why = f"this process cannot import {library} ({type(exc).__name__}: {exc})"
        if caller is not None:
            fix = f"which {caller} needs: install {library} here"
        else:
            fix = (
                f"which a {NAMES.get(library, library)} needs: install {library} here, or "
                f"receive it where {library} is installed"
            )
        raise HandoffError(f"{why}, {fix}") from None


class Carried:
    """Bytes a payload carries, pickled out of band where the pickler takes one (protocol 5:
    Ray's object store, Dask's frames), in band otherwise. Unpickles as a ``PickleBuffer`` (no
    copy: a view of what the engine delivered) or ``bytes``, which re-pickle the same way."""

    __slots__ = ("view",)

    def __init__(self, view: memoryview) -> None:
        self.view = view

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if int(protocol) >= 5:
            return (pickle.PickleBuffer, (pickle.PickleBuffer(self.view),))
        return (bytes, (self.view.tobytes(),))


def torch_pickles() -> bool:
    """True when the code pickling right now is torch's own (``torch.save``, ``torch.package``,
    torch.distributed's object collectives) or ``copy.copy``: there a tensor keeps torch's own
    reduction, so that checkpoints stay torch's format and ``copy.copy`` a view.

    A ``copyreg`` reducer is called by the C pickler with no Python frame in between: the first
    frame outside gpu_serde is the one that called ``dump``/``dumps`` (or ``copy.copy``)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("gpu_serde."):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return False
    name = str(frame.f_globals.get("__name__", ""))
    return name in ("copy", "torch") or name.startswith("torch.")
