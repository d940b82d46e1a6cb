"""The device payload decoder raises PayloadError, and only PayloadError, for bad input."""

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_serde import PayloadError
from gpu_serde.payload import VERSION, decode_device, encode_device, validate_device
from gpu_serde.wire import dev

GOOD = encode_device(bytes(range(16)), False, 3, 4242, "node-a", "NVIDIA H200")


def test_a_good_payload_decodes():
    p = decode_device(GOOD)
    assert (p.ordinal, p.pid, p.host, p.name) == (3, 4242, "node-a", "NVIDIA H200")
    assert p.canonical_uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_payload_is_plain_data():
    assert all(type(x) in (int, bytes, str) for x in GOOD)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ([*GOOD], "expected a tuple"),
        ((), "no version"),
        (GOOD[:4], "7 fields"),
        ((VERSION + 1, *GOOD[1:]), "version 2 is not understood"),
        (("1", *GOOD[1:]), "no version"),
        ((True, *GOOD[1:]), "no version"),
        ((1, b"\x00" * 15, *GOOD[2:]), "16 bytes"),
        ((1, "x" * 16, *GOOD[2:]), "16 bytes"),
        ((*GOOD[:2], 8, *GOOD[3:]), "flags"),
        ((*GOOD[:3], -1, *GOOD[4:]), "ordinal"),
        ((*GOOD[:4], 2**40, *GOOD[5:]), "pid"),
        ((*GOOD[:5], "h" * 10_000, GOOD[6]), "host"),
        ((*GOOD[:6], b"name"), "name"),
    ],
)
def test_each_defect_is_named(bad, says):
    with pytest.raises(PayloadError, match=says):
        validate_device(bad)


def test_reconstructor_rejects_foreign_payloads():
    with pytest.raises(PayloadError):
        dev(("something", "else"))


def test_a_huge_payload_error_message_stays_short():
    with pytest.raises(PayloadError) as info:
        validate_device((*GOOD[:5], "h" * 10_000_000, GOOD[6]))
    assert len(str(info.value)) < 400


plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=300),
    st.binary(max_size=40),
    st.floats(allow_nan=False),
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(plain, st.lists(plain, max_size=9).map(tuple), st.lists(plain, max_size=9)))
def test_fuzzed_payloads_raise_only_payload_error(p):
    try:
        validate_device(p)
    except PayloadError:
        return
    assert type(p) is tuple and len(p) == 7  # accepted only if it is well formed


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_payload_bytes_raise_only_payload_error(data):
    wire_bytes = bytearray(pickle.dumps(GOOD))
    index = data.draw(st.integers(min_value=0, max_value=len(wire_bytes) - 1))
    wire_bytes[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    cut = data.draw(st.integers(min_value=1, max_value=len(wire_bytes)))
    try:
        candidate = pickle.loads(bytes(wire_bytes[:cut]))
    except Exception:
        return  # pickle itself rejected the bytes before any payload existed
    try:
        accepted = validate_device(candidate)
    except PayloadError:
        return
    assert accepted is candidate and len(candidate) == 7
