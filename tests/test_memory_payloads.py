"""Memory payloads on the CPU tier: every failure to rebuild is a placeholder with a typed error
(never an exception at unpickling, unless strict), and malformed payloads are PayloadErrors.
Importing real pools and buffers needs a GPU: see test_gpu_memory.py."""

import contextlib
import os
import pickle
import time

import pytest
from cuda.core import Device
from hypothesis import given, settings
from hypothesis import strategies as st

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
from gpu_serde.format.memory import decode_buffer, decode_pool
from gpu_serde.hostid import host_id
from gpu_serde.wire import buf, pool

NOBODY = "@gpu_serde-test-nobody-listens"
RUDE = f"@gpu_serde-test-rude-{os.getpid()}"  # abstract names are host-wide


def pool_payload(dev: bytes, boot: bytes = host_id()) -> tuple:
    return (1, dev, boot, NOBODY, bytes(range(16)), bytes(range(16, 32)))


def buffer_payload(pool_p: tuple) -> tuple:
    return (1, pool_p, b"\x01" * 64, 1 << 30, bytes(16))


@pytest.fixture
def visible_dev(simulated_gpus) -> bytes:
    return device_payload(Device(1))


def carrier(rebuild, payload) -> bytes:
    return pickle.dumps(UnresolvedObject("x", rebuild, (payload,), RuntimeError("unused")))


@pytest.mark.parametrize("rebuild", [pool, buf], ids=["pool", "buffer"])
def test_memory_from_another_host_is_a_placeholder_naming_both_hosts(visible_dev, rebuild):
    p = pool_payload(visible_dev, boot=bytes(16))
    p = p if rebuild is pool else buffer_payload(p)
    got = pickle.loads(carrier(rebuild, p))
    assert isinstance(got, UnresolvedObject)
    with pytest.raises(OtherHostError, match="mapped only on the host that exported it"):
        gpu_serde.resolve(got)
    with pytest.raises(OtherHostError):
        got.size  # noqa: B018 - using it raises
    assert pickle.dumps(got) == carrier(rebuild, p)  # forwards unchanged


def test_memory_of_a_gpu_not_visible_here_names_the_gpu(simulated_gpus):
    stranger = encode_device(bytes.fromhex("ab" * 16), False, 0, 1, "node-x", "NVIDIA H200")
    got = pickle.loads(carrier(pool, pool_payload(stranger)))
    with pytest.raises(DeviceNotVisibleError, match="abababab"):
        gpu_serde.resolve(got)


def test_pinned_memory_from_another_host_is_a_placeholder(simulated_gpus):
    got = pool(pool_payload(None, boot=bytes(16)))
    with pytest.raises(OtherHostError, match="Pinned host memory reached host"):
        gpu_serde.resolve(got)
    assert "PinnedMemoryResource" in repr(got)


def test_pinned_memory_of_a_gone_exporter_is_reported_within_a_second(simulated_gpus):
    started = time.monotonic()
    got = pickle.loads(carrier(buf, buffer_payload(pool_payload(None))))
    assert time.monotonic() - started < 1.0
    with pytest.raises(ExporterGoneError):
        gpu_serde.resolve(got)


def test_pinned_memory_in_a_process_without_gpus_says_it_needs_one():
    from helpers import env_without_driver, run_child

    code = """
from gpu_serde.wire import pool
from gpu_serde.hostid import host_id
got = pool((1, None, host_id(), "@nobody", bytes(16), bytes(16)))
try:
    gpu_serde.resolve(got)
except gpu_serde.HandoffError as exc:
    report(kind=type(exc).__name__, message=str(exc))
"""
    got = run_child(code, env_without_driver())
    assert got["kind"] == "HandoffError"
    assert "needs a CUDA device in the receiving process" in got["message"]


def test_a_gone_exporter_is_reported_within_a_second(visible_dev):
    started = time.monotonic()
    got = pickle.loads(carrier(buf, buffer_payload(pool_payload(visible_dev))))
    assert time.monotonic() - started < 1.0
    with pytest.raises(ExporterGoneError, match="gone"):
        gpu_serde.resolve(got)


def test_strict_mode_raises_at_unpickling(visible_dev):
    blob = carrier(pool, pool_payload(visible_dev, boot=bytes(16)))
    gpu_serde.install(strict=True)
    try:
        with pytest.raises(OtherHostError):
            pickle.loads(blob)
    finally:
        gpu_serde.uninstall()


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ([], "tuple of 6"),
        ((2, b"", b"", "", b"", b""), "version 2"),
        ((1, b"\x01junk", host_id(), NOBODY, bytes(16), bytes(16)), "truncated"),
        ((1, 42, host_id(), NOBODY, bytes(16), bytes(16)), "expected bytes"),
        ("boot", "boot id"),
        ("address", "broker address"),
        ("token", "16 bytes each"),
    ],
)
def test_pool_payload_defects_are_named(visible_dev, bad, says):
    good = list(pool_payload(visible_dev))
    if bad == "boot":
        good[2] = b"short"
        bad = tuple(good)
    elif bad == "address":
        good[3] = "/tmp/socket"
        bad = tuple(good)
    elif bad == "token":
        good[4] = b"x"
        bad = tuple(good)
    with pytest.raises(PayloadError, match=says):
        decode_pool(bad)


