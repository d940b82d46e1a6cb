"""Test tiers: the CPU tier runs on simulated GPUs; ``pytest -m gpu`` runs on a real GPU."""

from __future__ import annotations

import os

import pytest

# Keep every Ray address on loopback: with this set, Ray (read at import) uses 127.0.0.1 as the node
# address instead of the host's outward-facing interface. Multi-node clusters built with
# ray.cluster_utils.Cluster still work; `ray start` worker nodes would not (no test starts one).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray before 2.60 hides every GPU from a num_gpus=0 task (CUDA_VISIBLE_DEVICES=""); 2.60 leaves them
# visible. The tests expect 2.60's behaviour, which this gives on every supported Ray (>= 2.50).
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
# Ray 2.60's local ray.init() writes a token to ~/.ray/auth_token and turns token authentication on
# (and then so does every later plain `ray start --head` of this user): the tests leave the user's
# home alone. Tests of token authentication set their own HOME and RAY_AUTH_MODE.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


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


@pytest.fixture
def installed(simulated_gpus):
    """gpu_serde installed on the simulated GPUs for one test (GPU-tier modules define their own)."""
    import gpu_serde

    gpu_serde.install()
    yield simulated_gpus
    gpu_serde.uninstall()


@pytest.fixture(scope="module", params=["sim", pytest.param("real", marks=pytest.mark.gpu)])
def tier(request: pytest.FixtureRequest):
    """A memory test runs twice: on simulated GPUs (CPU tier) and on the real GPU (``-m gpu``)."""
    from memtier import make_tier

    return make_tier(request)


# Once pytest has reported, the test process ends with its exit status at once, without the
# interpreter's teardown, so that a run whose tests all passed does not fail on a crash there:
# - cuda-core 1.2.0's CUDA 12 build (with cuda-bindings 12.x; the version matrix's low leg)
#   crashes at interpreter exit when a thread made a device current
#   (memtier.exit_crashes_at_teardown; docs/versions.md), in every process;
# - the CPU tier's main test process (not an xdist worker), which hosts in-process brokers, Ray
#   drivers, Dask clusters, torch and the simulated driver at once, crashed at exit once in several
#   runs (SIGSEGV after "860 passed", no traceback; scripts/test now turns faulthandler on for the
#   next one). Exiting processes are what the lifetime tests test, in child processes of their
#   own, which end normally.
_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    from memtier import exit_crashes_at_teardown

    if _exit_status and (exit_crashes_at_teardown() or not hasattr(config, "workerinput")):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
