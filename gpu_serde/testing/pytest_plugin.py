"""pytest fixtures for simulated GPUs (registered through the ``pytest11`` entry point).

``simulated_gpus``: four simulated GPUs active in the test process (session scope), all visible.
``sim_env``: a factory ``sim_env(visible=None, gpus=None) -> dict`` of child environments.

A test that fails on a call the simulated GPUs do not simulate (the CUDA runtime, kernels, graphs:
an error that names a stub library) gets a section in its report that says so and where to read
more (docs/testing.md, "What works and what does not").
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Generator, Iterable

import pytest

from gpu_serde.testing import SimulatedGPU, activate, child_env, make_gpus


@pytest.fixture(scope="session")
def simulated_gpus() -> list[SimulatedGPU]:
    """Four simulated GPUs, active in this process with ``CUDA_VISIBLE_DEVICES`` unset."""
    gpus = make_gpus(4)
    activate(gpus)
    return gpus


@pytest.fixture
def sim_env(simulated_gpus: list[SimulatedGPU]) -> Callable[..., dict[str, str]]:
    """Factory for child environments on the same simulated GPUs."""

    def make(
        visible: str | Iterable[str | int] | None = None, gpus: list[SimulatedGPU] | None = None
    ) -> dict[str, str]:
        return child_env(simulated_gpus if gpus is None else gpus, visible)

    return make


NOT_SIMULATED = (
    "This test ran on gpu_serde's simulated GPUs, which do not simulate the call that failed: the "
    "CUDA runtime (Device.sync(), Device.pci_bus_id, cuda.bindings.runtime), kernels and graphs "
    "fail with a 'stub library' error (cudaErrorStubLibrary, CUDA_ERROR_STUB_LIBRARY). "
    "help(gpu_serde.testing) says what is simulated, and gpu_serde's docs page 'Testing "
    "without GPUs' (docs/testing.md in its source) what to call instead; "
    "run such tests on a real GPU."
)


def _simulated_here() -> bool:
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    return hasattr(lib, "gpu_serde_simulated_driver")


def not_simulated(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception it came from) is a stub library's error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if "cudaErrorStubLibrary" in text or "CUDA_ERROR_STUB_LIBRARY" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """Add a section to the report of a test that failed on a call that is not simulated."""
    outcome = yield
    report = outcome.get_result()
    excinfo = call.excinfo
    if report.failed and excinfo is not None and not_simulated(excinfo.value) and _simulated_here():
        report.sections.append(("gpu_serde simulated GPUs", NOT_SIMULATED))
