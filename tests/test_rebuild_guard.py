"""No payload can make a reconstructor raise: every failure becomes a placeholder.

Malformed bytes, wrong types, wrong arity and other versions all give a placeholder that re-pickles
to the very bytes it came as and raises a typed error when used. Text from the wire is escaped in
every message and repr, so a sender cannot forge lines of an error.
"""

from __future__ import annotations

import contextlib
import pickle
import random

import pytest
from cuda.core import Buffer, Device, VirtualMemoryResource, VirtualMemoryResourceOptions

import gpu_serde
from gpu_serde import (
    DeviceNotVisibleError,
    HandoffError,
    OtherHostError,
    PayloadError,
    UnresolvedDevice,
    UnresolvedObject,
    wire,
)
from gpu_serde.device import device_payload
from gpu_serde.format.device import encode_device
from gpu_serde.hostid import host_id
from gpu_serde.memory.vmm import options_payload

RECONSTRUCTORS = [
    wire.dev,
    wire.pool,
    wire.buf,
    wire.vmo,
    wire.vmm,
    wire.vbuf,
    wire.hbuf,
    wire.pbuf,
    wire.unsent,
    wire.arena,
    wire.abuf,
    wire.tval,
    wire.tshr,
    wire.tipc,
]
TYPED = (PayloadError, DeviceNotVisibleError, HandoffError)


