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


def test_the_testing_guides_buffer_pipeline_example_runs():
    import re
    import subprocess
    import sys
    from pathlib import Path

    from helpers import env_without_driver

    text = (Path(__file__).parents[1] / "docs" / "testing.md").read_text()
    section = text.split("## Testing a pipeline that passes buffers", 1)[1]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = env_without_driver()  # the example activates the simulated GPUs itself
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.stdout.strip() == "the worker read every byte", done.stderr[-3000:]


@pytest.mark.parametrize(
    ("containing", "prints"),
    [
        ("LocalCluster", "the worker read three buffers of one region"),
        ("ArenaFullError", "ArenaMemoryResource(device, size=16777216)"),
    ],
)
def test_the_arena_examples_in_the_memory_guide_run(containing, prints):
    from doc_blocks import python_blocks, run_block

    from helpers import env_without_driver

    blocks = [b for b in python_blocks("docs/memory.md", "ArenaMemoryResource") if containing in b]
    assert len(blocks) == 1
    env = env_without_driver()  # the example activates the simulated GPUs itself
    env.pop("CUDA_VISIBLE_DEVICES", None)
    assert prints in run_block(blocks[0], env)
