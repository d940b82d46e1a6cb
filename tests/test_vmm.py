"""VirtualMemoryResource and its options travel by GPU UUID: the device and every peer land on the
receiver's own ordinals of the same GPUs, and a peer the receiver cannot see is named in a typed
error. (Mapping VMM buffers needs a GPU: see test_gpu_pinned_vmm.py.)"""

import pickle

import pytest
from cuda.core import Device, VirtualMemoryResource, VirtualMemoryResourceOptions
from hypothesis import given, settings
from hypothesis import strategies as st

import gpu_serde
from gpu_serde import OtherHostError, PayloadError, UnresolvedObject
from gpu_serde.hostid import host_id
from gpu_serde.memory.vmm import options_payload
from gpu_serde.wire import vbuf, vmm, vmo
from helpers import run_child

RECEIVE = """
from cuda.core import VirtualMemoryResource
got = pickle.loads(data)
try:
    got = gpu_serde.resolve(got)
    opts = got.config if isinstance(got, VirtualMemoryResource) else got
    report(kind=type(got).__name__,
           device=[got.device.device_id, got.device.uuid] if isinstance(got, VirtualMemoryResource) else None,
           peers=[[int(p), Device(int(p)).uuid] for p in opts.peers],
           handle_type=opts.handle_type, self_access=opts.self_access,
           peer_access=opts.peer_access, addr_align=opts.addr_align)
except gpu_serde.DeviceNotVisibleError as exc:
    report(kind="not visible", uuid=exc.uuid, message=str(exc), repickled=pickle.dumps(got) == data)
"""
RECEIVE = "from cuda.core import Device\n" + RECEIVE


def bare(uuid: str) -> str:
    return uuid[4:]


def test_options_peers_land_on_the_receivers_ordinals_of_the_same_gpus(installed, sim_env):
    gpus = installed
    opts = VirtualMemoryResourceOptions(peers=(1, Device(2)), handle_type=None, self_access="r")
    got = run_child(RECEIVE, sim_env([g.uuid for g in reversed(gpus)]), pickle.dumps(opts))
    assert got["kind"] == "VirtualMemoryResourceOptions"
    assert got["peers"] == [[2, bare(gpus[1].uuid)], [1, bare(gpus[2].uuid)]]
    assert (got["handle_type"], got["self_access"], got["peer_access"]) == (None, "r", "rw")


def test_a_resource_is_rebuilt_on_the_receivers_ordinal_with_its_peers(installed, sim_env):
    gpus = installed
    mr = VirtualMemoryResource(
        Device(3), VirtualMemoryResourceOptions(peers=[0], addr_align=1 << 21)
    )
    env = sim_env([gpus[0].uuid, gpus[3].uuid])
    got = run_child(RECEIVE, env, pickle.dumps(mr))
    assert got["kind"] == "VirtualMemoryResource"
    assert got["device"] == [1, bare(gpus[3].uuid)]
    assert got["peers"] == [[0, bare(gpus[0].uuid)]]
    assert got["addr_align"] == 1 << 21


def test_a_peer_the_receiver_cannot_see_is_named_in_the_error(installed, sim_env):
    gpus = installed
    opts = VirtualMemoryResourceOptions(peers=(0, 2))
    blob = pickle.dumps(VirtualMemoryResource(Device(0), opts))
    got = run_child(RECEIVE, sim_env([gpus[0].uuid, gpus[1].uuid]), blob)
    assert got["kind"] == "not visible"
    assert got["uuid"] == gpus[2].uuid
    assert got["message"].startswith(
        f"Peer GPU (VirtualMemoryResourceOptions.peers) {gpus[2].uuid}"
    )
    assert got["repickled"]  # a hop that cannot use it passes it on unchanged


def test_a_generator_of_peers_is_sent_as_a_tuple_and_the_sender_keeps_its_peers(installed):
    opts = VirtualMemoryResourceOptions(peers=(p for p in [3, 1]))
    got = pickle.loads(pickle.dumps(opts))
    assert got.peers == (3, 1)
    assert tuple(opts.peers) == (3, 1) and tuple(opts.peers) == (3, 1)  # still there, twice