class Call:
    """Pickles as a call of ``fn`` with ``args``: what a hand-made or foreign pickle can hold."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def _name(fn) -> str:
    return fn.__name__


@pytest.mark.parametrize("fn", RECONSTRUCTORS, ids=_name)
@pytest.mark.parametrize("arity", [0, 2, 7])
def test_a_pickle_with_the_wrong_arity_gives_a_placeholder_not_a_type_error(installed, fn, arity):
    blob = pickle.dumps(Call(fn, *([b"x"] * arity)))
    got = pickle.loads(blob)
    assert isinstance(got, UnresolvedObject)
    assert pickle.dumps(got) == blob
    with pytest.raises(PayloadError, match=f"takes one payload, got {arity} arguments"):
        gpu_serde.resolve(got)


@pytest.mark.parametrize("fn", RECONSTRUCTORS, ids=_name)
def test_strict_mode_raises_the_typed_error_at_unpickling(simulated_gpus, fn):
    blob = pickle.dumps(Call(fn, ("not", "a", "payload")))
    gpu_serde.install(strict=True)
    try:
        with pytest.raises(PayloadError):
            pickle.loads(blob)
    finally:
        gpu_serde.uninstall()


# --- the fuzz: 100,000 mutated payloads through every reconstructor (arena, abuf and the tensor kinds too) ---------

HOSTILE = [
    None,
    True,
    0,
    -1,
    1,
    2,
    7,
    255,
    256,
    1 << 62,
    1 << 64,
    10**30,
    1.5,
    float("nan"),
    "",
    "x",
    "@",
    "@\x1b[31m",
    "@\ud800",
    "rw",
    "posix_fd",
    b"",
    b"\x00" * 16,
    b"\x01" * 64,
    b"\xff" * 17,
    (),
    (1,),
    [1],
    {},
    ("rw",),
]


def _valid(simulated_gpus) -> dict:
    dev = device_payload(Device(1))
    opts = options_payload(VirtualMemoryResourceOptions(peers=(0,))).wire()
    pool = (1, dev, bytes(16), "@gpu_serde-fuzz", bytes(16), bytes(range(16)))
    region = (1, dev, bytes(16), "@gpu_serde-fuzz", bytes(16), bytes(range(16)), 1 << 22, bytes(64))
    meta = ("torch", "Tensor", "float32", 4, (4, 4), (4, 1), 0, False)
    return {
        wire.dev: dev,
        wire.pool: pool,
        wire.buf: (1, pool, bytes(64), 4096, bytes(16)),
        wire.vmo: opts,
        wire.vmm: (1, dev, opts),
        wire.vbuf: (1, (1, dev, opts), bytes(16), "@gpu_serde-fuzz", bytes(16), 4096, bytes(16)),
        wire.hbuf: (1, dev, 4096, bytes(4096)),
        wire.pbuf: (1, "buf", (1, pool, bytes(64), 4096, bytes(16)), (1, dev, 4096, bytes(4096))),
        wire.unsent: (1, "Buffer", "HostCopyError", "it did not fit"),
        wire.arena: region,
        wire.abuf: (1, region, 8192, 4096, bytes(16)),
        wire.tval: (1, dev, meta, 0, 64, bytes(64)),
        wire.tshr: (1, meta, (1, region, 8192, 4096, bytes(16))),
        wire.tipc: (1, dev, host_id(), meta, bytes(64), 64, 0, b"/torch_1", 0, bytes(64), True),
    }


def _mutate(value, rng: random.Random, depth: int = 0):
    """One random defect somewhere in ``value``: a flipped, cut or grown byte string, a field
    replaced by a hostile value, a tuple cut or grown, a nested payload mutated in turn."""
    if isinstance(value, bytes) and rng.random() < 0.8:
        blob = bytearray(value)
        choice = rng.randrange(4)
        if choice == 0 and blob:
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        elif choice == 1:
            del blob[rng.randrange(len(blob) + 1) :]
        elif choice == 2:
            blob += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        else:
            blob[0:1] = bytes([rng.randrange(256)])
        return bytes(blob)
    if isinstance(value, tuple) and value and rng.random() < 0.85:
        fields = list(value)
        choice = rng.randrange(4)
        if choice == 0:
            i = rng.randrange(len(fields))
            fields[i] = _mutate(fields[i], rng, depth + 1) if depth < 3 else rng.choice(HOSTILE)
        elif choice == 1:
            fields[rng.randrange(len(fields))] = rng.choice(HOSTILE)
        elif choice == 2:
            del fields[rng.randrange(len(fields)) :]
        else:
            fields.insert(rng.randrange(len(fields) + 1), rng.choice(HOSTILE))
        return tuple(fields)
    return rng.choice(HOSTILE)


def test_a_hundred_thousand_mutated_payloads_give_only_objects_or_typed_placeholders(
    installed, simulated_gpus
):
    rng = random.Random(20261203)
    valid = _valid(simulated_gpus)
    kinds: dict[str, int] = {}
    for n in range(100_000):
        fn = RECONSTRUCTORS[n % len(RECONSTRUCTORS)]
        payload = _mutate(valid[fn], rng)
        got = fn(payload)  # must not raise
        if isinstance(got, (UnresolvedObject, UnresolvedDevice)):
            error = got._error()
            assert isinstance(error, TYPED), (fn, payload, error)
            kinds[type(error).__name__] = kinds.get(type(error).__name__, 0) + 1
            if n % 97 == 0:  # a sample re-pickles to the bytes it came as
                blob = pickle.dumps(Call(fn, payload))
                assert pickle.dumps(pickle.loads(blob)) == blob
        else:
            rebuilt = (Device, VirtualMemoryResource, VirtualMemoryResourceOptions, Buffer)
            assert isinstance(got, rebuilt), (fn, payload, got)
    assert kinds["PayloadError"] > 50_000  # most mutations break the payload
    assert set(kinds) <= {
        "PayloadError",
        "DeviceNotVisibleError",
        "OtherHostError",
        "HandoffError",
        "HostCopyError",  # the unsent payload's own error
        "NotIPCEnabledError",
        "ExporterGoneError",
        "TokenRefusedError",
    }


# --- text from the wire never reaches a person raw -------------------------------------------

EVIL = "node\x1b[2J\rIt was sent from host trusted\u202e\n\x00\x7f\x9b\u2028end"


def _clean(text: str) -> bool:
    return all(ch.isprintable() for line in text.split("\n") for ch in line)


@pytest.fixture
def evil_device() -> bytes:
    return encode_device(bytes.fromhex("abcd" * 8), False, 3, 99, EVIL, EVIL)


def test_a_crafted_host_and_device_name_cannot_forge_lines_of_the_error(installed, evil_device):
    with pytest.raises(DeviceNotVisibleError) as info:
        gpu_serde.resolve(wire.dev(evil_device))
    text = str(info.value)
    lines = text.split("\n")
    assert _clean(text)
    assert sum(line.startswith("It was sent from host") for line in lines) == 1  # none forged
    assert lines[0].startswith("GPU GPU-abcdabcd-") and "\\x1b[2J\\x0d" in lines[0]
    assert "\\u202e" in lines[1] and "\\x0a" in lines[1]


def test_a_placeholder_repr_escapes_the_wire_text(installed, evil_device):
    shown = repr(wire.dev(evil_device))
    assert _clean(shown) and "\n" not in shown and "\\x1b" in shown


def test_the_error_attributes_carry_the_escaped_host(installed, evil_device):
    with pytest.raises(DeviceNotVisibleError) as info:
        gpu_serde.resolve(wire.dev(evil_device))
    assert _clean(info.value.host) and "\n" not in info.value.host


def test_memory_from_a_crafted_host_names_it_escaped(installed, evil_device):
    visible_evil = encode_device(
        bytes.fromhex(device_payload(Device(0))[1:17].hex()), False, 0, 1, EVIL, EVIL
    )
    pool = (1, visible_evil, bytes(16), "@gpu_serde-nobody", bytes(16), bytes(16))
    with pytest.raises(OtherHostError) as info:
        gpu_serde.resolve(wire.pool(pool))
    assert _clean(str(info.value)) and "\n" not in str(info.value)
    assert "\n" not in repr(wire.pool(pool))


@pytest.mark.parametrize("fn", RECONSTRUCTORS, ids=_name)
def test_a_payload_error_shows_crafted_text_escaped(installed, fn):
    got = fn((1, EVIL, EVIL, EVIL))
    message = str(got._error())
    assert _clean(message) and "\n" not in message and "\n" not in repr(got)


def test_a_broker_address_with_control_characters_is_a_payload_error(installed):
    pool = (1, None, host_id(), "@gpu\x1b[31m\n", bytes(16), bytes(16))
    with pytest.raises(PayloadError, match="printable ASCII"):
        gpu_serde.resolve(wire.pool(pool))


def test_a_placeholder_of_memory_whose_gpu_is_not_here_shows_on_one_line(installed):
    stranger = encode_device(bytes(range(16)), False, 3, 42, "node-b", "NVIDIA H200")
    got = wire.pool((1, stranger, host_id(), "@gpu_serde-nobody", bytes(16), bytes(16)))
    with pytest.raises(DeviceNotVisibleError):
        gpu_serde.resolve(got)
    assert "\n" not in repr(got) and "not visible" in repr(got)


def test_using_a_placeholder_again_and_again_keeps_no_callers_alive(installed):
    import gc
    import weakref

    class Big:
        pass

    got = wire.dev(b"\x01truncated")
    refs = []
    for _ in range(50):
        big = Big()
        refs.append(weakref.ref(big))
        with contextlib.suppress(PayloadError):
            gpu_serde.resolve(got)
        del big
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


class Hostile:
    """A payload field whose methods raise, even a BaseException: none of them may run."""

    def __repr__(self):
        raise SystemExit("a hostile repr")

    __str__ = __repr__

    def __eq__(self, other):
        raise SystemExit("a hostile eq")

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize("fn", RECONSTRUCTORS, ids=_name)
def test_a_payload_field_with_hostile_methods_runs_none_of_them(installed, fn):
    for args in [(Hostile(),), ((1, Hostile(), Hostile()),), ((Hostile(),) * 7,)]:
        got = fn(*args)
        assert isinstance(got, UnresolvedObject)
        assert "<Hostile>" in str(got._error()) and "\n" not in repr(got)


def test_a_crafted_device_name_cannot_pass_for_the_words_around_it(installed):
    name = "X) from host 'trusted': not visible in this process> (real"
    shown = repr(wire.dev(encode_device(bytes.fromhex("ab" * 16), False, 0, 1, "h", name)))
    assert shown.count("from host") == 2 and "\\'trusted\\'" in shown
