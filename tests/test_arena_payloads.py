"""Arena payloads on the CPU tier: malformed ones are PayloadErrors, and every failure to rebuild
(another host, a GPU not visible here, a gone exporter) is a placeholder with the typed error that
forwards unchanged; never an exception at unpickling, unless strict."""

from __future__ import annotations

import pickle

import pytest
from cuda.core import Device

import gpu_serde
from gpu_serde import (
    DeviceNotVisibleError,
    ExporterGoneError,
    OtherHostError,
    PayloadError,
    UnresolvedObject,
)
from gpu_serde.device import device_payload
from gpu_serde.format.device import encode_device
from gpu_serde.format.memory import decode_abuf, decode_region
from gpu_serde.hostid import host_id
from gpu_serde.wire import abuf, arena

NOBODY = "@gpu_serde-test-nobody-listens"


def region(dev: bytes, boot: bytes = host_id(), size: int = 4 << 20) -> tuple:
    return (1, dev, boot, NOBODY, bytes(range(16)), bytes(range(16, 32)), size, bytes(64))


def buffer(region_p: tuple, offset: int = 0, size: int = 1 << 20) -> tuple:
    return (1, region_p, offset, size, bytes(range(32, 48)))


@pytest.fixture
def visible_dev(installed) -> bytes:
    return device_payload(Device(1))


def test_a_well_formed_payload_decodes(visible_dev):
    p = decode_abuf(buffer(region(visible_dev), offset=4096))
    assert (p.offset, p.size, p.region.size, p.region.address) == (4096, 1 << 20, 4 << 20, NOBODY)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        (0, 2, "version 2"),
        (1, None, "expected bytes"),
        (2, b"short", "boot id"),
        (3, "/tmp/socket", "broker address"),
        (4, b"x", "16 bytes each"),
        (6, 0, "region size"),
        (6, "4096", "region size"),
        (7, bytes(63), "IPC event handle must be 64 bytes"),
    ],
)
def test_region_payload_defects_are_named(visible_dev, field, value, says):
    bad = list(region(visible_dev))
    bad[field] = value
    with pytest.raises(PayloadError, match=says):
        decode_region(tuple(bad))


@pytest.mark.parametrize(
    ("offset", "size", "says"),
    [
        (-1, 1, "offset must be an int >= 0"),
        (0, 0, "size a positive int"),
        (True, 1, "offset must be an int"),
        ((4 << 20) - 4096, 8192, "does not lie inside its region"),
        (1 << 70, 1, "does not lie inside its region"),
    ],
)
def test_a_buffer_outside_its_region_is_a_payload_error(visible_dev, offset, size, says):
    with pytest.raises(PayloadError, match=says):
        decode_abuf(buffer(region(visible_dev), offset=offset, size=size))


@pytest.mark.parametrize("rebuild", [arena, abuf], ids=["arena", "abuf"])
def test_a_malformed_payload_is_a_placeholder_that_forwards_unchanged(installed, rebuild):
    got = rebuild((1, "not", "a", "payload"))
    assert isinstance(got, UnresolvedObject)
    assert pickle.loads(pickle.dumps(got))._args == got._args
    with pytest.raises(PayloadError):
        gpu_serde.resolve(got)


@pytest.mark.parametrize("rebuild", [arena, abuf], ids=["arena", "abuf"])
def test_memory_from_another_host_is_an_other_host_placeholder(visible_dev, rebuild):
    p = region(visible_dev, boot=bytes(16))
    got = rebuild(p if rebuild is arena else buffer(p))
    with pytest.raises(OtherHostError, match="ArenaMemoryResource"):
        gpu_serde.resolve(got)
    assert "\n" not in repr(got)


def test_a_region_on_a_gpu_not_visible_here_names_the_gpu(installed):
    stranger = encode_device(bytes.fromhex("ab" * 16), False, 0, 1, "node-x", "NVIDIA H200")
    with pytest.raises(DeviceNotVisibleError, match="abababab"):
        gpu_serde.resolve(abuf(buffer(region(stranger))))


def test_a_gone_exporter_is_an_exporter_gone_placeholder(visible_dev):
    with pytest.raises(ExporterGoneError, match="gone"):
        gpu_serde.resolve(abuf(buffer(region(visible_dev))))


def test_strict_mode_raises_at_unpickling(visible_dev):
    blob = pickle.dumps(
        UnresolvedObject("x", abuf, (buffer(region(visible_dev, bytes(16))),), RuntimeError())
    )
    gpu_serde.install(strict=True)
    with pytest.raises(OtherHostError):
        pickle.loads(blob)