def test_a_peer_that_is_not_a_device_fails_at_pickling(installed):
    with pytest.raises(ValueError, match="peers names 9"):
        pickle.dumps(VirtualMemoryResourceOptions(peers=(9,)))


def test_an_option_value_this_cuda_core_does_not_know_is_a_payload_error_placeholder(installed):
    p = list(options_payload(VirtualMemoryResourceOptions()))
    p[3] = "quantum_fd"  # handle_type from a newer cuda.core
    got = vmo(tuple(p))
    assert isinstance(got, UnresolvedObject)
    with pytest.raises(PayloadError, match="handle_type='quantum_fd'"):
        gpu_serde.resolve(got)


def test_a_vmm_buffer_from_another_host_is_a_placeholder(installed):
    from gpu_serde.memory.vmm import resource_payload

    res = resource_payload(VirtualMemoryResource(Device(0))).wire()
    p = (1, res, bytes(16), "@gpu_serde-test-nobody", bytes(16), 1 << 21, bytes(range(16)))
    got = vbuf(p)
    with pytest.raises(OtherHostError, match="mapped only on the host that exported it"):
        gpu_serde.resolve(got)
    assert isinstance(pickle.loads(pickle.dumps(got)), UnresolvedObject)  # forwarded as it came


plain = st.one_of(
    st.none(), st.booleans(), st.integers(), st.binary(max_size=20), st.text(max_size=20)
)


@settings(max_examples=200, deadline=None)
@given(st.lists(plain, max_size=12).map(tuple))
def test_fuzzed_vmm_payloads_give_placeholders_that_raise_payload_error(simulated_gpus, fields):
    for rebuild in (vmo, vmm, vbuf):
        got = rebuild(fields)
        assert isinstance(got, UnresolvedObject)
        assert isinstance(got._error(), PayloadError)  # the validator, not a crash, turned it away


def test_malformed_vmm_payloads_are_named(installed):
    good = options_payload(VirtualMemoryResourceOptions(peers=(1,))).wire()
    for bad, says in [
        (good[:5], "tuple of 11"),
        ((1, "x" * 40, *good[2:]), "at most 32"),
        ((*good[:5], 1, *good[6:]), "gpu_direct_rdma"),
        ((*good[:7], 0, *good[8:]), "addr_align"),
        ((*good[:8], [good[8][0]], *good[9:]), "tuple of at most 64"),
    ]:
        with pytest.raises(PayloadError, match=says):
            gpu_serde.resolve(vmo(bad))
    with pytest.raises(PayloadError, match="tuple of 3"):
        gpu_serde.resolve(vmm((1, None)))
    with pytest.raises(PayloadError, match="names its device"):
        gpu_serde.resolve(vbuf((1, (1, None, good), host_id(), "@x", bytes(16), 10, bytes(16))))


def test_option_values_cuda_core_accepts_are_sent_as_plain_ints(installed):
    import numpy as np

    opts = VirtualMemoryResourceOptions(addr_hint=np.int64(1 << 40), addr_align=0)
    got = pickle.loads(pickle.dumps(opts))
    assert (got.addr_hint, got.addr_align) == (1 << 40, None)  # 0 and None both mean granularity
    assert type(got.addr_hint) is int


def test_options_a_receiver_would_refuse_fail_at_the_sender(installed):
    with pytest.raises(ValueError, match="cannot be sent"):
        pickle.dumps(VirtualMemoryResourceOptions(self_access="x" * 40))


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10), plain)
def test_one_bad_field_in_a_valid_options_payload_is_a_payload_error(field, value):
    good = list(options_payload(VirtualMemoryResourceOptions()).wire())
    good[field] = value
    got = vmo(tuple(good))
    assert isinstance(got, (UnresolvedObject, VirtualMemoryResourceOptions))
    if isinstance(got, UnresolvedObject):  # the validator, not a crash, turned it away
        assert isinstance(got._error(), PayloadError)
