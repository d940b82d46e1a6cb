"""Every public name says what it does."""

import ast
import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

import pytest

#: modules that import an optional library: where it is missing, their source is read instead
OPTIONAL = {"gpu_serde.tensors.torch": "torch", "gpu_serde.tensors.cupy": "cupy"}


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


def undocumented_in_source(module_name: str) -> list[str]:
    """The public top-level functions and classes of a module's source without a docstring."""
    spec = importlib.util.find_spec(module_name)
    tree = ast.parse(Path(spec.origin).read_text())
    assert ast.get_docstring(tree)
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [
        node.name
        for node in tree.body
        if isinstance(node, defs) and not node.name.startswith("_") and not ast.get_docstring(node)
    ]


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_a_docstring(module_name):
    library = OPTIONAL.get(module_name)
    if library is not None and importlib.util.find_spec(library) is None:
        assert undocumented_in_source(module_name) == []  # without importing it
        return
    module = importlib.import_module(module_name)
    assert module.__doc__
    missing = [name for name, obj in public_names(module) if not inspect.getdoc(obj)]
    assert missing == []


def test_the_docstring_check_sees_the_whole_package():
    assert {"gpu_serde.memory.lifetime", "gpu_serde.dask.hosts", "gpu_serde.ray.transport"} <= set(
        MODULES
    )
    importable = [m for m in MODULES if m not in OPTIONAL]
    assert sum(len(list(public_names(importlib.import_module(m)))) for m in importable) > 100


@pytest.mark.parametrize("module_name", ["gpu_serde.testing", "gpu_serde.tensors"])
def test_dir_of_a_public_package_lists_what_it_offers_not_what_it_imports(module_name):
    module = importlib.import_module(module_name)
    listed = set(dir(module))
    assert set(module.__all__) <= listed
    assert {"__all__", "__doc__", "__path__"} <= listed  # and what every module has
    assert not {"os", "re", "Any", "Path", "annotations", "functools", "quoted"} & listed


def test_dir_of_gpu_serde_testing_keeps_the_constants_it_defines():
    import gpu_serde.testing

    assert {"SPEC_ENV", "MAX_GPUS", "make_gpus"} <= set(dir(gpu_serde.testing))
