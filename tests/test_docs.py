"""Every public name says what it does."""

import importlib
import inspect
import pkgutil

import pytest


def _modules() -> list[str]:
    """Every module of the package (``__main__`` runs the command line when imported)."""
    import gpu_serde

    names = ["gpu_serde"]
    for info in pkgutil.walk_packages(gpu_serde.__path__, "gpu_serde."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    return sorted(names)


MODULES = _modules()


def public_names(module):
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name)
        if (
            inspect.ismodule(obj)
            or not callable(obj)
            or getattr(obj, "__module__", "").split(".")[0] != "gpu_serde"
        ):
            continue
        yield name, obj


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_a_docstring(module_name):
    module = importlib.import_module(module_name)
    assert module.__doc__
    missing = [name for name, obj in public_names(module) if not inspect.getdoc(obj)]
    assert missing == []


def test_the_docstring_check_sees_the_whole_package():
    assert {"gpu_serde.memory.lifetime", "gpu_serde.dask.hosts", "gpu_serde.ray.transport"} <= set(
        MODULES
    )
    assert sum(len(list(public_names(importlib.import_module(m)))) for m in MODULES) > 100
