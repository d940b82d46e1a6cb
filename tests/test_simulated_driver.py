"""The stand-in driver applies CUDA_VISIBLE_DEVICES the way the real one does (FACTS.md)."""

import os
import subprocess
import sys
from importlib import metadata

import pytest

from gpu_serde.testing import SimulatedDriverError, SimulatedGPU, child_env, make_gpus
from helpers import env_without_driver, run_child

LIST = """
inv = gpu_serde.inventory.inventory() if hasattr(gpu_serde, "inventory") else None
from gpu_serde.inventory import inventory
inv = inventory()
report(uuids=[d.uuid for d in inv.devices], reason=inv.reason, simulated=inv.simulated)
"""

GPUS = make_gpus(2, seed="cvd-rules")
A, B = GPUS[0].uuid, GPUS[1].uuid


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [A, B]),
        ("", []),
        ("1", [B]),
        ("1,0", [B, A]),
        ("0,2", [A]),  # stops at the first invalid entry
        ("2,0", []),
        ("0,0,1", [A]),  # a repeated GPU ends the list too
        (B, [B]),
        (B.upper(), [B]),
        (B[:12], [B]),  # GPU-<unique prefix>
        (B[4:], []),  # the bare UUID, without GPU-, selects nothing
        (f"{B},{A}", [B, A]),
        ("GPU-", []),
    ],
)
def test_cuda_visible_devices_rules(visible, expected):
    got = run_child(LIST, child_env(GPUS, visible))
    assert got["uuids"] == expected
    assert got["simulated"] is True  # the stand-in is loaded, whether it shows a GPU or none
    if not expected:
        assert got["reason"]


def test_an_ambiguous_prefix_selects_nothing():
    twins = make_gpus(40, seed="twins")
    first = twins[0].uuid[:5]  # "GPU-x": shared with other GPUs of 40
    assert sum(g.uuid.startswith(first) for g in twins) > 1
    got = run_child(LIST, child_env(twins, first))
    assert got["uuids"] == []


def test_names_and_pci_ids_are_presented():
    code = """
from cuda.core import Device
d = Device(0)
report(name=d.name, uuid=d.uuid, cc=list(d.compute_capability), pci=gpu_serde.visible_devices()[0].pci_bus_id)
"""
    got = run_child(code, child_env(GPUS, "1"))
    assert got == {"name": GPUS[1].name, "uuid": B[4:], "cc": [9, 0], "pci": GPUS[1].pci_bus_id}


@pytest.mark.parametrize(
    ("fields", "error", "says"),
    [
        ({"name": "a|b"}, ValueError, "not allowed"),
        ({"name": "a\nb"}, ValueError, "control characters"),
        ({"uuid": "nonsense"}, ValueError, "starts with 'GPU-'"),
        ({"uuid": "GPU-123"}, ValueError, "32 hex digits"),
        ({"uuid": B[4:]}, ValueError, "starts with 'GPU-'"),  # cuda.core's bare spelling
        ({"uuid": "gpu-" + B[4:]}, ValueError, "starts with 'GPU-'"),  # the driver's case only
        ({"uuid": B + " "}, ValueError, "no spaces"),
        ({"pci_bus_id": "19:00.0"}, ValueError, "DDDD:BB:DD.F"),
        ({"name": 7}, TypeError, "a str, not int"),
    ],
)
def test_a_bad_gpu_description_is_refused_when_it_is_made(fields, error, says):
    with pytest.raises(error, match=says):
        SimulatedGPU(**{"uuid": A, **fields})


@pytest.mark.parametrize(
    ("make", "error", "says"),
    [
        (lambda: make_gpus(0), ValueError, "1 to 64"),
        (lambda: make_gpus(65), ValueError, "1 to 64"),
        (lambda: make_gpus(2.0), TypeError, "an int, not float"),
        (lambda: child_env([*GPUS, GPUS[0]]), ValueError, "two simulated GPUs have the UUID"),
        (
            lambda: child_env([GPUS[0], SimulatedGPU("MIG-" + A[4:], pci_bus_id="0000:99:00.0")]),
            ValueError,
            "two simulated GPUs have the UUID",
        ),
        (lambda: child_env([]), ValueError, "1 to 64"),
        (lambda: child_env(GPUS[0]), TypeError, "a list of SimulatedGPU"),
        (lambda: child_env([A]), TypeError, "SimulatedGPU objects"),
        (lambda: child_env(GPUS, visible=5.5), TypeError, "CUDA_VISIBLE_DEVICES string"),
        (lambda: child_env(GPUS, visible=[0, None]), TypeError, "not NoneType"),
    ],
)
def test_a_bad_simulated_host_is_refused(make, error, says):
    with pytest.raises(error, match=says):
        make()


