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
