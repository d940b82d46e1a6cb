"""Run code when a library is imported, without importing it: how gpu_serde registers its torch
and CuPy reducers only once the user has imported torch or CuPy.

distributed registers its per-library serializers the same way in spirit
(``dask_serialize.register_lazy("torch")``), but pickling has no dispatch to hook: ``copyreg``
and ``multiprocessing`` need the class itself. So :func:`when_imported` runs a callback at once
if the library is imported already, and otherwise puts one finder at the front of
``sys.meta_path`` (the standard import hook, ``importlib``'s public API) that, for the names
waited for only, wraps the loader that the other finders found: the module is executed by its
own loader, then the callbacks run, and the module's ``__loader__`` and ``__spec__.loader`` are
its own again. Every other import passes through untouched. A callback that fails is logged and
never breaks the user's import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_waiting: dict[str, list[Callback]] = {}
_finding = threading.local()  # the names this thread is finding (the finder asks the others)
logger = logging.getLogger("gpu_serde")


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once the top-level module ``name`` is imported: now, if it is
    already, else right after its import completes (in the importing thread). Imports nothing."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _waiting.setdefault(name, []).append(callback)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
            return
    _call(name, callback, module)


def waiting() -> list[str]:
    """The names still waited for (not imported yet)."""
    with _lock:
        return sorted(n for n, callbacks in _waiting.items() if callbacks)


def _call(name: str, callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:
        logger.warning("gpu_serde: registering for %s failed", name, exc_info=True)


def _imported(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _waiting.pop(name, [])
    for callback in callbacks:
        _call(name, callback, module)


class _Loader(importlib.abc.Loader):
    """The found loader, which runs the callbacks after the module has executed."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader, self._name = loader, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader  # the module's own loader, as if never wrapped
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _imported(self._name, sys.modules.get(self._name, module))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a name waited for, asks the other finders and wraps the
    loader they found."""

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:  # a dict lookup: every other import pays only this
            return None
        busy: set[str] = getattr(_finding, "names", set())
        if fullname in busy:
            return None
        _finding.names = busy | {fullname}
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:
            return None
        finally:
            _finding.names = busy
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, fullname)
        return spec