def test_a_dask_layout_takes_strings_ordinals_and_lists_and_names_what_is_wrong(simulated_gpus):
    from gpu_serde.testing import spec_cluster_options

    uuid = simulated_gpus[1].uuid
    options = spec_cluster_options({"a": 0, "b": "1,0", "c": [uuid]})
    envs = {n: w["options"]["env"]["CUDA_VISIBLE_DEVICES"] for n, w in options["workers"].items()}
    assert envs == {"a": "0", "b": "1,0", "c": uuid}
    with pytest.raises(TypeError, match="a dict of worker name"):
        spec_cluster_options(None)
    with pytest.raises(ValueError, match="no workers"):
        spec_cluster_options({})
    with pytest.raises(TypeError, match=r"nthreads=\.\.\.\): an int, not str"):
        spec_cluster_options({"a": "0"}, nthreads="2")
    with pytest.raises(TypeError, match=r"layout\['a'\]\): a CUDA_VISIBLE_DEVICES string"):
        spec_cluster_options({"a": 1.5})
    with pytest.raises(ValueError, match=r"'zz' is not a worker of the layout \('a'\)"):
        spec_cluster_options({"a": "0"}, hosts={"zz": "hostb"})
    with pytest.raises(ValueError, match=r"hosts\['a'\]\): 'bad label' is not a host label"):
        spec_cluster_options({"a": "0"}, hosts={"a": "bad label"})
    with pytest.raises(TypeError, match="a dict of worker name -> host label, not list"):
        spec_cluster_options({"a": "0"}, hosts=["a"])


def test_a_ray_node_on_another_host_needs_a_host_label():
    from gpu_serde.testing import ray_node_options

    assert ray_node_options("0", host="hostb")["env_vars"]["GPU_SERDE_HOST_ID"] == "hostb"
    with pytest.raises(ValueError, match=r"host=\.\.\.\): 'bad label' is not a host label"):
        ray_node_options("0", host="bad label")


def test_a_cluster_laid_out_with_no_driver_and_no_simulated_gpus_says_how_to_get_them(
    monkeypatch,
):
    from gpu_serde import testing

    if testing.real_driver_present():
        pytest.skip("a real CUDA driver is here: its workers would find it")
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # no simulated GPUs at all; or their list, but not their driver where children load it from
    for env in ({testing.SPEC_ENV: None}, {"LD_LIBRARY_PATH": None}, {testing.SPEC_ENV: ""}):
        for name, value in env.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        for make in (
            lambda: testing.spec_cluster_options({"a": "0"}),
            lambda: testing.ray_node_options("0"),
        ):
            with pytest.raises(SimulatedDriverError, match="the simulated_gpus pytest fixture"):
                make()
        monkeypatch.undo()
        monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    assert testing.ray_node_options("0")["num_gpus"] == 1  # this session's simulated GPUs: laid out


def test_a_ray_node_takes_one_ordinal_as_a_dask_worker_does():
    from gpu_serde.testing import ray_node_options

    assert ray_node_options(2) == {"num_gpus": 1, "env_vars": {"CUDA_VISIBLE_DEVICES": "2"}}
    with pytest.raises(TypeError, match="not bool"):
        ray_node_options(True)


def test_a_ray_node_off_loopback_is_warned_of_before_ray_binds_this_machines_address(monkeypatch):
    import warnings

    from gpu_serde.testing import RayAddressWarning, ray_node_options

    # Ray's own rule (Linux): unset, "1" or "true" bind outward; anything else keeps loopback
    for value in (None, "1", "TRUE"):
        if value is None:
            monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
        else:
            monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", value)
        with pytest.warns(RayAddressWarning, match=r"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'\] = '0'"):
            ray_node_options("0")
    for value in ("0", "false", "no"):
        monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ray_node_options("0")["num_gpus"] == 1  # on loopback: no word


