"""Tensor and array payloads without torch or CuPy (CPU tier): validation, placeholders, the
bytes a payload carries, and registration that waits for the user to import the library.

What arrives for a GPU this process does not see is a placeholder that re-pickles to the same
bytes and raises ``DeviceNotVisibleError`` when used; nothing untyped escapes, whatever the
payload, whether or not torch is installed here.
"""

from __future__ import annotations

import pickle
import sys

import pytest
from cuda.core import Device

import gpu_serde
from gpu_serde import DeviceNotVisibleError, OtherHostError, PayloadError, UnresolvedObject, wire
from gpu_serde.device import device_payload
from gpu_serde.errors import HandoffError
from gpu_serde.format.device import encode_device
from gpu_serde.format.tensor import decode_meta, decode_tipc, decode_tshr, decode_tval
from gpu_serde.hostid import host_id
from gpu_serde.tensors.common import Carried
from helpers import env_without_driver, run_child

STRANGER = encode_device(bytes(range(16)), False, 3, 42, "node-b", "NVIDIA H200")
META = ("torch", "Tensor", "float32", 4, (4, 4), (4, 1), 0, False)
OTHER_BOOT = bytes.fromhex("0123456789abcdef0123456789abcdef")


def region(dev: bytes) -> tuple:
    return (1, dev, host_id(), "@gpu_serde-nobody", bytes(16), bytes(range(16)), 1 << 22, bytes(64))


def tval(dev: bytes = STRANGER, meta: tuple = META, start: int = 0, data: bytes = bytes(64)):
    return (1, dev, meta, start, len(data), data)


def tshr(dev: bytes = STRANGER, meta: tuple = META) -> tuple:
    return (1, meta, (1, region(dev), 8192, 4096, bytes(16)))


def tipc(dev: bytes = STRANGER, boot: bytes | None = None, meta: tuple = META) -> tuple:
    boot = host_id() if boot is None else boot
    return (1, dev, boot, meta, bytes(64), 64, 0, b"/torch_1_2_3", 0, bytes(64), True)


