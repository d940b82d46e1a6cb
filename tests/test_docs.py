"""Every public name says what it does."""

import importlib
import inspect

import pytest

MODULES = [
    "gpu_serde",
    "gpu_serde.ray",
    "gpu_serde.dask",
    "gpu_serde.testing",
    "gpu_serde.pools",
    "gpu_serde.handoff",
    "gpu_serde.placeholders",
    "gpu_serde.registry",
    "gpu_serde.wire",
    "gpu_serde.text",
    "gpu_serde.vmm",
    "gpu_serde.broker",
    "gpu_serde.broker_client",
    "gpu_serde.hostid",
    "gpu_serde.hostcopy",
    "gpu_serde.dask_transfer",
    "gpu_serde.ray_transport",
    "gpu_serde.arena",
    "gpu_serde.regions",
    "gpu_serde.ranges",
]


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
    assert list(public_names(module))  # the check looked at something
