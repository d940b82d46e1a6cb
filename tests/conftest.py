"""Test tiers: the CPU tier runs on simulated GPUs; ``pytest -m gpu`` runs on a real GPU."""

from __future__ import annotations

import pytest


def gpu_tier(config: pytest.Config) -> bool:
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr and "not gpu" not in expr


@pytest.fixture(scope="session")
def real_gpu(request: pytest.FixtureRequest):
    """The real GPU tier's device list; fails (never skips) when no real GPU is visible."""
    from gpu_serde.inventory import inventory

    inv = inventory()
    if inv.simulated or not inv.devices:
        pytest.fail(f"the gpu tier needs a real GPU; this process sees: {inv.describe()}")
    return list(inv.devices)


@pytest.fixture(scope="session", autouse=True)
def _tier_driver(request: pytest.FixtureRequest):
    """The CPU tier activates simulated GPUs before any test can initialise CUDA."""
    if not gpu_tier(request.config):
        request.getfixturevalue("simulated_gpus")
