"""The stand-in NVML: the same GPUs as the stand-in driver, all of the host's whatever
CUDA_VISIBLE_DEVICES says (as the real NVML does), and enough of it for Ray to count them.

NVML is read through Ray's own copy of pynvml, the one its GPU detection uses.
"""

import pytest

from gpu_serde.testing import child_env
from helpers import run_child

NVML_LIST = """
import ray._private.thirdparty.pynvml as nvml
nvml.nvmlInit()
handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
uuids = [nvml.nvmlDeviceGetUUID(h) for h in handles]
report(
    nvml=uuids,
    cuda=[d.uuid for d in gpu_serde.visible_devices()],
    by_uuid=[nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(u)) for u in uuids],
    by_pci=[
        nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByPciBusId(nvml.nvmlDeviceGetPciInfo(h).busId))
        for h in handles
    ],
    names=[nvml.nvmlDeviceGetName(h) for h in handles],
    mig=[nvml.nvmlDeviceGetMigMode(h)[0] for h in handles],
)
nvml.nvmlShutdown()
"""


@pytest.fixture(scope="module")
def nvml_with_two_visible(simulated_gpus):
    """What NVML and CUDA list in a child whose CUDA_VISIBLE_DEVICES names GPUs 2 and 0."""
    g = simulated_gpus
    return run_child(NVML_LIST, child_env(g, [g[2].uuid, g[0].uuid]))


@pytest.fixture(scope="module")
def nvml_with_all_visible(simulated_gpus):
    """What NVML and CUDA list in a child with CUDA_VISIBLE_DEVICES unset."""
    return run_child(NVML_LIST, child_env(simulated_gpus))


def test_nvml_lists_every_gpu_of_the_host_whatever_cuda_visible_devices_says(
    nvml_with_two_visible, simulated_gpus
):
    assert nvml_with_two_visible["nvml"] == [g.uuid for g in simulated_gpus]


def test_cuda_in_the_same_process_sees_only_the_gpus_cuda_visible_devices_names(
    nvml_with_two_visible, simulated_gpus
):
    g = simulated_gpus
    assert nvml_with_two_visible["cuda"] == [g[2].uuid, g[0].uuid]


def test_nvml_numbers_the_gpus_as_the_driver_does_with_cuda_visible_devices_unset(
    nvml_with_all_visible,
):
    assert nvml_with_all_visible["nvml"] == nvml_with_all_visible["cuda"]


def test_nvml_finds_each_gpu_by_its_uuid_and_its_pci_bus_id(nvml_with_all_visible):
    assert nvml_with_all_visible["by_uuid"] == nvml_with_all_visible["by_pci"] == [0, 1, 2, 3]


def test_nvml_names_each_gpu_as_the_driver_does(nvml_with_all_visible, simulated_gpus):
    assert nvml_with_all_visible["names"] == [g.name for g in simulated_gpus]


def test_nvml_reports_mig_disabled_on_every_gpu(nvml_with_all_visible):
    assert nvml_with_all_visible["mig"] == [0, 0, 0, 0]


def test_a_malformed_gpu_list_fails_nvml_init_with_an_nvml_error(simulated_gpus):
    env = dict(child_env(simulated_gpus), GPU_SERDE_SIM_GPUS="not-a-gpu|x|0000:00:00.0")
    seen = run_child(
        """
import ray._private.thirdparty.pynvml as nvml
try:
    nvml.nvmlInit()
    report(error=None)
except nvml.NVMLError as exc:
    report(error=type(exc).__name__)
""",
        env,
    )
    assert seen["error"] == "NVMLError_Unknown"


RAY_COUNTS = """
import ray, gpu_serde.ray
from cuda.core import Device
# "local": start a cluster here, never join one that `ray start` left on this host
gpu_serde.ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_gpus=2, max_retries=0)
def where(device):
    return gpu_serde.resolve(device).uuid

report(
    gpus=ray.cluster_resources().get("GPU"),
    types=sorted(k for k in ray.cluster_resources() if k.startswith("accelerator_type:")),
    resolved=ray.get(where.remote(Device(1))),
    sent=Device(1).uuid,
)
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_on_two_of_four(simulated_gpus):
    """`ray.init()` with no num_gpus, on a host of four GPUs with CUDA_VISIBLE_DEVICES naming two."""
    g = simulated_gpus
    return run_child(RAY_COUNTS, child_env(g, [g[3].uuid, g[1].uuid]), timeout=180)


def test_ray_counts_the_gpus_cuda_visible_devices_names_without_num_gpus(ray_on_two_of_four):
    assert ray_on_two_of_four["gpus"] == 2.0


def test_ray_labels_the_node_with_the_simulated_gpu_model(ray_on_two_of_four):
    assert ray_on_two_of_four["types"] == ["accelerator_type:H200"]


def test_a_ray_task_given_the_detected_gpus_resolves_the_drivers_device_as_the_same_gpu(
    ray_on_two_of_four,
):
    assert ray_on_two_of_four["resolved"] == ray_on_two_of_four["sent"]
