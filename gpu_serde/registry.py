"""The registry: which type pickles through which reducer, and whether gpu_serde is installed.

It knows no cuda.core type. The type modules hand it their reducers (``dispatch.py`` lists them
all); :func:`install` registers each with :mod:`copyreg` (stdlib pickle, cloudpickle, Ray, Dask)
and with :mod:`multiprocessing`'s ``ForkingPickler`` (replacing cuda.core's own ordinal-based
reducers while installed), and :func:`uninstall` puts back what was there before.

It also holds this process's :data:`flags`: ``strict`` (a payload that cannot be rebuilt
raises at unpickling instead of giving a placeholder), ``auto_install`` (receiving a Device
installs gpu_serde here, until :func:`uninstall` or :func:`install` is called by hand) and
``forward_only`` (:func:`forward_only`: a process that passes objects on without using them).
"""

from __future__ import annotations

import copyreg
import logging
import threading
from collections.abc import Callable
from typing import Any

from gpu_serde import compat

Reducer = Callable[[Any], tuple[Any, ...]]

_lock = threading.Lock()
_reducers: dict[type, Reducer] = {}
_mp_reducers: dict[type, Reducer] = {}  # where multiprocessing's table takes another reducer
_saved: dict[tuple[str, type], Reducer | None] = {}
_installed = False
#: forward_only()'s guard: (object, its type's own reducer) -> what to send
Guard = Callable[[Any, Reducer], tuple[Any, ...]]
_forward: Guard | None = None


class Flags:
    """This process's settings, read by every reconstructor."""

    #: Unpickling raises the typed error at once instead of returning a placeholder.
    strict = False
    #: Receiving a gpu_serde Device installs the reducers here (cleared by install()/uninstall()).
    auto_install = True
    #: Payloads pass through unrebuilt and live objects pickle as an error (:func:`forward_only`).
    forward_only = False


flags = Flags()


def register(cls: type, reducer: Reducer, mp: Reducer | None = None) -> None:
    """Name ``reducer`` as the way ``cls`` pickles while gpu_serde is installed (``mp``, if
    given, in ``multiprocessing``'s table instead: ``torch.multiprocessing`` shares CUDA tensors
    without a copy there, where every other pickler carries them by value).

    Takes effect at the next :func:`install` (or at once, if installed already).
    """
    with _lock:
        _reducers[cls] = reducer
        if mp is not None:
            _mp_reducers[cls] = mp
        if _installed:
            _apply(cls, reducer)


def handled() -> dict[type, Reducer]:
    """A copy of the table: each registered type and its reducer."""
    with _lock:
        return dict(_reducers)


def _tables() -> dict[str, dict[type, Any]]:
    return {"copyreg": copyreg.dispatch_table, "mp": compat.forking_reducers()}


def _apply(cls: type, reducer: Reducer) -> None:
    for name, table in _tables().items():
        _saved.setdefault((name, cls), table.get(cls))
        own = _mp_reducers.get(cls, reducer) if name == "mp" else reducer
        table[cls] = own if _forward is None else _guarded(own, _forward)


def _guarded(own: Reducer, guard: Guard) -> Reducer:
    def reduce(obj: Any) -> tuple[Any, ...]:
        return guard(obj, own)

    return reduce


def forward_only(guard: Guard) -> None:
    """Make this process a forwarder for good (a Dask scheduler: it unpickles task arguments
    only to pickle them again): install gpu_serde, rebuild no payload here (each becomes a
    placeholder that pickles again exactly as it came), and pickle a live object of a handled
    type through ``guard(obj, its type's own reducer)``, which returns what to send. A live
    object that names a GPU came here by another way than gpu_serde's (cuda.core's or torch's
    own pickle, by ordinal): the guard sends it on as an error, raised where it is used, and
    passes others (a CPU tensor) as their own reducer makes them. Types registered later are
    guarded too; :func:`uninstall` puts back what was there before gpu_serde.
    """
    global _forward, _installed
    with _lock:
        _forward = guard
        flags.forward_only = True
        for cls, reducer in _reducers.items():
            _apply(cls, reducer)
        _installed = True
    flags.auto_install = False


def saved(table: str, cls: type) -> Reducer | None:
    """The reducer ``cls`` had in ``table`` (``"copyreg"`` or ``"mp"``) before gpu_serde was
    installed (None: none, or not installed)."""
    with _lock:
        return _saved.get((table, cls))


def install(strict: bool = False) -> None:
    """Make this process pickle ``cuda.core`` objects by GPU UUID.

    Registers a reducer for each type in gpu_serde's table (``Device``; IPC-enabled
    ``DeviceMemoryResource`` and ``PinnedMemoryResource`` pools; ``VirtualMemoryResource`` and its
    options; ``Buffer`` of those resources) with :mod:`copyreg` (stdlib pickle, cloudpickle, Ray,
    Dask) and with :mod:`multiprocessing`'s ``ForkingPickler``. Idempotent: calling it again only
    sets ``strict``.

    Args:
        strict: when True, unpickling a payload this process cannot rebuild (a GPU not visible
            here, memory from another host, a malformed payload) raises the typed error at once
            instead of returning a placeholder. For plain ``multiprocessing``; leave it False under
            Ray and Dask (a reconstructor that raises kills a Dask worker and hides the error type
            from Ray).

    Raises:
        TypeError: ``strict`` is not a bool.
        CompatibilityError: this Python's multiprocessing lacks the table gpu_serde registers in.
    """
    global _installed
    if not isinstance(strict, bool):
        raise TypeError(f"install(strict=...) takes a bool, not {type(strict).__name__}")
    with _lock:
        if not _installed:
            for cls, reducer in _reducers.items():
                _apply(cls, reducer)
            _installed = True
        flags.strict, flags.auto_install = strict, False


def ensure_installed(engine: str = "") -> None:
    """:func:`install`, keeping this process's ``strict`` setting: what the Ray and Dask adapters
    call, so that they never silently undo a user's ``install(strict=True)``. Under an ``engine``
    ("Ray", "Dask") strict mode is logged as a warning, since it makes unpickling raise there."""
    install(flags.strict)
    if engine and flags.strict:
        logging.getLogger("gpu_serde").warning(
            "gpu_serde is installed with strict=True under %s: a payload this process cannot "
            "rebuild raises while unpickling (a Dask worker dies of it; Ray hides the error "
            "type). Call gpu_serde.install() without strict=True to get placeholders instead.",
            engine,
        )


def uninstall() -> None:
    """Undo :func:`install`: ``cuda.core`` objects pickle as cuda.core itself does (by ordinal).

    gpu_serde payloads still unpickle afterwards, but no longer install the reducers by themselves.

    Raises:
        CompatibilityError: this Python's multiprocessing lacks the table gpu_serde registered in.
    """
    global _installed, _forward
    flags.strict, flags.auto_install, flags.forward_only = False, False, False
    with _lock:
        _forward = None
        if not _installed:
            return
        tables = _tables()
        for (name, cls), previous in _saved.items():
            if previous is None:
                tables[name].pop(cls, None)
            else:
                tables[name][cls] = previous
        _saved.clear()
        _installed = False


def is_installed() -> bool:
    """True while the reducers are registered in this process."""
    return _installed