def test_sixty_four_gpus_have_distinct_pci_ids_in_the_drivers_form():
    gpus = make_gpus(64)
    assert len({g.pci_bus_id for g in gpus}) == 64
    got = run_child(LIST, child_env(gpus, "63"))
    assert got["uuids"] == [gpus[63].uuid]


ACTIVATE_TWICE = """
from gpu_serde.testing import SimulatedDriverError, activate, make_gpus
from gpu_serde.inventory import inventory
activate(make_gpus(2))
activate(make_gpus(3))  # before CUDA starts: these GPUs instead
count = len(inventory().devices)
activate(make_gpus(3))  # the same again: harmless
try:
    activate(make_gpus(2))
except SimulatedDriverError as exc:
    report(count=count, error=str(exc))
"""


def test_a_process_where_cuda_started_refuses_to_simulate_other_gpus():
    got = run_child(ACTIVATE_TWICE, child_env(GPUS))
    assert got["count"] == 3
    assert "CUDA has started in this process on 3 other simulated GPU(s)" in got["error"]


REACTIVATE = """
import os
from gpu_serde.testing import activate, make_gpus
from gpu_serde.inventory import inventory
activate(make_gpus(2))  # as the top of a script that a spawned child runs again
report(visible=os.environ.get("CUDA_VISIBLE_DEVICES"), count=len(inventory().devices))
"""


def test_a_child_that_activates_its_parents_gpus_again_keeps_what_its_parent_made_visible():
    gpus = make_gpus(2)
    got = run_child(REACTIVATE, child_env(gpus, ""))  # the parent hid every GPU from it
    assert got == {"visible": "", "count": 0}
    got = run_child(REACTIVATE, child_env(gpus, "1"))
    assert got == {"visible": "1", "count": 1}


def test_activate_without_a_parents_gpus_makes_all_visible():
    base = {k: v for k, v in os.environ.items() if k != "GPU_SERDE_SIM_GPUS"}
    got = run_child(REACTIVATE, {**base, "CUDA_VISIBLE_DEVICES": "0"})  # a stale shell value
    assert got == {"visible": None, "count": 2}


def test_it_does_not_shadow_a_real_driver_unless_asked(tmp_path, monkeypatch):
    fake_real = tmp_path / "libcuda.so.1"
    fake_real.write_bytes(b"")  # stands for a real driver found on LD_LIBRARY_PATH
    monkeypatch.setenv("LD_LIBRARY_PATH", str(tmp_path))
    with pytest.raises(SimulatedDriverError, match="real CUDA driver"):
        child_env(GPUS, None, base={"LD_LIBRARY_PATH": str(tmp_path)})
    assert child_env(GPUS, None, allow_real_driver=True)["GPU_SERDE_SIM_GPUS"]


# What is not simulated says so: the CUDA runtime, kernels and graphs fail with the driver's code for
# a stub library, and the error names the call (docs/testing.md, "What works and what does not").
NOT_SIMULATED = """
import json, sys
from cuda.core import Device, ObjectCode
dev = Device(0)
dev.set_current()
PTX = b".version 8.0\\n.target sm_90\\n.address_size 64\\n.visible .entry k() { ret; }\\n"
calls = {
    "sync": dev.sync,
    "pci_bus_id": lambda: dev.pci_bus_id,
    "kernel": lambda: ObjectCode.from_ptx(PTX).get_kernel("k"),
    "kernel again": lambda: ObjectCode.from_ptx(PTX).get_kernel("k"),
    "graph": lambda: dev.create_graph_builder().begin_building(),
}
errors = {}
for name, call in calls.items():
    try:
        call()
        errors[name] = None
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
print("RESULT " + json.dumps(errors))
"""


