"""The torch-free halves of the by-value and ``torch.multiprocessing`` rebuilds, and
:func:`place`: they validate a payload and find the GPU by UUID before they import the library,
so a process without the GPU (or without torch) gets a placeholder, never an untyped error.
"""

from __future__ import annotations

import sys
from typing import Any

from gpu_serde import wire
from gpu_serde.errors import DeviceNotVisibleError, PayloadError
from gpu_serde.format.tensor import decode_tipc, decode_tval
from gpu_serde.memory import lifetime
from gpu_serde.placeholders import UnresolvedObject
from gpu_serde.tensors.common import NAMES, NOT_HERE, local_ordinal, need_torch_cuda
from gpu_serde.tensors.sharing import module


def rebuild_value(payload: object) -> Any:
    """Rebuild body of :func:`gpu_serde.wire.tval`: a new tensor or array with the bytes, on this
    process's ordinal of the same GPU.

    Raises:
        PayloadError: malformed; DeviceNotVisibleError: the GPU is not visible here, or
            torch here has no CUDA; HandoffError: the library is missing here, or the copy
            failed.
    """
    p = decode_tval(payload)
    try:
        ordinal = local_ordinal(p.device, NAMES[p.meta.library])
    except DeviceNotVisibleError as exc:  # its bytes came with it: say where they can go
        raise DeviceNotVisibleError(
            f"{exc}\nIts bytes came with it: gpu_serde.tensors.place(x, 'cpu') (or a device you "
            "name) puts them there.",
            uuid=exc.uuid,
            host=exc.host,
            visible=exc.visible,
        ) from None
    m = module(p.meta.library)
    if p.meta.library == "torch":  # the driver sees the GPU; this process's torch may not
        need_torch_cuda(
            f"a {NAMES['torch']}",
            "Its bytes came with it: gpu_serde.tensors.place(x, 'cpu') puts them there.",
            p.device,
        )
    return m.from_value(p, ordinal)


def rebuild_ipc(payload: object) -> Any:
    """Rebuild body of :func:`gpu_serde.wire.tipc`: torch's own CUDA IPC, opened on this
    process's ordinal of the sender's GPU.

    Raises:
        PayloadError: malformed; OtherHostError: sent from another host;
        DeviceNotVisibleError: the GPU is not visible here; HandoffError: torch is missing here
            or could not open it.
    """
    p = decode_tipc(payload)
    what = "a torch CUDA tensor sent through torch.multiprocessing"
    ordinal = lifetime.local_ordinal(p.device, p.boot, what)  # the host and GPU before torch
    m = module("torch")
    need_torch_cuda(what, NOT_HERE, p.device)
    return m.from_ipc(p, ordinal)


def value_kind(payload: object) -> str:
    """What a by-value payload is, for messages."""
    return f"{NAMES[decode_tval(payload).meta.library]} (by value)"


def place(x: Any, device: Any) -> Any:
    """A received tensor or array on the device you name, explicitly: the way to use what
    arrived by value where its own GPU is not visible (another host, a CPU-only client).

    ``x`` is what was received: a tensor, module or array (moved with the library's own
    ``.to()``, or ``cupy.asarray``), or the placeholder that a by-value payload became (its bytes,
    carried in the payload, are put on ``device``: ``"cpu"``, ``"cuda:0"``, a ``torch.device``
    or an ordinal; for a CuPy array, a device ordinal, or ``"cpu"`` for a NumPy array). One
    object: place a state dict's entries one by one.

    Raises:
        TypeError: ``x`` is none of those, or ``device`` is ``"meta"`` (no bytes).
        DeviceNotVisibleError, OtherHostError, PayloadError, HandoffError: ``x`` is a
            placeholder of something that carries no bytes (shared memory, torch's own IPC) or
            of a malformed payload: its own reason; only the GPU it names can use it.
    """
    if not isinstance(x, UnresolvedObject):
        torch = sys.modules.get("torch")  # imported if x is a tensor
        if torch is not None and isinstance(x, torch.Tensor | torch.nn.Module):
            return x.to(_torch_device(torch, device))
        arrays = tuple(
            sys.modules[name].ndarray for name in ("cupy", "numpy") if name in sys.modules
        )
        if arrays and isinstance(x, arrays):
            if device == "cpu" and type(x).__module__.startswith("numpy"):
                return x  # there already: no CuPy needed
            return module("cupy").place_array(x, device)
        raise TypeError(
            "gpu_serde.tensors.place(x, device): x is a received torch.Tensor, cupy.ndarray, or "
            f"the placeholder a tensor sent by value became; not {type(x).__name__}"
        )
    if x._rebuild is not wire.tval or len(x._args) != 1:
        raise x._error()
    try:
        p = decode_tval(x._args[0])
    except PayloadError:
        raise x._error() from None
    m = module(p.meta.library)
    if p.meta.library == "torch":
        device = _torch_device(sys.modules["torch"], device)
    return m.place_value(p, device)


def _torch_device(torch: Any, device: Any) -> Any:
    """``device`` as a ``torch.device`` that this process's torch can use.

    Raises:
        TypeError: it names no device, or ``"meta"`` (which would keep no bytes).
        DeviceNotVisibleError: it is a GPU this process's torch does not see (a CPU build of
            torch, no GPU visible, or an index past the last).
    """
    try:
        if isinstance(device, int) and not isinstance(device, bool):
            where = torch.device("cuda", device)
        else:
            where = torch.device(device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            "gpu_serde.tensors.place(x, device): device is 'cpu', 'cuda:N', a torch.device or "
            f"a GPU ordinal, not {device!r:.80}"
        ) from None
    if where.type == "meta":  # a tensor without the bytes that came: nothing lost unsaid
        raise TypeError(
            f"gpu_serde.tensors.place(x, {device!r:.80}): a 'meta' device keeps no bytes; "
            "place it on 'cpu', 'cuda:N' or another device that holds memory"
        )
    if where.type != "cuda":
        return where
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count and (where.index is None or where.index < count):
        return where
    why = (
        "this process's torch was built without CUDA"
        if not torch.backends.cuda.is_built()
        else f"this process's torch sees {count} GPU(s)"
    )
    raise DeviceNotVisibleError(
        f"gpu_serde.tensors.place(x, {device!r:.80}): {why}. Place it on a GPU this process "
        "sees, or on 'cpu'"
    )
