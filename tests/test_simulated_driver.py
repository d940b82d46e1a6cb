"""The stand-in driver applies CUDA_VISIBLE_DEVICES the way the real one does (FACTS.md)."""

import pytest

from gpu_serde.testing import SimulatedDriverError, child_env, make_gpus
from helpers import run_child

LIST = """
inv = gpu_serde.inventory.inventory() if hasattr(gpu_serde, "inventory") else None
from gpu_serde.inventory import inventory
inv = inventory()
report(uuids=[d.uuid for d in inv.devices], reason=inv.reason, simulated=inv.simulated)
"""

GPUS = make_gpus(2, seed="cvd-rules")
A, B = GPUS[0].uuid, GPUS[1].uuid


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [A, B]),
        ("", []),
        ("1", [B]),
        ("1,0", [B, A]),
        ("0,2", [A]),  # stops at the first invalid entry
        ("2,0", []),
        ("0,0,1", [A]),  # a repeated GPU ends the list too
        (B, [B]),
        (B.upper(), [B]),
        (B[:12], [B]),  # GPU-<unique prefix>
        (B[4:], []),  # the bare UUID, without GPU-, selects nothing
        (f"{B},{A}", [B, A]),
        ("GPU-", []),
    ],
)
def test_cuda_visible_devices_rules(visible, expected):
    got = run_child(LIST, child_env(GPUS, visible))
    assert got["uuids"] == expected
    assert got["simulated"] is bool(expected)
    if not expected:
        assert got["reason"]


def test_an_ambiguous_prefix_selects_nothing():
    twins = make_gpus(40, seed="twins")
    first = twins[0].uuid[:5]  # "GPU-x": shared with other GPUs of 40
    assert sum(g.uuid.startswith(first) for g in twins) > 1
    got = run_child(LIST, child_env(twins, first))
    assert got["uuids"] == []


def test_names_and_pci_ids_are_presented():
    code = """
from cuda.core import Device
d = Device(0)
report(name=d.name, uuid=d.uuid, cc=list(d.compute_capability), pci=gpu_serde.visible_devices()[0].pci_bus_id)
"""
    got = run_child(code, child_env(GPUS, "1"))
    assert got == {"name": GPUS[1].name, "uuid": B[4:], "cc": [9, 0], "pci": GPUS[1].pci_bus_id}


def test_a_bad_gpu_description_is_refused():
    from gpu_serde.testing import SimulatedGPU

    with pytest.raises(ValueError, match="not allowed"):
        SimulatedGPU(A, name="a|b").spec()


def test_it_does_not_shadow_a_real_driver_unless_asked(tmp_path, monkeypatch):
    fake_real = tmp_path / "libcuda.so.1"
    fake_real.write_bytes(b"")  # stands for a real driver found on LD_LIBRARY_PATH
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    with pytest.raises(SimulatedDriverError, match="real CUDA driver"):
        child_env(GPUS, None, base={"LD_LIBRARY_PATH": str(tmp_path)})
    assert child_env(GPUS, None, allow_real_driver=True)["GPU_SERDE_SIM_GPUS"]


# What is not simulated says so: the CUDA runtime, kernels and graphs fail with the driver's code for
# a stub library, and the error names the call (docs/testing.md, "What works and what does not").
NOT_SIMULATED = """
import json, sys
from cuda.core import Device, ObjectCode
dev = Device(0)
dev.set_current()
PTX = b".version 8.0\\n.target sm_90\\n.address_size 64\\n.visible .entry k() { ret; }\\n"
calls = {
    "sync": dev.sync,
    "pci_bus_id": lambda: dev.pci_bus_id,
    "kernel": lambda: ObjectCode.from_ptx(PTX).get_kernel("k"),
    "kernel again": lambda: ObjectCode.from_ptx(PTX).get_kernel("k"),
    "graph": lambda: dev.create_graph_builder().begin_building(),
}
errors = {}
for name, call in calls.items():
    try:
        call()
        errors[name] = None
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(errors))
"""


def run_not_simulated(extra_env: dict[str, str]) -> tuple[dict, str]:
    import json
    import subprocess
    import sys

    env = {**child_env(GPUS, None), **extra_env}
    done = subprocess.run(
        [sys.executable, "-c", NOT_SIMULATED], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, done.stderr
    return json.loads(lines[0][len("RESULT ") :]), done.stderr


@pytest.fixture(scope="module")
def not_simulated() -> tuple[dict, str]:
    return run_not_simulated({})


@pytest.mark.parametrize("call", ["sync", "pci_bus_id"])
def test_the_cuda_runtime_fails_as_a_stub_library(not_simulated, call):
    errors, _ = not_simulated
    assert errors[call].startswith("CUDAError: cudaErrorStubLibrary")


@pytest.mark.parametrize(
    ("call", "function"), [("kernel", "cuLibraryLoadData"), ("graph", "cuStreamBeginCapture")]
)
def test_a_call_that_is_not_simulated_names_itself(not_simulated, call, function):
    errors, _ = not_simulated
    assert errors[call].startswith(
        f"CUDAError: CUDA_ERROR_STUB_LIBRARY (gpu_serde simulated GPU: {function} is not simulated; "
        "docs/testing.md of gpu_serde says what is simulated)"
    )


def test_without_the_trace_the_simulated_driver_prints_nothing(not_simulated):
    _, stderr = not_simulated
    assert "gpu_serde simulated" not in stderr  # callers that try a call and carry on stay quiet


def test_the_trace_has_a_line_for_every_failing_call():
    _, stderr = run_not_simulated({"GPU_SERDE_SIM_TRACE": "1"})
    traced = [
        line for line in stderr.splitlines() if line.startswith("gpu_serde simulated driver:")
    ]
    assert (
        traced.count("gpu_serde simulated driver: cuLibraryLoadData -> 34 CUDA_ERROR_STUB_LIBRARY")
        == 2
    )


def test_a_driver_call_that_is_not_simulated_returns_the_stub_library_code(simulated_gpus):
    from cuda.bindings import driver

    assert driver.cuLibraryLoadData(b"\\0", None, None, 0, None, None, 0)[0] == (
        driver.CUresult.CUDA_ERROR_STUB_LIBRARY
    )


def test_peers_are_not_accessible_and_pci_ids_find_their_device(simulated_gpus):
    from cuda.bindings import driver
    from cuda.core import Device

    assert Device(0).can_access_peer(1) is False
    err, dev = driver.cuDeviceGetByPCIBusId(simulated_gpus[2].pci_bus_id.encode())
    assert (err, int(dev)) == (driver.CUresult.CUDA_SUCCESS, 2)
