"""A Device for a GPU this process cannot see becomes a placeholder that raises when used."""

import operator
import pickle

import pytest

import gpu_serde
from gpu_serde import DeviceNotVisibleError, UnresolvedDevice
from gpu_serde.format.device import encode_device
from gpu_serde.inventory import inventory
from gpu_serde.wire import dev

ELSEWHERE = encode_device(bytes.fromhex("deadbeef" * 4), False, 5, 777, "node-b", "NVIDIA H200")


@pytest.fixture
def placeholder(simulated_gpus):
    gpu_serde.install()
    yield pickle.loads(pickle.dumps(dev(ELSEWHERE)))
    gpu_serde.uninstall()


def test_an_unknown_uuid_gives_a_placeholder(placeholder):
    assert isinstance(placeholder, UnresolvedDevice)
    assert "GPU-deadbeef-dead-beef-dead-beefdeadbeef" in repr(placeholder)
    assert "not visible" in repr(placeholder)


def test_the_placeholder_repickles_byte_identical(placeholder):
    original = pickle.dumps(dev(ELSEWHERE))
    assert pickle.dumps(placeholder) == original
    assert pickle.dumps(pickle.loads(original)) == original


@pytest.mark.parametrize(
    "use",
    [
        lambda d: d.uuid,
        lambda d: d.device_id,
        lambda d: d.set_current(),
        int,
        operator.index,
        gpu_serde.resolve,
    ],
    ids=["uuid", "device_id", "set_current", "int", "index", "resolve"],
)
def test_using_the_placeholder_raises_device_not_visible(placeholder, use):
    with pytest.raises(DeviceNotVisibleError) as info:
        use(placeholder)
    err = info.value
    assert err.uuid == "GPU-deadbeef-dead-beef-dead-beefdeadbeef"
    assert err.host == "node-b"
    assert len(err.visible) == 4


def test_the_error_message_says_what_was_meant_and_what_is_here(placeholder, simulated_gpus):
    with pytest.raises(DeviceNotVisibleError) as info:
        gpu_serde.resolve(placeholder)
    text = str(info.value)
    for fact in (
        "GPU-deadbeef-dead-beef-dead-beefdeadbeef",
        "NVIDIA H200",
        "'node-b'",
        "pid 777",
        "CUDA device 5",
        "CUDA_VISIBLE_DEVICES=unset",
        simulated_gpus[0].uuid,
        simulated_gpus[3].uuid,
    ):
        assert fact in text


def test_the_error_survives_pickling_with_its_fields(placeholder):
    with pytest.raises(DeviceNotVisibleError) as info:
        gpu_serde.resolve(placeholder)
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.uuid, again.host, again.visible) == (
        info.value.uuid,
        info.value.host,
        info.value.visible,
    )
    assert str(again) == str(info.value)
    assert isinstance(again, RuntimeError)


def test_strict_mode_raises_at_unpickling(simulated_gpus):
    blob = pickle.dumps(UnresolvedDevice(dev, ELSEWHERE, inventory()))
    gpu_serde.install(strict=True)
    try:
        with pytest.raises(DeviceNotVisibleError, match="deadbeef"):
            pickle.loads(blob)
    finally:
        gpu_serde.uninstall()


def test_private_names_raise_attribute_error_so_tools_keep_working(placeholder):
    import copy

    assert copy.copy(placeholder) == placeholder
    assert not hasattr(placeholder, "_not_there")


def test_resolve_finds_a_placeholder_inside_nested_containers(placeholder):
    received = {"inputs": [1, (2, placeholder)]}
    with pytest.raises(DeviceNotVisibleError) as info:
        gpu_serde.resolve(received)
    assert info.value.uuid == "GPU-deadbeef-dead-beef-dead-beefdeadbeef"
