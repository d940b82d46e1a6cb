"""Across processes: a child whose GPUs are numbered differently receives the same physical GPU."""

import multiprocessing
import os
import pickle
import subprocess
import sys

import pytest
from cuda.core import Device

import gpu_serde
from helpers import TESTS, echo_from_queue, env_without_driver, run_child

RECEIVE = """
d = pickle.loads(data)
try:
    real = gpu_serde.resolve(d)
    report(kind="device", ordinal=real.device_id, uuid=real.uuid)
except gpu_serde.DeviceNotVisibleError as exc:
    report(kind="not visible", uuid=exc.uuid, host=exc.host, message=str(exc),
           placeholder=type(d).__name__, repickled=pickle.dumps(d) == data)
"""


def bare(uuid: str) -> str:
    return uuid[4:]  # cuda.core's Device.uuid has no GPU- prefix


def test_reversed_order_child_gets_the_same_gpu_at_its_own_ordinal(installed, sim_env):
    gpus = installed
    blob = pickle.dumps(Device(0))
    got = run_child(RECEIVE, sim_env([g.uuid for g in reversed(gpus)]), blob)
    assert got == {"kind": "device", "ordinal": 3, "uuid": bare(gpus[0].uuid)}


def test_integer_cuda_visible_devices_are_followed(installed, sim_env):
    got = run_child(RECEIVE, sim_env("1,2"), pickle.dumps(Device(1)))
    assert got == {"kind": "device", "ordinal": 0, "uuid": bare(installed[1].uuid)}


def test_child_selecting_by_uuid_prefix_gets_the_right_gpu(installed, sim_env):
    gpus = installed
    prefix = gpus[3].uuid[:12].upper()  # GPU-xxxxxxxx, as users write it
    got = run_child(RECEIVE, sim_env(f"{prefix},{gpus[1].uuid}"), pickle.dumps(Device(3)))
    assert got == {"kind": "device", "ordinal": 0, "uuid": bare(gpus[3].uuid)}


# The parent is a fresh Python of its own: a forkserver starts once per process and keeps the
# environment it started with, so one started earlier (by another test) would not see the
# CUDA_VISIBLE_DEVICES this scenario sets.
SEND_TO_A_CHILD = """
import multiprocessing, queue
from cuda.core import Device
from helpers import report_device

if __name__ == "__main__":
    gpu_serde.install()
    device = Device(2)  # the parent sees all four
    os.environ["CUDA_VISIBLE_DEVICES"] = data.decode()  # the child: two, in another order
    ctx = multiprocessing.get_context(sys.argv[2])
    inbox = ctx.Queue()
    child = ctx.Process(target=report_device, args=(inbox, device))  # an ordinal it lacks
    child.start()
    got = None
    while got is None and (child.is_alive() or not inbox.empty()):
        try:
            got = list(inbox.get(timeout=0.5))
        except queue.Empty:
            pass
    child.join(30)
    report(got=got, exitcode=child.exitcode)
"""


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_process_arguments_carry_the_uuid(installed, sim_env, start):
    gpus = installed
    visible = f"{gpus[2].uuid},{gpus[1].uuid}".encode()
    env = sim_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    got = run_child(SEND_TO_A_CHILD, env, visible, args=[start])
    assert got == {"got": ["ok", 0, bare(gpus[2].uuid)], "exitcode": 0}


def test_a_queue_carries_the_uuid(installed, monkeypatch):
    gpus = installed
    ctx = multiprocessing.get_context("spawn")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(g.uuid for g in reversed(gpus)))
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=echo_from_queue, args=(inbox, outbox))
    child.start()
    try:
        inbox.put(Device(2))
        assert outbox.get(timeout=60) == ("ok", 1, bare(gpus[2].uuid))
    finally:
        child.join(30)


@pytest.mark.parametrize("visible", ["other", "empty", "no-driver"])
def test_a_child_that_cannot_see_the_gpu_raises_when_it_uses_it(installed, sim_env, visible):
    gpus = installed
    env = {
        "other": lambda: sim_env([gpus[1].uuid]),
        "empty": lambda: sim_env(""),
        "no-driver": env_without_driver,
    }[visible]()
    blob = pickle.dumps(Device(0))
    got = run_child(RECEIVE, env, blob)
    assert got["kind"] == "not visible"
    assert got["uuid"] == gpus[0].uuid
    assert got["placeholder"] == "UnresolvedDevice"
    assert got["repickled"] is True  # a CPU-only hop forwards it untouched
    reason = {
        "other": gpus[1].uuid,
        "empty": "CUDA_VISIBLE_DEVICES is empty",
        "no-driver": "no CUDA driver",
    }[visible]
    assert reason in got["message"]
    assert gpus[0].uuid in got["message"]


