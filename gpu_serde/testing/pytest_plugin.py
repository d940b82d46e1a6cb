"""pytest fixtures for simulated GPUs (registered through the ``pytest11`` entry point).

``simulated_gpus``: four simulated GPUs active in the test process (session scope), all visible.
``sim_env``: a factory ``sim_env(visible=None, gpus=None) -> dict`` of child environments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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
