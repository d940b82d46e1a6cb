"""Placeholders, the one rebuild guard, and :func:`resolve`.

Every reconstructor in :mod:`gpu_serde.wire` runs :func:`rebuild`, whatever its payload kind. The
table it reads is filled by :mod:`gpu_serde.dispatch` with :func:`define`. The rule:
a reconstructor never raises (Dask kills a worker, or hangs a future, on an exception in its
unpickler; Ray hides the error's type). Anything that goes wrong (malformed bytes, wrong types,
wrong arity, another payload version, another host, a gone exporter, a refused token, a GPU or peer
not visible here) gives a placeholder that re-pickles to the arguments it came with, so a scheduler
or a CPU-only hop forwards it unchanged, and raises the typed error when it is used. Only
``install(strict=True)`` raises at unpickling.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from cuda.core import Device

from gpu_serde import inventory as _inventory
from gpu_serde.errors import DeviceNotVisibleError, HandoffError, PayloadError
from gpu_serde.format.device import DevicePayload, decode_device, raw_uuid
from gpu_serde.inventory import Inventory
from gpu_serde.registry import flags
from gpu_serde.text import quoted, safe

Reconstructor = Callable[..., Any]
TYPED = (PayloadError, DeviceNotVisibleError, HandoffError)


def not_visible_error(p: DevicePayload, inv: Inventory, what: str = "GPU") -> DeviceNotVisibleError:
    """The :class:`DeviceNotVisibleError` for a device payload that ``inv`` cannot resolve
    (``what`` names its role, e.g. a peer). Every text from the payload is escaped."""
    uuid, host = p.canonical_uuid, quoted(p.host)
    role = safe(_inventory.role) + ", " if _inventory.role else ""
    name = quoted(p.name) if p.name else "name unknown"
    msg = (
        f"{what} {uuid} ({name}) is not visible in this process.\n"
        f"It was sent from host {host}, pid {p.pid}, where it was CUDA device {p.ordinal}.\n"
        f"Here: {role}host {quoted(inv.host)}, pid {os.getpid()}, {inv.describe()}\n"
        f"Run this work where that GPU is visible: on host {host}, in a worker whose "
        f"CUDA_VISIBLE_DEVICES includes {uuid} (Ray: a task or actor given that GPU; Dask: a "
        "worker started with it), or send what lives on a GPU this process can see."
    )
    return DeviceNotVisibleError(msg, uuid=uuid, host=safe(p.host), visible=inv.devices)


class Unseen(Exception):
    """Raised by a device rebuild whose GPU is not visible here; the guard turns it into an
    :class:`UnresolvedDevice` (the message is built only if the placeholder is used)."""

    def __init__(self, payload: bytes, inv: Inventory) -> None:
        super().__init__("GPU not visible here")
        self.payload, self.inventory = payload, inv


class UnresolvedDevice:
    """Stands in for a received ``Device`` whose GPU this process cannot see.

    It re-pickles to the payload it came from (so a scheduler or a CPU-only hop passes it on
    unchanged); any public attribute, ``int()``, ``operator.index()`` or :func:`gpu_serde.resolve`
    raises :class:`DeviceNotVisibleError` saying which GPU was meant and what this process sees.
    Two placeholders of the same GPU are equal and hash alike.
    """

    __slots__ = ("_inventory", "_payload", "_rebuild")

    def __init__(self, rebuild: Reconstructor, payload: bytes, inv: Inventory) -> None:
        self._rebuild, self._payload, self._inventory = rebuild, payload, inv

    def _error(self) -> DeviceNotVisibleError:
        return not_visible_error(decode_device(self._payload), self._inventory)

    def __reduce__(self) -> tuple[Reconstructor, tuple[bytes]]:
        return (self._rebuild, (self._payload,))

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("_"):
            raise AttributeError(name)
        raise self._error()

    def __int__(self) -> NoReturn:
        raise self._error()

    def __index__(self) -> NoReturn:
        raise self._error()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UnresolvedDevice) and raw_uuid(other._payload) == raw_uuid(
            self._payload
        )

    def __hash__(self) -> int:
        return hash(raw_uuid(self._payload))

    def __dask_tokenize__(self) -> tuple[str, bytes]:
        return ("cuda.core.Device", raw_uuid(self._payload))

    def __repr__(self) -> str:
        p = decode_device(self._payload)
        return (
            f"<UnresolvedDevice {p.canonical_uuid} ({quoted(p.name)}) from host "
            f"{quoted(p.host)}: not visible in this process>"
        )


class UnresolvedObject:
    """Stands in for a received object that cannot be rebuilt in this process: memory from
    another host or a gone exporter, a payload of another gpu_serde version, a malformed one.

    It re-pickles to the arguments it came with; any public attribute, an operator, an index,
    ``numpy.asarray``, a torch function given it, or :func:`gpu_serde.resolve` raises the reason
    (a ``HandoffError`` kind, ``DeviceNotVisibleError`` or ``PayloadError``).
    """

    __slots__ = ("_args", "_error_", "_kind", "_rebuild")

    def __init__(
        self, kind: str, rebuild: Reconstructor, args: tuple[Any, ...], error: Exception
    ) -> None:
        self._kind, self._rebuild, self._args, self._error_ = kind, rebuild, args, error

    def _error(self) -> Exception:
        """A fresh copy of the reason, to raise: raising one object again and again would grow
        its traceback, and keep every caller's frame alive, without limit."""
        try:
            error = copy.copy(self._error_)
        except Exception:
            error = self._error_
        return error.with_traceback(None)

    def __reduce__(self) -> tuple[Reconstructor, tuple[Any, ...]]:
        return (self._rebuild, self._args)

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("_"):
            raise AttributeError(name)
        raise self._error()

    def _raise(self, *args: object, **kwargs: object) -> NoReturn:
        """Used as a tensor or an array is (an operator, an index, ``numpy.asarray``): the
        reason, not a ``TypeError`` about this class."""
        raise self._error()

    __add__ = __radd__ = __iadd__ = __sub__ = __rsub__ = __isub__ = _raise
    __mul__ = __rmul__ = __imul__ = __matmul__ = __rmatmul__ = __imatmul__ = _raise
    __truediv__ = __rtruediv__ = __itruediv__ = __floordiv__ = __rfloordiv__ = _raise
    __mod__ = __rmod__ = __pow__ = __rpow__ = __lshift__ = __rlshift__ = _raise
    __rshift__ = __rrshift__ = __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = _raise
    __neg__ = __pos__ = __abs__ = __invert__ = __getitem__ = __setitem__ = __array__ = _raise

    @classmethod
    def __torch_function__(
        cls, func: object, types: object, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> NoReturn:
        """A torch function given a placeholder (``torch.sum(x)``, ``param.copy_(x)``): the
        first placeholder's reason."""
        for arg in (*args, *(kwargs or {}).values()):
            for item in arg if isinstance(arg, list | tuple) else (arg,):
                if isinstance(item, UnresolvedObject):
                    raise item._error()
        raise TypeError(f"{func} was given a gpu_serde placeholder")  # (not reached)

    def __repr__(self) -> str:
        reason = _first_line(self._error_)
        return f"<UnresolvedObject {self._kind}: {type(self._error_).__name__}: {reason}>"


def _first_line(error: Exception) -> str:
    """The first line of ``error``'s message, escaped (a repr stays on one line)."""
    try:
        text = str(error)
    except Exception:
        text = ""
    first, _, rest = text.partition("\n")
    return safe(first) + (" ..." if rest else "")


def placeholder_uuid(placeholder: UnresolvedDevice) -> str:
    """The canonical UUID (``GPU-...``/``MIG-...``) of the GPU a placeholder names: what
    routing reads (the placeholder itself raises on any public attribute)."""
    return decode_device(placeholder._payload).canonical_uuid


@dataclass(frozen=True)
class Kind:
    """How one reconstructor rebuilds: its body, and what a failure is called."""

    name: str  #: what the payload is, in messages ("Device", "Buffer", ...)
    body: Callable[[object], Any]  #: validates the payload (PayloadError) and rebuilds it
    fallback: type[Exception] = HandoffError  #: the typed error an unexpected exception becomes
    describe: Callable[[object], str] | None = None  #: a finer name from a valid payload


_kinds: dict[Reconstructor, Kind] = {}


def define(reconstructor: Reconstructor, kind: Kind) -> None:
    """Name how ``reconstructor`` (a :mod:`gpu_serde.wire` name) rebuilds under the guard."""
    _kinds[reconstructor] = kind


def body(reconstructor: Reconstructor) -> Callable[[object], Any]:
    """The rebuild body that :func:`define` named for ``reconstructor``, unguarded: it raises the
    typed error instead of giving a placeholder (for a payload that nests another).

    Raises:
        KeyError: nothing was defined for it.
    """
    return _kinds[reconstructor].body


def _typed(kind: Kind, exc: Exception) -> Exception:
    if isinstance(exc, TYPED):
        return exc
    return kind.fallback(
        f"rebuilding a {kind.name} failed here: {type(exc).__name__}: {_first_line(exc)}"
    )


def _name(kind: Kind, args: tuple[Any, ...]) -> str:
    if kind.describe is not None and len(args) == 1:
        try:
            return kind.describe(args[0])
        except Exception:
            pass
    return kind.name


#: What a forwarder's placeholder raises when used (:func:`gpu_serde.registry.forward_only`).
_FORWARDED = HandoffError(
    "this process only forwards gpu_serde objects (a Dask scheduler started by the dask CLI "
    "with gpu_serde preloaded): it passes them on as they came and uses none; use it in a "
    "worker or the client"
)


def rebuild(reconstructor: Reconstructor, args: tuple[Any, ...]) -> Any:
    """Run ``reconstructor``'s body on ``args`` under the one guard; never raises except under
    ``install(strict=True)`` (then: the typed error)."""
    if flags.forward_only:  # passed on as it came, never used here (a Dask scheduler)
        kind = _kinds.get(reconstructor) or Kind("gpu_serde object", lambda p: None, PayloadError)
        return UnresolvedObject(_name(kind, args), reconstructor, args, _FORWARDED)
    try:
        if len(args) == 1:
            return _kinds[reconstructor].body(args[0])  # KeyError: nothing defined (a bug)
        raise PayloadError(
            f"invalid gpu_serde payload: gpu_serde.wire.{reconstructor.__name__} takes one "
            f"payload, got {len(args)} arguments (this pickle was not made by gpu_serde)"
        )
    except Unseen as unseen:
        placeholder = UnresolvedDevice(reconstructor, unseen.payload, unseen.inventory)
        if flags.strict:
            raise placeholder._error() from None
        return placeholder
    except Exception as exc:
        kind = _kinds.get(reconstructor) or Kind("gpu_serde object", lambda p: None, PayloadError)
        error = _typed(kind, exc)
        if flags.strict:
            raise error from (None if error is exc else exc)
        return UnresolvedObject(_name(kind, args), reconstructor, args, error)


def resolve(obj: Any) -> Any:
    """Return a received object as the real thing, or raise if it cannot be used here.

    Raises:
        DeviceNotVisibleError: ``obj`` is a placeholder (:class:`~gpu_serde.UnresolvedDevice`);
            the message says which GPU was meant, where it lives, and what this process sees.
        HandoffError: ``obj`` is an :class:`~gpu_serde.UnresolvedObject` for memory: the
            subclass says why (``OtherHostError``, ``ExporterGoneError``, ``TokenRefusedError``),
            or it raises ``DeviceNotVisibleError`` for memory of a GPU not visible here.
        PayloadError: ``obj`` came from a malformed payload, or from a gpu_serde that writes
            another payload version.

    A ``Device`` comes back as the calling thread's object for the same GPU (cuda.core keeps one
    per thread; call ``resolve`` in the thread that uses it). Lists, tuples (named ones too) and
    dicts are resolved item by item, nested ones too, and raise for the first placeholder in
    them; one that holds a ``Device`` comes back as a new container of the same type, any other
    as itself. Every other object is returned unchanged.
    """
    return _resolve(obj, set())


def _resolve(obj: Any, busy: set[int]) -> Any:
    if isinstance(obj, (UnresolvedDevice, UnresolvedObject)):
        raise obj._error()
    if isinstance(obj, Device):
        return Device(obj.device_id)  # this thread's object (Dask unpickles in another thread)
    kind = type(obj)
    if kind not in (list, tuple, dict) and not (isinstance(obj, tuple) and hasattr(kind, "_make")):
        return obj
    if id(obj) in busy:  # a container that holds itself
        return obj
    busy.add(id(obj))
    try:
        if kind is dict:
            items: Any = {k: _resolve(v, busy) for k, v in obj.items()}
            same = all(items[k] is v for k, v in obj.items())
        else:
            items = [_resolve(v, busy) for v in obj]
            same = all(a is b for a, b in zip(items, obj, strict=True))
    finally:
        busy.discard(id(obj))
    if same:
        return obj
    return kind(items) if kind in (list, tuple, dict) else kind._make(items)  # a named tuple