def run_not_simulated(extra_env: dict[str, str]) -> tuple[dict, str]:
    import json
    import subprocess
    import sys

    env = {**child_env(GPUS, None), **extra_env}
    done = subprocess.run(
        [sys.executable, "-c", NOT_SIMULATED], env=env, capture_output=True, text=True, timeout=120
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, done.stderr
    return json.loads(lines[0][len("RESULT ") :]), done.stderr


@pytest.fixture(scope="module")
def not_simulated() -> tuple[dict, str]:
    return run_not_simulated({})


@pytest.mark.parametrize("call", ["sync", "pci_bus_id"])
def test_the_cuda_runtime_fails_as_a_stub_library(not_simulated, call):
    errors, _ = not_simulated
    assert errors[call].startswith("CUDAError: cudaErrorStubLibrary")


@pytest.mark.parametrize(
    ("call", "function"), [("kernel", "cuLibraryLoadData"), ("graph", "cuStreamBeginCapture")]
)
def test_a_call_that_is_not_simulated_names_itself(not_simulated, call, function):
    errors, _ = not_simulated
    assert errors[call].startswith(
        f"CUDAError: CUDA_ERROR_STUB_LIBRARY (gpu_serde simulated GPU: {function} is not simulated; "
        "help(gpu_serde.testing) says what is simulated)"
    )


def test_without_the_trace_the_simulated_driver_prints_nothing(not_simulated):
    _, stderr = not_simulated
    assert "gpu_serde simulated" not in stderr  # callers that try a call and carry on stay quiet


def test_the_trace_has_a_line_for_every_failing_call():
    _, stderr = run_not_simulated({"GPU_SERDE_SIM_TRACE": "1"})
    traced = [
        line for line in stderr.splitlines() if line.startswith("gpu_serde simulated driver:")
    ]
    assert (
        traced.count("gpu_serde simulated driver: cuLibraryLoadData -> 34 CUDA_ERROR_STUB_LIBRARY")
        == 2
    )


def test_a_driver_call_that_is_not_simulated_returns_the_stub_library_code(simulated_gpus):
    from cuda.bindings import driver

    assert driver.cuLibraryLoadData(b"\\0", None, None, 0, None, None, 0)[0] == (
        driver.CUresult.CUDA_ERROR_STUB_LIBRARY
    )


def test_peers_are_not_accessible_and_pci_ids_find_their_device(simulated_gpus):
    from cuda.bindings import driver
    from cuda.core import Device

    assert Device(0).can_access_peer(1) is False
    err, dev = driver.cuDeviceGetByPCIBusId(simulated_gpus[2].pci_bus_id.encode())
    assert (err, int(dev)) == (driver.CUresult.CUDA_SUCCESS, 2)


WORK = """
import time
from cuda.bindings import driver
from cuda.core import Device

NOT_READY = driver.CUresult.CUDA_ERROR_NOT_READY
LEGACY = 1  # CU_STREAM_LEGACY


def busy(stream) -> bool:
    return driver.cuStreamQuery(stream)[0] == NOT_READY


def waited(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


dev = Device(0)
dev.set_current()
s, t = dev.create_stream(), dev.create_stream()  # cuda.core's: non-blocking
buf = dev.allocate(1 << 20, stream=s)
s.sync()
idle = busy(s.handle)
driver.cuMemsetD8Async(int(buf.handle), 7, 1 << 20, int(s.handle))
event = s.record()
t.wait(event)  # t now waits for s's work too
first = {
    "stream": busy(s.handle),
    "event": not event.is_done,
    "the stream that waits for it": busy(t.handle),
    "another stream": busy(dev.create_stream().handle),
    "the legacy stream": busy(LEGACY),
}
synced = waited(t.sync)
after = {"stream": busy(s.handle), "event": not event.is_done}
# a blocking stream's work holds the legacy stream, and a copy to the host waits for it
err, blocking = driver.cuStreamCreate(0)
driver.cuMemsetD8Async(int(buf.handle), 8, 1 << 20, blocking)
legacy = busy(LEGACY)
host = bytearray(16)
copied = waited(lambda: driver.cuMemcpyDtoH(host, int(buf.handle), 16))
driver.cuMemsetD8Async(int(buf.handle), 9, 1 << 20, int(s.handle))
whole = waited(driver.cuCtxSynchronize)
report(idle=idle, first=first, synced=synced, after=after, legacy=legacy, copied=copied,
       byte=host[0], whole=whole)
"""
WORK_MS = 500


def test_simulated_work_keeps_its_stream_and_events_busy_until_it_is_done():
    got = run_child(WORK, {**child_env(GPUS, None), "GPU_SERDE_SIM_WORK_MS": str(WORK_MS)})
    assert got["idle"] is False  # a stream with nothing queued is idle
    assert got["first"] == {
        "stream": True,
        "event": True,
        "the stream that waits for it": True,
        "another stream": False,  # non-blocking streams wait for no one
        "the legacy stream": False,
    }
    assert got["synced"] >= WORK_MS / 1e3 * 0.5  # synchronising waited for the work
    assert got["after"] == {"stream": False, "event": False}
    assert got["legacy"] is True  # as in CUDA: it waits for the blocking stream
    assert got["copied"] >= WORK_MS / 1e3 * 0.5 and got["byte"] == 8  # after that work
    assert got["whole"] >= WORK_MS / 1e3 * 0.5  # the context waits for every stream


def test_without_simulated_work_every_stream_is_idle_at_once():
    got = run_child(WORK, child_env(GPUS, None))
    assert got["first"] == dict.fromkeys(
        ("stream", "event", "the stream that waits for it", "another stream", "the legacy stream"),
        False,
    )
    assert got["legacy"] is False and got["byte"] == 8


@pytest.mark.parametrize("value", ["abc", "-5", "nan", "5ms", "3600001", "1\x1b[31m"])
def test_a_bad_simulated_work_value_is_said_and_ignored(value):
    done = subprocess.run(
        [sys.executable, "-c", WORK_BAD],
        env={**child_env(GPUS, None), "GPU_SERDE_SIM_WORK_MS": value},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "idle"  # no work in flight
    assert "GPU_SERDE_SIM_WORK_MS=" in done.stderr
    assert "is not a number of milliseconds from 0 to 3600000: ignored" in done.stderr
    assert "\x1b" not in done.stderr  # a control character is not echoed


WORK_BAD = """
import os, sys
from cuda.bindings import driver
from cuda.core import Device
dev = Device(0)
dev.set_current()
s = dev.create_stream()
buf = dev.allocate(64, stream=s)
driver.cuMemsetD8Async(int(buf.handle), 1, 64, int(s.handle))
print("busy" if driver.cuStreamQuery(s.handle)[0] == driver.CUresult.CUDA_ERROR_NOT_READY else "idle")
sys.stdout.flush()
os._exit(0)  # no interpreter teardown: cuda-core 1.2's CUDA 12 build crashes there
"""


def test_an_event_recorded_on_another_gpus_stream_is_an_invalid_handle(simulated_gpus):
    from cuda.bindings import driver
    from cuda.core import Device

    Device(1).set_current()
    other = Device(1).create_stream()
    Device(0).set_current()
    err, event = driver.cuEventCreate(0)
    assert err == driver.CUresult.CUDA_SUCCESS
    try:
        assert driver.cuEventRecord(event, other.handle)[0] == (
            driver.CUresult.CUDA_ERROR_INVALID_HANDLE
        )
    finally:
        driver.cuEventDestroy(event)


def test_a_ray_node_that_names_a_gpu_its_processes_would_not_see_is_refused(simulated_gpus):
    from gpu_serde.testing import ray_node_options

    # four simulated GPUs this session: CUDA stops at the first entry that selects none
    for visible in (["GPU-bad"], "0,GPU-bad,1", [7], "0,9"):
        with pytest.raises(ValueError, match=r"see [01] GPU\(s\), not the [123] it names"):
            ray_node_options(visible)
    assert ray_node_options("")["num_gpus"] == 0  # a node with no GPU
    assert ray_node_options([3, 1])["num_gpus"] == 2


def test_gpus_activated_after_a_look_that_found_no_driver_are_seen(simulated_gpus):
    from gpu_serde import testing

    if testing.real_driver_present():
        pytest.skip("a real CUDA driver is here: the first look finds it")
    if int(metadata.version("cuda-bindings").split(".")[0]) < 13:
        pytest.skip("cuda-bindings 12 keeps a failed driver load for the process's life itself")
    got = run_child(
        """
        import pickle
        from cuda.core import Device
        from gpu_serde import testing
        before = len(gpu_serde.visible_devices())  # no driver yet: the answer must not stick
        testing.activate(testing.make_gpus(2))
        gpu_serde.install()
        d = pickle.loads(pickle.dumps(Device(1)))
        report(before=before, after=len(gpu_serde.visible_devices()), got=type(d).__name__)
        """,
        env_without_driver(),
    )
    assert got == {"before": 0, "after": 2, "got": "Device"}


def test_activating_again_without_visible_shows_every_gpu_not_the_last_choice(simulated_gpus):
    got = run_child(
        """
        import os
        from gpu_serde import testing
        gpus = testing.make_gpus(4)
        testing.activate(gpus, [2, 1])
        chosen = os.environ["CUDA_VISIBLE_DEVICES"]
        testing.activate(gpus)  # this process's own earlier choice is not a parent's
        report(chosen=chosen, then=os.environ.get("CUDA_VISIBLE_DEVICES"))
        """,
        env_without_driver(),
    )
    assert got == {"chosen": "2,1", "then": None}


def test_a_cache_folder_that_cannot_be_written_is_a_simulated_driver_error(monkeypatch, tmp_path):
    from gpu_serde import testing

    monkeypatch.setenv("GPU_SERDE_CACHE_DIR", "/proc/no-such-folder")
    with pytest.raises(SimulatedDriverError, match="Set GPU_SERDE_CACHE_DIR to a folder you can"):
        testing.driver_dir()
    monkeypatch.chdir(tmp_path)  # a relative one: children that change directory still find it
    monkeypatch.setenv("GPU_SERDE_CACHE_DIR", "relative")
    folder = testing.driver_dir()
    assert folder.is_absolute() and folder.parent == tmp_path / "relative"


def test_a_dask_worker_that_names_a_gpu_it_would_not_see_is_refused(simulated_gpus):
    pytest.importorskip("distributed")
    from gpu_serde.testing import spec_cluster_options

    for visible in (9, "GPU-zz", "0,9"):
        with pytest.raises(ValueError, match=r"layout\['a'\]\): CUDA_VISIBLE_DEVICES="):
            spec_cluster_options({"a": visible})
    assert spec_cluster_options({"a": ""})["workers"]["a"]["options"]["env"] == {
        "CUDA_VISIBLE_DEVICES": ""
    }  # a worker with no GPU
    with pytest.raises(TypeError, match=r"host=\.\.\.\): the address to bind, a str"):
        spec_cluster_options({"a": "0"}, host=5)


def test_a_child_environment_from_what_is_no_environment_is_a_type_error(simulated_gpus):
    for base in ([1], {"A": 1}):
        with pytest.raises(TypeError, match=r"child_env\(base=\.\.\.\): an environment"):
            child_env(simulated_gpus, base=base)


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda c: c.dask_cli_cluster(["w"]), TypeError, "a dict of name -> its CUDA_VISIBLE"),
        (lambda c: c.dask_cli_cluster({}), ValueError, "nothing to start"),
        (lambda c: c.dask_cli_cluster({"w": 1.5}), TypeError, r"workers=\.\.\.\)\['w'\]"),
        (lambda c: c.dask_cli_cluster({"w": None}), TypeError, '"" for no GPU'),
        (
            lambda c: c.dask_cli_cluster({"w": "0"}, worker_env={"nope": {}}),
            ValueError,
            "'nope' is not a worker",
        ),
        (lambda c: c.ray_cli_cluster({"n": 1.5}), TypeError, r"nodes=\.\.\.\)\['n'\]"),
    ],
)
def test_a_cli_cluster_checks_its_layout_before_starting_anything(call, error, says):
    from gpu_serde.testing import clusters

    with pytest.raises(error, match=says), call(clusters):
        pass


def test_a_malformed_gpu_list_says_which_entry_on_stderr(simulated_gpus):
    from gpu_serde import testing

    env = testing.child_env(simulated_gpus)
    env["GPU_SERDE_SIM_GPUS"] = f"{simulated_gpus[0].uuid}|H200|0000:19:00.0;GPU-8e50\x1b[31m"
    done = subprocess.run(
        [sys.executable, "-c", "import gpu_serde; print(len(gpu_serde.visible_devices()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "0"
    assert "GPU_SERDE_SIM_GPUS entry 1 (GPU-8e50?[31m) is not GPU-<32 hex digits>" in done.stderr
    assert "\x1b" not in done.stderr
