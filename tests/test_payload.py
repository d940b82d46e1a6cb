"""The device payload decoder raises PayloadError, and only PayloadError, for bad input."""

import pickle

import pytest
from cuda.core import Device
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu_serde
from gpu_serde import PayloadError, UnresolvedDevice, UnresolvedObject
from gpu_serde.format.device import MAX_BYTES, decode_device, encode_device, validate_device
from gpu_serde.wire import dev

GOOD = encode_device(bytes(range(16)), False, 3, 4242, "node-a", "NVIDIA H200")


def test_a_good_payload_decodes():
    p = decode_device(GOOD)
    assert (p.version, p.ordinal, p.pid, p.host, p.name) == (1, 3, 4242, "node-a", "NVIDIA H200")
    assert p.canonical_uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_a_mig_payload_keeps_its_kind():
    p = decode_device(encode_device(bytes(range(16)), True, 0, 1, "h", "n"))
    assert p.canonical_uuid.startswith("MIG-")


def test_payload_is_one_plain_bytes_object():
    assert type(GOOD) is bytes
    assert pickle.loads(pickle.dumps(GOOD)) == GOOD


def test_long_or_odd_text_is_cut_to_fit_without_breaking_characters():
    p = decode_device(encode_device(bytes(16), False, 0, 1, "h\0st" * 100, "é" * 300))
    assert "\0" not in p.host and len(p.host.encode()) <= 255
    assert set(p.name) == {"é"} and len(p.name.encode()) <= 255


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (list(GOOD), "expected bytes"),
        (bytearray(GOOD), "expected bytes"),
        (GOOD.decode("latin-1"), "expected bytes"),
        (b"", "empty"),
        (GOOD[:10], "truncated"),
        (bytes([2]) + GOOD[1:], "version 2 is not understood"),
        (b"hello", "not a device payload [(]5 bytes"),
        (b"h" + GOOD[1:], "not a device payload of any gpu_serde version [(]it starts with 104"),
        (GOOD[:17] + b"\x08" + GOOD[18:], "flags"),
        (GOOD[:24] + b"no-separator", "separator"),
        (GOOD[:24] + b"h" * 300 + b"\0n", "host name is longer"),
        (GOOD + b"x" * 300, "device name is longer"),
        (GOOD + b"x" * MAX_BYTES, "at most"),
    ],
)
def test_each_defect_is_named(bad, says):
    with pytest.raises(PayloadError, match=says):
        validate_device(bad)


def test_the_reconstructor_turns_a_foreign_payload_into_a_placeholder_that_raises_payload_error():
    got = dev(("something", "else"))
    with pytest.raises(PayloadError, match="expected bytes"):
        gpu_serde.resolve(got)


def test_a_huge_payload_error_message_stays_short():
    with pytest.raises(PayloadError) as info:
        validate_device(GOOD + b"h" * 10_000_000)
    assert len(str(info.value)) < 400


plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=300),
    st.binary(max_size=600),
    st.floats(allow_nan=False),
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(plain, st.lists(plain, max_size=9).map(tuple)))
def test_fuzzed_values_raise_only_payload_error(p):
    try:
        accepted = validate_device(p)
    except PayloadError:
        return
    assert type(accepted) is bytes and decode_device(accepted).version == 1


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_corrupted_or_truncated_payloads_decode_or_raise_payload_error(data):
    blob = bytearray(GOOD)
    for _ in range(data.draw(st.integers(min_value=0, max_value=3))):
        index = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
        blob[index] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(blob)))
    candidate = bytes(blob[:cut])
    try:
        p = decode_device(candidate)
    except PayloadError:
        return
    assert len(p.uuid) == 16 and p.flags in (0, 1)  # accepted ones decode fully


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_reconstructor_never_raises_for_a_corrupted_payload(data):
    blob = bytearray(GOOD)
    index = data.draw(st.integers(min_value=0, max_value=len(blob) - 1))
    blob[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    got = dev(bytes(blob))
    assert isinstance(got, (Device, UnresolvedDevice, UnresolvedObject))


def test_a_payload_from_another_gpu_serde_version_is_a_placeholder_not_a_dead_worker():
    newer = bytes([2]) + GOOD[1:] + b"fields a newer version added"
    got = dev(newer)
    assert isinstance(got, UnresolvedObject)
    assert pickle.dumps(got) == pickle.dumps(UnresolvedObject("Device", dev, (newer,), None))
    with pytest.raises(PayloadError, match="payload version 2"):
        got.uuid  # noqa: B018 - using it raises
