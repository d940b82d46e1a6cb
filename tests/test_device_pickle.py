"""In one process: a Device pickles by UUID and comes back as the very same object."""

import collections
import concurrent.futures
import copyreg
import multiprocessing.reduction
import pickle

import cloudpickle
import pytest
from cuda.core import Device

import gpu_serde
from gpu_serde.format.device import decode_device
from gpu_serde.wire import dev


def test_visible_devices_lists_the_simulated_gpus_in_order(simulated_gpus):
    seen = gpu_serde.visible_devices()
    assert [d.uuid for d in seen] == [g.uuid for g in simulated_gpus]
    assert [d.ordinal for d in seen] == [0, 1, 2, 3]
    assert seen[2].pci_bus_id == simulated_gpus[2].pci_bus_id


@pytest.mark.parametrize("module", [pickle, cloudpickle], ids=["pickle", "cloudpickle"])
def test_round_trip_returns_the_identical_device(installed, module):
    d = Device(2)
    assert module.loads(module.dumps(d)) is d


def test_multiprocessing_pickler_also_sends_the_uuid(installed):
    blob = bytes(multiprocessing.reduction.ForkingPickler.dumps(Device(1)))
    assert installed[1].uuid[4:].replace("-", "") in pickle.loads(blob).uuid.replace("-", "")
    assert b"gpu_serde.wire" in blob


def test_the_payload_names_the_gpu_by_uuid_not_ordinal(installed):
    reducer = copyreg.dispatch_table[Device]
    fn, (payload,) = reducer(Device(3))
    assert fn is dev
    p = decode_device(payload)
    assert p.canonical_uuid == installed[3].uuid
    assert p.ordinal == 3


def test_install_is_idempotent_and_uninstall_restores_cuda_cores_pickle(simulated_gpus):
    gpu_serde.install()
    gpu_serde.install()
    assert b"gpu_serde" in pickle.dumps(Device(0))
    gpu_serde.uninstall()
    assert b"gpu_serde" not in pickle.dumps(Device(0))
    assert Device not in copyreg.dispatch_table
    assert Device not in multiprocessing.reduction.ForkingPickler._extra_reducers
    gpu_serde.uninstall()


def test_payloads_still_unpickle_after_uninstall(simulated_gpus):
    gpu_serde.install()
    blob = pickle.dumps(Device(1))
    gpu_serde.uninstall()
    assert pickle.loads(blob) is Device(1)
    assert b"gpu_serde" not in pickle.dumps(Device(1))  # no silent re-install after opting out


def test_resolve_passes_real_objects_through(installed):
    d = Device(0)
    assert gpu_serde.resolve(d) is d
    assert gpu_serde.resolve(42) == 42


def test_resolve_gives_this_threads_devices_inside_containers(installed):
    Pair = collections.namedtuple("Pair", "device n")
    with concurrent.futures.ThreadPoolExecutor(1) as other_thread:  # as Dask unpickles
        received = other_thread.submit(
            lambda: {"devices": [Device(1), Pair(Device(2), 7)], "n": (3,)}
        ).result()
    assert received["devices"][0] is not Device(1)

    got = gpu_serde.resolve(received)

    assert got["devices"][0] is Device(1)
    assert type(got["devices"][1]) is Pair and got["devices"][1] == (Device(2), 7)
    assert got["devices"][1].device is Device(2)
    assert got["n"] is received["n"]  # nothing to change: the same object


def test_resolve_returns_a_container_without_gpu_objects_as_itself(installed):
    cyclic: list = [1, "two"]
    cyclic.append(cyclic)
    data = {"a": [1, 2], "b": cyclic}
    assert gpu_serde.resolve(data) is data
    assert gpu_serde.resolve(cyclic) is cyclic


def test_the_dask_preload_keeps_a_users_strict_mode_and_warns(simulated_gpus):
    import asyncio
    import logging

    import gpu_serde.dask
    from gpu_serde import inventory, registry

    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    lines = Lines()
    logging.getLogger("gpu_serde").addHandler(lines)
    gpu_serde.install(strict=True)
    try:
        # as `dask scheduler --preload gpu_serde.dask` calls it (and awaits it)
        asyncio.run(gpu_serde.dask.dask_setup(object()))
        assert registry.flags.strict is True
        assert any("strict=True under Dask" in line for line in lines.lines)
    finally:
        logging.getLogger("gpu_serde").removeHandler(lines)
        gpu_serde.uninstall()
        inventory.set_role("")