def test_strict_child_raises_at_unpickling(installed, sim_env):
    code = """
gpu_serde.install(strict=True)
try:
    pickle.loads(data)
    report(raised=None)
except gpu_serde.DeviceNotVisibleError as exc:
    report(raised=type(exc).__name__, uuid=exc.uuid)
"""
    got = run_child(code, sim_env(""), pickle.dumps(Device(2)))
    assert got == {"raised": "DeviceNotVisibleError", "uuid": installed[2].uuid}


def test_a_process_that_never_installed_still_unpickles_and_sends_on_by_uuid(installed, sim_env):
    code = """
from gpu_serde.registry import is_installed
before = is_installed()
d = pickle.loads(data)
report(before=before, ordinal=d.device_id, after=is_installed(), resent=b"gpu_serde" in pickle.dumps(d))
"""
    got = run_child(code, sim_env([installed[3].uuid]), pickle.dumps(Device(3)))
    assert got == {"before": False, "ordinal": 0, "after": True, "resent": True}


def in_a_forked_child(fn) -> str:
    """What ``fn()`` returns (a str) in a child forked from this process, or what it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            message = fn()
        except BaseException as exc:  # reported, not raised, in a child
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode()[:4000])
        os._exit(0)
    os.close(write)
    message = os.read(read, 4000).decode()
    os.close(read)
    os.waitpid(pid, 0)
    return message


def receiving(blob: bytes):
    """A job for :func:`in_a_forked_child`: unpickle ``blob`` and use what arrived."""

    def receive() -> str:
        gpu_serde.resolve(pickle.loads(blob))
        return "received"

    return receive


def test_a_child_forked_after_cuda_started_gets_a_clear_reason_not_a_broken_device(installed):
    blob = pickle.dumps(Device(0))
    message = in_a_forked_child(receiving(blob))
    assert "forked from pid" in message and "spawn" in message


EXPORTER = """
import pickle, sys
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
import gpu_serde
gpu_serde.install()
d = Device(0)
d.set_current()
if sys.argv[1] == "pool":
    mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 22))
else:
    mr = gpu_serde.ArenaMemoryResource(d, 1 << 22)
bufs = [mr.allocate(4096, stream=d.default_stream) for _ in range(2)]
for buf in bufs:
    print(pickle.dumps(buf).hex(), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("kind", ["pool", "arena"])
def test_a_child_forked_after_an_import_receives_afresh_and_gets_the_clear_reason(
    installed, sim_env, kind
):
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=sim_env([installed[2].uuid]),
    )
    try:
        first, second = (bytes.fromhex(exporter.stdout.readline()) for _ in range(2))
        received = pickle.loads(first)  # this process maps the exporter's memory
        assert received.size == 4096
        message = in_a_forked_child(receiving(second))  # not over the parent's mapping
        assert "forked from pid" in message and "spawn" in message, message
        mapped = received.memory_resource
        memory = mapped.pool if kind == "pool" else mapped.arena  # what the parent imported
        as_it_came = pickle.dumps(memory)
        passed_on = in_a_forked_child(lambda: str(pickle.dumps(memory) == as_it_came))
        assert passed_on == "True"  # the child passes the parent's pool or region on as it came
        as_it_came = pickle.dumps(received)
        passed_on = in_a_forked_child(lambda: str(pickle.dumps(received) == as_it_came))
        assert passed_on == "True"  # and the parent's received buffer
        received.close()
    finally:
        exporter.communicate("", timeout=30)


@pytest.mark.parametrize("kind", ["pool", "arena"])
def test_a_child_forked_from_an_exporter_sends_its_parents_buffer_as_the_clear_reason(
    installed, kind
):
    """A forked child cannot use CUDA, and the memory it inherited is its parent's: a buffer it
    sends arrives as the reason, never as a hold its parent's broker does not know."""
    from cuda.core import DeviceMemoryResource, DeviceMemoryResourceOptions

    d = Device(0)
    d.set_current()
    if kind == "pool":
        options = DeviceMemoryResourceOptions(ipc_enabled=True, max_size=1 << 22)
        mr = DeviceMemoryResource(d, options)
    else:
        mr = gpu_serde.ArenaMemoryResource(d, 1 << 22)
    buf = mr.allocate(4096, stream=d.default_stream)
    pickle.dumps(buf)  # sent once from here: this process's broker holds it

    def send_and_receive(obj) -> str:
        try:
            gpu_serde.resolve(pickle.loads(pickle.dumps(obj)))  # a buffer's sender never fails
        except gpu_serde.HandoffError as exc:
            return str(exc)
        return "received"

    message = in_a_forked_child(lambda: send_and_receive(buf))
    assert f"Buffer's memory belongs to pid {os.getpid()}" in message and "spawn" in message
    message = in_a_forked_child(lambda: send_and_receive(mr))  # the pool or arena itself
    assert f"Resource's memory belongs to pid {os.getpid()}" in message, message
    buf.close()