class Call:
    """Pickles as a call of ``fn`` with ``args``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_a_payload_of_each_kind_decodes_into_its_fields(installed):
    v, s, i = decode_tval(tval()), decode_tshr(tshr()), decode_tipc(tipc())
    assert (v.meta.dtype, v.meta.shape, v.start, v.nbytes) == ("float32", (4, 4), 0, 64)
    assert (s.block.offset, s.block.size, s.meta.strides) == (8192, 4096, (4, 1))
    assert (i.handle, i.counter, i.event_sync) == (bytes(64), b"/torch_1_2_3", True)


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (("torch", "Tensor", "float32", 4, (4, 4), (4, 1), 1, False), "does not lie inside"),
        (("torch", "Tensor", "float32", 4, (5, 4), (4, 1), 0, False), "does not lie inside"),
        (("cupy", "ndarray", "<f4", 4, (4,), (-1,), 0, False), "does not lie inside"),
        (("torch", "Tensor", "float32", 4, (4, 4), (4,), 0, False), "same length"),
        (("torch", "Tensor", "float32", 4, (-4, 4), (4, 1), 0, False), "same length"),
        (("jax", "Tensor", "float32", 4, (4, 4), (4, 1), 0, False), "library"),
        (("cupy", "Tensor", "float32", 4, (4, 4), (4, 1), 0, False), "kind"),
        (("torch", "Tensor", "float 32", 4, (4, 4), (4, 1), 0, False), "dtype"),
        (("torch", "Tensor", "f\n", 4, (4, 4), (4, 1), 0, False), "dtype"),
        (("torch", "Tensor", "float32", 0, (4, 4), (4, 1), 0, False), "itemsize"),
        (("torch", "Tensor", "float32", 4, (4, 4), (4, 1), 0, 1), "requires_grad"),
        (("torch", "Tensor", "float32", 4, (1,) * 65, (1,) * 65, 0, False), "same length"),
        (("torch", "Tensor", "float32", 4, (4, 4), (4, 1), 0), "8 fields"),
    ],
)
def test_a_malformed_meta_is_a_payload_error(installed, meta, why):
    with pytest.raises(PayloadError, match=why):
        decode_tval(tval(meta=meta))


def test_a_view_with_negative_strides_lies_inside_its_memory_from_its_offset():
    meta = decode_meta(("cupy", "ndarray", "<f4", 4, (4, 3), (-3, 1), 9, False), 48)
    assert meta.span() == (0, 12)


def test_a_zero_size_tensor_carries_no_bytes(installed):
    meta = ("torch", "Tensor", "float32", 4, (4, 0), (0, 1), 0, False)
    assert decode_tval(tval(meta=meta, data=b"")).nbytes == 0


def test_by_value_bytes_start_at_the_first_element_the_tensor_touches(installed):
    meta = ("torch", "Tensor", "float32", 4, (2,), (1,), 10, False)
    assert decode_tval(tval(meta=meta, start=10, data=bytes(8))).start == 10
    with pytest.raises(PayloadError, match="does not lie inside"):
        decode_tval(tval(meta=meta, start=11, data=bytes(8)))


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (tval(data=bytes(63)), "whole number of elements|does not lie"),
        ((1, STRANGER, META, 0, 64, memoryview(bytes(128))[::2]), "contiguous"),
        ((1, STRANGER, META, 0, 64, "x" * 64), "contiguous"),
        ((1, STRANGER, META, -1, 64, bytes(64)), "first element"),
        ((2, STRANGER, META, 0, 64, bytes(64)), "version 2"),
        ((1, b"\x01", META, 0, 64, bytes(64)), "truncated"),
    ],
)
def test_a_malformed_by_value_payload_is_a_payload_error(installed, payload, why):
    with pytest.raises(PayloadError, match=why):
        decode_tval(payload)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ((*tipc()[:4], bytes(5000), *tipc()[5:]), "IPC handle"),
        ((*tipc()[:9], bytes(63), *tipc()[10:]), "event handle"),
        ((*tipc()[:10], 1), "event_sync_required"),
        ((*tipc()[:2], bytes(3), *tipc()[3:]), "boot id"),
        (tipc(meta=("cupy", "ndarray", "<f4", 4, (4,), (1,), 0, False)), "torch tensor"),
        ((*tipc()[:5], 8, *tipc()[6:]), "does not lie inside"),
    ],
)
def test_a_malformed_torch_ipc_payload_is_a_payload_error(installed, payload, why):
    with pytest.raises(PayloadError, match=why):
        decode_tipc(payload)


def test_a_shared_tensor_must_lie_inside_its_block(installed):
    meta = ("torch", "Tensor", "float32", 4, (1025,), (1,), 0, False)  # 4100 bytes > 4096
    with pytest.raises(PayloadError, match="does not lie inside"):
        decode_tshr(tshr(meta=meta))


# ---- placeholders ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tval", "tshr", "tipc"])
def test_a_tensor_for_a_gpu_not_visible_here_is_a_placeholder_that_raises_when_used(
    installed, kind
):
    fn, payload = getattr(wire, kind), {"tval": tval, "tshr": tshr, "tipc": tipc}[kind]()
    blob = pickle.dumps(Call(fn, payload), protocol=5)
    got = pickle.loads(blob)
    assert isinstance(got, UnresolvedObject)
    assert pickle.dumps(got, protocol=5) == blob  # a hop passes it on unchanged
    assert "\n" not in repr(got) and "tensor" in repr(got).lower()
    with pytest.raises(DeviceNotVisibleError) as info:
        gpu_serde.resolve(got)
    assert info.value.uuid == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert "not visible in this process" in str(info.value)
    if kind == "tval":
        assert "the torch.Tensor's GPU" in str(info.value)
    with pytest.raises(DeviceNotVisibleError):
        got.shape  # noqa: B018  (any attribute: as a Device placeholder does)


def test_a_torch_ipc_payload_from_another_host_is_other_host_error(installed):
    got = wire.tipc(tipc(dev=device_payload(Device(0)), boot=OTHER_BOOT))
    with pytest.raises(OtherHostError, match="another host") as info:
        gpu_serde.resolve(got)
    assert "send the tensor itself" in str(info.value) and "portable" not in str(info.value)


@pytest.mark.parametrize("kind", ["tshr", "tipc"])
def test_memory_shared_for_a_gpu_seen_here_where_torch_has_no_cuda_says_so(installed, kind):
    # the driver sees the GPU (simulated), but this torch has no CUDA: typed, with what to do
    pytest.importorskip("torch", reason="the CPU tier's torch (Python 3.11): a CPU build")
    dev = device_payload(Device(0))
    got = getattr(wire, kind)({"tshr": tshr, "tipc": tipc}[kind](dev=dev))
    assert isinstance(got, UnresolvedObject)
    with pytest.raises(DeviceNotVisibleError, match="torch here has no GPU") as info:
        gpu_serde.resolve(got)
    assert "receive it where torch has CUDA" in str(info.value)
    # it says which GPU, from where, as an error for a GPU not seen here does
    uuid = str(Device(0).uuid)
    assert info.value.uuid == gpu_serde.canonical_uuid(uuid) and uuid in str(info.value)
    assert info.value.host and info.value.visible


def test_strict_mode_raises_device_not_visible_error_at_unpickling(simulated_gpus):
    blob = pickle.dumps(Call(wire.tval, tval()))
    gpu_serde.install(strict=True)
    try:
        with pytest.raises(DeviceNotVisibleError):
            pickle.loads(blob)
    finally:
        gpu_serde.uninstall()


def test_a_receiver_that_sees_no_gpu_gets_a_placeholder_not_an_untyped_error(installed):
    blob = pickle.dumps(Call(wire.tval, tval(dev=device_payload(Device(0)))), protocol=5)
    got = run_child(
        """
        x = pickle.loads(data)
        try:
            gpu_serde.resolve(x)
            report(error=None)
        except Exception as exc:
            report(error=type(exc).__name__, message=str(exc), visible=len(gpu_serde.visible_devices()))
        """,
        env_without_driver(),
        blob,
    )
    assert got["error"] == "DeviceNotVisibleError" and got["visible"] == 0
    assert "not visible in this process" in got["message"]


def test_a_receiver_without_torch_gets_a_typed_error_that_says_to_install_it(installed, sim_env):
    blob = pickle.dumps(Call(wire.tval, tval(dev=device_payload(Device(0)))), protocol=5)
    got = run_child(
        """
        sys.modules["torch"] = None  # this process cannot import torch
        x = pickle.loads(data)
        try:
            gpu_serde.resolve(x)
            report(error=None)
        except Exception as exc:
            report(error=type(exc).__name__, message=str(exc))
        """,
        sim_env(),
        blob,
    )
    assert got["error"] == "HandoffError"
    assert "cannot import torch" in got["message"] and "install torch" in got["message"]


# ---- the bytes a payload carries -----------------------------------------------------------


def test_carried_bytes_travel_out_of_band_under_protocol_5_and_re_pickle_the_same():
    data = Carried(memoryview(bytearray(range(256))))
    frames: list = []
    blob = pickle.dumps(data, protocol=5, buffer_callback=frames.append)
    assert len(frames) == 1 and len(blob) < 100  # the bytes are not in the pickle
    got = pickle.loads(blob, buffers=frames)
    assert bytes(memoryview(got)) == bytes(range(256))
    again: list = []
    pickle.dumps(got, protocol=5, buffer_callback=again.append)
    assert len(again) == 1


def test_carried_bytes_travel_in_band_under_older_protocols():
    got = pickle.loads(pickle.dumps(Carried(memoryview(b"abc")), protocol=4))
    assert got == b"abc"


# ---- registration waits for the user ------------------------------------------------------


def test_gpu_serde_and_its_engine_adapters_import_neither_torch_nor_cupy(sim_env):
    got = run_child(
        """
        gpu_serde.install()
        import gpu_serde.dask, gpu_serde.ray, gpu_serde.tensors
        report(torch="torch" in sys.modules, cupy="cupy" in sys.modules)
        """,
        sim_env(),
    )
    assert got == {"torch": False, "cupy": False}


def test_a_callback_runs_once_its_library_is_imported(tmp_path, monkeypatch):
    from gpu_serde.tensors.lazy import waiting, when_imported

    (tmp_path / "gs_fakelib").mkdir()
    (tmp_path / "gs_fakelib" / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list = []
    when_imported("gs_fakelib", lambda m: seen.append(m.VALUE))
    assert seen == [] and "gs_fakelib" in waiting()
    import gs_fakelib  # noqa: F401

    module = sys.modules["gs_fakelib"]
    assert seen == [42] and "gs_fakelib" not in waiting()
    assert type(module.__loader__).__name__ == "SourceFileLoader"  # its own loader, unwrapped
    when_imported("gs_fakelib", lambda m: seen.append(-m.VALUE))  # imported already: now
    assert seen == [42, -42]


def test_a_failing_callback_never_breaks_the_users_import(tmp_path, monkeypatch):
    import logging

    from gpu_serde.tensors.lazy import when_imported

    logged: list = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gpu_serde").addHandler(handler)

    (tmp_path / "gs_fakelib2.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def broken(module):
        raise RuntimeError("boom")

    when_imported("gs_fakelib2", broken)
    try:
        import gs_fakelib2
    finally:
        logging.getLogger("gpu_serde").removeHandler(handler)
    assert gs_fakelib2.VALUE == 7
    assert "gpu_serde: registering for gs_fakelib2 failed" in logged


def test_a_handoff_error_kind_is_what_an_unexpected_rebuild_failure_becomes(installed):
    # a payload for a visible GPU whose library cannot be imported here: typed, not ImportError
    meta = ("cupy", "ndarray", "<f4", 4, (16,), (1,), 0, False)
    got = wire.tval(tval(dev=device_payload(Device(0)), meta=meta))
    if "cupy" in sys.modules:  # pragma: no cover - CuPy is not installed in the CPU tier
        pytest.skip("CuPy is importable here")
    with pytest.raises(HandoffError, match="cannot import cupy"):
        gpu_serde.resolve(got)


@pytest.mark.parametrize("x", [None, 42, "x", b"bytes", [1.0, 2.0]], ids=type)
def test_place_names_what_it_takes_for_what_is_no_tensor(x):
    with pytest.raises(TypeError, match=r"torch\.Tensor, cupy\.ndarray, or the placeholder"):
        gpu_serde.tensors.place(x, "cpu")


@pytest.mark.parametrize(
    "use",
    [lambda x: x + 1, lambda x: 2 * x, lambda x: -x, lambda x: x @ x, lambda x: x[0]],
    ids=["add", "rmul", "neg", "matmul", "index"],
)
def test_a_tensor_placeholder_used_as_a_tensor_raises_its_reason_and_says_where_its_bytes_go(
    installed, use
):
    x = wire.tval(tval())
    with pytest.raises(DeviceNotVisibleError, match=r"place\(x, 'cpu'\)"):
        use(x)


# ---- routing by what arrived: the GPU a tensor was sent from ---------------------------------


@pytest.mark.parametrize("kind", ["tval", "tshr", "tipc"])
def test_a_tensor_placeholder_names_for_routing_the_gpu_it_was_sent_from(installed, kind):
    from gpu_serde.routing import target_uuid

    got = getattr(wire, kind)({"tval": tval, "tshr": tshr, "tipc": tipc}[kind]())
    assert isinstance(got, UnresolvedObject)  # the GPU is not visible here
    assert target_uuid(got) == gpu_serde.canonical_uuid(bytes(range(16)).hex())


def test_a_tensor_placeholder_for_another_reason_is_routed_by_nobody(installed):
    from gpu_serde.errors import ExporterGoneError
    from gpu_serde.routing import target_uuid

    gone = UnresolvedObject("shared torch.Tensor", wire.tshr, (tshr(),), ExporterGoneError("gone"))
    with pytest.raises(ExporterGoneError, match="gone"):
        target_uuid(gone)
    two_args = wire.tval(tval(), "extra")  # malformed: it says so, wherever it is routed
    with pytest.raises(PayloadError):
        target_uuid(two_args)


def test_what_is_not_a_tensor_from_torch_is_the_plain_type_error(installed):
    torch = pytest.importorskip("torch", reason="torch's objects")
    from gpu_serde.routing import target_uuid

    for obj in (torch.device("cuda", 1), torch.nn.Linear(2, 2), torch.float32):
        with pytest.raises(TypeError, match=r"on\(\) takes"):
            target_uuid(obj)
    with pytest.raises(TypeError, match="is on meta, not a CUDA GPU"):
        target_uuid(torch.empty(2, device="meta"))
