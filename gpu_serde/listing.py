"""What ``dir()`` lists for gpu_serde's packages whose ``__init__`` does work of its own
(:mod:`gpu_serde.testing`, :mod:`gpu_serde.tensors`): what the package defines and offers, not
the names it imports to do that work (``os``, ``re``, ``Any``, ...)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def lister(namespace: Mapping[str, Any]) -> Callable[[], list[str]]:
    """A module ``__dir__`` (PEP 562) for the module whose globals are ``namespace``; call it
    right after the module's imports, which it then leaves out of ``dir()``. ``dir()`` lists
    what the module defines after that point (constants, functions, classes, private names
    too), its ``__all__``, its dunders, and its submodules."""
    imported = frozenset(namespace)
    prefix = f"{namespace['__name__']}."

    def listing() -> list[str]:
        public = set(namespace.get("__all__", ()))
        return sorted(
            name
            for name, value in list(namespace.items())
            if name not in imported
            or name in public
            or name.startswith("__")
            or (isinstance(value, ModuleType) and value.__name__.startswith(prefix))
        )

    return listing