def test_buffer_payload_defects_are_named(visible_dev):
    good = buffer_payload(pool_payload(visible_dev))
    for bad, says in [
        (good[:4], "tuple of 5"),
        ((1, good[1], b"", *good[3:]), "descriptor"),
        ((1, good[1], good[2], -1, good[4]), "size"),
        ((1, good[1], good[2], good[3], b"t"), "token"),
    ]:
        with pytest.raises(PayloadError, match=says):
            decode_buffer(bad)


plain = st.one_of(st.none(), st.integers(), st.binary(max_size=40), st.text(max_size=40))


@settings(max_examples=300, deadline=None)
@given(st.lists(plain, max_size=7).map(tuple), st.integers(min_value=0, max_value=6))
def test_fuzzed_memory_payloads_give_placeholders_that_raise_payload_error(fields, keep):
    for rebuild in (pool, buf):
        got = rebuild(fields)
        with pytest.raises(PayloadError):
            gpu_serde.resolve(got)


@pytest.mark.parametrize(
    ("hostile", "says"),
    [
        ((10**5000,), "payload of any gpu_serde version .it starts with <int>"),
        ((1, b"\x01" * 30, host_id(), "@\ud800", bytes(16), bytes(16)), "no separator|of 5 fields"),
        ((1, b"\x01" * 30, 10**5000, NOBODY, bytes(16), bytes(16)), "no separator|of 5 fields"),
        (b"\x02" + bytes(40), "a tuple of"),
        ((7, "a newer pool"), "version 7"),
    ],
    ids=["huge-int", "non-ascii-address", "huge-boot", "bytes-for-a-pool", "newer-version"],
)
def test_hostile_but_plausible_payloads_give_placeholders_that_say_why(hostile, says):
    for rebuild in (pool, buf):
        got = rebuild(hostile)
        assert isinstance(got, UnresolvedObject)
        with pytest.raises(PayloadError, match=says):
            gpu_serde.resolve(got)


def test_a_broker_that_hangs_up_mid_request_is_an_exporter_gone_placeholder(visible_dev):
    import socket
    import threading

    rude = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    rude.bind("\0" + RUDE[1:])
    rude.listen(8)

    def hang_up() -> None:
        with contextlib.suppress(OSError):  # the test closes the socket when done
            for _ in range(2):
                conn, _ = rude.accept()
                conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        p = (1, visible_dev, host_id(), RUDE, bytes(16), bytes(16))
        got = pool(p)
        with pytest.raises(ExporterGoneError):
            gpu_serde.resolve(got)
    finally:
        rude.close()


def _import_and_exit(address: str, token: bytes) -> None:
    from gpu_serde.memory import lifetime as handoff
    from gpu_serde.memory.broker import acquire

    acquire(address, token)  # as rebuild_buffer does, then exits holding it
    handoff._live[12345] = (address, token, 0)


def test_a_fork_started_multiprocessing_child_releases_at_exit():
    import multiprocessing

    from gpu_serde.memory.broker import Broker

    b = Broker()
    let_go = []
    try:
        token = b.hold("a buffer", let_go.append, grace=0)
        child = multiprocessing.get_context("fork").Process(
            target=_import_and_exit, args=(b.address, token)
        )
        child.start()
        child.join(30)
        assert child.exitcode == 0
        deadline = time.monotonic() + 3
        while not let_go and time.monotonic() < deadline:
            time.sleep(0.05)
        assert let_go == ["a buffer"]  # multiprocessing's fork path skips atexit: still told
    finally:
        b.close()


def test_a_buffer_that_cannot_be_sent_travels_as_its_error_raised_where_it_is_used(installed):
    from cuda.core import Buffer

    from gpu_serde import HandoffError, NotIPCEnabledError

    buffer = Buffer.from_handle(0x1000, 64, mr=None)
    got = pickle.loads(pickle.dumps(buffer))  # the sender never fails
    with pytest.raises(NotIPCEnabledError, match="without a copy"):
        gpu_serde.resolve(got)
    buffer.close()
    got = pickle.loads(pickle.dumps(buffer))
    with pytest.raises(
        HandoffError,
        match="could not send this Buffer: this Buffer was closed by its exporter before it was sent",
    ):
        gpu_serde.resolve(got)
