"""torch tensors and CuPy arrays by GPU UUID on the real GPU (``pytest -m gpu``; torch with CUDA,
CuPy; Ray and distributed for their tests).

Every receiver has another CUDA_VISIBLE_DEVICES than the sender (the GPU's UUID: it numbers the
GPU 0 where the sender uses its last one) and reports what arrived: type, dtype, shape, strides,
storage offset, requires_grad, the GPU's UUID and every value. Three paths:

- by value (pickle, cloudpickle, Ray, Dask): the bytes travel, the tensor lands on the same GPU;
- ``torch.multiprocessing`` (any ``multiprocessing`` queue): torch's own CUDA IPC, by UUID;
- ``gpu_serde.share``: no copy on one host (the receiver writes, the sender sees it).
"""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import time
import warnings

import pytest
from memtier import Tier, dask_on, ray_by_value, ray_get, ray_on, wait_until
from tensortier import (
    busy_then_drop,
    cases,
    child,
    describe,
    describe_and_add,
    describe_kept,
    drop,
    error_of,
    expected,
    keep,
    loads_and_describe,
    loads_and_error,
    same,
    still_busy,
)

import gpu_serde
from helpers import run_child

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the tensor tests need torch with CUDA")


@pytest.fixture
def gpu(real_gpu, monkeypatch):
    """The last GPU (a child that sees only it numbers it 0), gpu_serde installed."""
    from gpu_serde.memory import lifetime

    gpu_serde.visible_devices()  # this process's view, taken before a child's env is set
    gpu_serde.install()
    monkeypatch.setattr(lifetime, "RELEASE_GRACE_S", 0.5)
    ordinal = len(real_gpu) - 1
    torch.cuda.set_device(ordinal)
    yield ordinal, real_gpu[-1].uuid
    gpu_serde.uninstall()


def arena_cases(ordinal):
    """The test tensors, allocated in gpu_serde memory (shared without a copy)."""
    return cases(
        torch,
        torch.device("cuda", ordinal),
        lambda shape, dtype: gpu_serde.tensors.empty(shape, dtype, ordinal),
    )


# ---- by value ------------------------------------------------------------------------------


def test_a_pickled_cuda_tensor_arrives_on_the_same_gpu_with_its_layout_and_bytes(gpu, monkeypatch):
    ordinal, uuid = gpu
    sent = cases(torch, torch.device("cuda", ordinal))
    with child(monkeypatch, uuid) as run:
        got = {
            name: run(loads_and_describe, pickle.dumps(t, protocol=5)) for name, t in sent.items()
        }
    for name, t in sent.items():
        assert same(got[name], t), name
        assert got[name]["device"] == 0 and got[name]["pid"] != os.getpid()


def test_a_non_leaf_tensor_that_requires_grad_arrives_as_a_leaf_that_requires_grad(
    gpu, monkeypatch
):
    ordinal, uuid = gpu
    x = torch.ones(8, device=f"cuda:{ordinal}", requires_grad=True) * 3
    with child(monkeypatch, uuid) as run:
        got = run(loads_and_describe, pickle.dumps(x))
    assert got["requires_grad"] and pickle.loads(got["values"]).equal(torch.full((8,), 3.0))


def test_a_process_that_sees_no_gpu_gets_a_placeholder_and_can_place_the_bytes_itself(gpu):
    ordinal, _ = gpu
    x = cases(torch, torch.device("cuda", ordinal))["transposed"]
    got = run_child(
        """
        import torch
        x = pickle.loads(data)
        try:
            gpu_serde.resolve(x)
            report(error=None)
        except gpu_serde.DeviceNotVisibleError as exc:
            y = gpu_serde.tensors.place(x, "cpu")
            report(error="DeviceNotVisibleError", uuid=exc.uuid, values=y.tolist(),
                   stride=list(y.stride()))
        """,
        dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        pickle.dumps(x, protocol=5),
    )
    assert got["error"] == "DeviceNotVisibleError" and got["uuid"] == gpu[1]
    assert got["values"] == x.cpu().tolist() and got["stride"] == list(x.stride())


def test_torch_save_keeps_torchs_own_format(gpu):
    ordinal, _ = gpu
    x = torch.arange(12.0, device=f"cuda:{ordinal}").reshape(3, 4).t()
    f = io.BytesIO()
    torch.save({"w": x}, f)
    f.seek(0)
    got = torch.load(f, weights_only=True)["w"]  # no gpu_serde name in the file
    assert got.device == x.device and got.equal(x)


def test_copy_copy_of_a_cuda_tensor_is_still_a_view_of_it(gpu):
    import copy

    ordinal, _ = gpu
    x = torch.zeros(4, device=f"cuda:{ordinal}")
    assert copy.copy(x).data_ptr() == x.data_ptr()


# ---- torch.multiprocessing: torch's own CUDA IPC, by UUID ---------------------------------------


def test_a_cuda_tensor_on_a_multiprocessing_queue_is_shared_on_the_same_gpu(gpu, monkeypatch):
    ordinal, uuid = gpu
    sent = cases(torch, torch.device("cuda", ordinal))
    leaves = {k: v for k, v in sent.items() if k != "empty"}
    want = {name: expected(t) for name, t in leaves.items()}  # before the child writes
    with child(monkeypatch, uuid) as run:
        got = {name: run(describe, t) for name, t in leaves.items()}
        x = sent["contiguous"]
        before = x.clone()
        run(describe_and_add, x)
        torch.cuda.synchronize()
        assert x.equal(before + 1000)  # the child wrote into the sender's memory
    for name in leaves:
        assert same(got[name], want[name]), name
        assert got[name]["device"] == 0


def test_a_tensor_in_gpu_serde_memory_on_a_multiprocessing_queue_travels_as_shared(
    gpu, monkeypatch
):
    ordinal, uuid = gpu
    x = gpu_serde.tensors.empty((1024,), torch.float32, ordinal)
    x.fill_(2.0)
    with child(monkeypatch, uuid) as run:
        got = run(describe_and_add, x)  # torch's IPC cannot share it: gpu_serde's share does
        torch.cuda.synchronize()
    assert pickle.loads(got["values"]).equal(torch.full((1024,), 2.0))
    assert x.equal(torch.full((1024,), 1002.0, device=x.device))


# ---- share: no copy on one host ---------------------------------------------------------------


def test_shared_tensors_reach_a_child_without_a_copy_with_their_layout(gpu, monkeypatch):
    ordinal, uuid = gpu
    sent = arena_cases(ordinal)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpu_serde.SharedCopyWarning)  # no copy for any of them
        shared = {name: gpu_serde.share(t) for name, t in sent.items()}
    assert not any(s.copied for s in shared.values())
    want = {name: expected(t) for name, t in sent.items()}  # before the child writes
    with child(monkeypatch, uuid) as run:
        got = {name: run(describe, s) for name, s in shared.items()}
        x = sent["contiguous"]
        before = x.clone()
        run(describe_and_add, gpu_serde.share(x))
        torch.cuda.synchronize()
        assert x.equal(before + 1000)  # the same memory
    for name in sent:
        assert same(got[name], want[name]), name
        assert got[name]["device"] == 0


def test_the_stream_gpu_serde_orders_after_is_torchs_current_one_in_each_thread(gpu):
    import threading

    from gpu_serde.memory import driver as _driver
    from gpu_serde.tensors import torch as torch_side

    ordinal, _ = gpu
    side = torch.cuda.Stream(ordinal)

    def public() -> int:  # torch's public answer, as the driver reads it
        return _driver.raw_stream(int(torch.cuda.current_stream(ordinal).cuda_stream))

    seen = {"default": (torch_side.current_stream(ordinal), public())}
    with torch.cuda.stream(side):
        seen["side"] = (torch_side.current_stream(ordinal), public())

        def other_thread() -> None:  # a thread has its own current stream: the default one
            seen["other thread"] = (torch_side.current_stream(ordinal), public())

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert all(mine == theirs for mine, theirs in seen.values()), seen
    assert seen["side"][0] == int(side.cuda_stream)
    assert seen["other thread"][0] == seen["default"][0] != seen["side"][0]


@pytest.mark.parametrize("how", ["pickled here", "on a multiprocessing queue"])
@pytest.mark.parametrize("where", ["a side stream", "the default stream"])
def test_work_queued_before_sending_is_done_before_the_receiver_reads(gpu, monkeypatch, where, how):
    ordinal, uuid = gpu
    x = gpu_serde.tensors.empty((1 << 20,), torch.float32, ordinal)
    x.zero_()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(ordinal) if where == "a side stream" else None
    with child(monkeypatch, uuid) as run:
        run(describe, gpu_serde.share(x))  # the region is mapped: the next read is the hot path
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1 << 30)  # about half a second of GPU time before the write
            x.fill_(7.0)
            if how == "pickled here":
                blob = pickle.dumps(gpu_serde.share(x))
                assert not torch.cuda.current_stream().query()  # sent while the write is queued
                got = run(loads_and_describe, blob)
            else:  # pickled in the queue's feeder thread, whose current stream is the default
                got = run(describe, gpu_serde.share(x))
    assert pickle.loads(got["values"]).equal(torch.full((1 << 20,), 7.0))


def test_a_tensor_outside_gpu_serde_memory_is_copied_once_and_said(gpu, monkeypatch):
    ordinal, uuid = gpu
    x = cases(torch, torch.device("cuda", ordinal))["slice with steps"]
    with pytest.warns(gpu_serde.SharedCopyWarning, match="copied"):
        s = gpu_serde.share(x)
    assert s.copied
    with child(monkeypatch, uuid) as run:
        got = run(describe, s)
    assert same(got, x)


def test_the_sender_may_drop_its_tensor_and_empty_torchs_cache_right_after_sending(
    gpu, monkeypatch
):
    ordinal, uuid = gpu
    zero_copy = gpu_serde.tensors.empty((1 << 20,), torch.float32, ordinal)
    zero_copy.copy_(torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{ordinal}"))
    plain = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{ordinal}") * 2
    want = [zero_copy.cpu(), plain.cpu()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpu_serde.SharedCopyWarning)
        shared = [gpu_serde.share(zero_copy), gpu_serde.share(plain)]
    with child(monkeypatch, uuid) as run:
        first = run(keep, shared[0])
        del zero_copy, plain, shared  # the sender lets go of everything
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        later = run(describe_kept, None)
        run(drop, None)
    assert pickle.loads(first["values"]).equal(want[0])
    assert pickle.loads(later["values"]).equal(want[0])


@pytest.mark.parametrize("where", ["the current stream", "a side stream"])
def test_a_dropped_shared_tensor_goes_back_only_once_the_work_on_every_stream_is_done(
    gpu, monkeypatch, where
):
    from cuda.core import Device

    from gpu_serde.memory import lifetime

    ordinal, uuid = gpu
    monkeypatch.setattr(lifetime, "RELEASE_GRACE_S", 0.0)  # held_bytes then counts holds only
    arena = gpu_serde.ArenaMemoryResource(Device(ordinal), 4 << 20)
    x = gpu_serde.tensors.empty((1 << 18,), torch.float32, ordinal, arena=arena)
    x.fill_(3.0)
    with child(monkeypatch, uuid) as run:
        assert same(run(keep, gpu_serde.share(x)), x)
        assert arena.held_bytes >= x.nbytes
        assert run(busy_then_drop, where) is True  # dropped at once, a read of it still queued
        assert wait_until(lambda: arena.held_bytes == 0, 60)
        busy_when_given_back = run(still_busy, None)
    # nobody said which stream read it last: the whole device, side streams too, is waited for
    assert not busy_when_given_back


def test_a_shared_copy_survives_the_sender_dropping_the_original_before_it_is_received(
    gpu, monkeypatch
):
    ordinal, uuid = gpu
    plain = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{ordinal}") * 3
    want = plain.cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gpu_serde.SharedCopyWarning)
        blob = pickle.dumps(gpu_serde.share(plain))  # the Shared object itself is gone too
    del plain
    torch.cuda.empty_cache()
    with child(monkeypatch, uuid) as run:
        got = run(loads_and_describe, blob)
    assert pickle.loads(got["values"]).equal(want)


EXPORTER = """
import pickle, sys, torch, gpu_serde
gpu_serde.install()
x = gpu_serde.tensors.empty((1 << 20,), torch.float32, 0)
x.copy_(torch.arange(1 << 20, dtype=torch.float32, device="cuda:0"))
torch.cuda.synchronize()
print(pickle.dumps(gpu_serde.share(x)).hex(), flush=True)
sys.stdin.read()
"""


def _exporter(uuid):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid)
    process = subprocess.Popen(
        [sys.executable, "-c", EXPORTER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    return process, bytes.fromhex(process.stdout.readline().strip())


def test_a_killed_sender_gives_exporter_gone_error_never_a_crash(gpu):
    _, uuid = gpu
    process, blob = _exporter(uuid)
    process.kill()
    process.wait(30)
    got = pickle.loads(blob)  # never raises: the error waits for use
    with pytest.raises(gpu_serde.ExporterGoneError):
        gpu_serde.resolve(got)


def test_a_tensor_received_before_its_sender_was_killed_keeps_its_bytes(gpu):
    _, uuid = gpu
    process, blob = _exporter(uuid)
    x = gpu_serde.resolve(pickle.loads(blob))  # mapped here, held
    process.kill()
    process.wait(30)
    assert x.cpu().equal(torch.arange(1 << 20, dtype=torch.float32))


def test_a_shared_tensor_for_a_process_that_sees_no_gpu_is_device_not_visible_error(gpu):
    ordinal, _ = gpu
    x = gpu_serde.tensors.empty((16,), torch.float32, ordinal)
    got = run_child(
        """
        x = pickle.loads(data)
        try:
            gpu_serde.resolve(x)
            report(error=None)
        except Exception as exc:
            report(error=type(exc).__name__)
        """,
        dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        pickle.dumps(gpu_serde.share(x)),
    )
    assert got["error"] == "DeviceNotVisibleError"


def test_a_model_moved_to_gpu_serde_memory_is_shared_without_a_copy(gpu, monkeypatch):
    ordinal, uuid = gpu
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32)).cuda(ordinal)
    params = list(model.parameters())
    gpu_serde.tensors.to_arena(model)
    assert list(model.parameters()) == params  # the same Parameter objects
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpu_serde.SharedCopyWarning)
        weights = {k: gpu_serde.share(v) for k, v in model.state_dict().items()}
    with child(monkeypatch, uuid) as run:
        got = {k: run(describe, s) for k, s in weights.items()}
    for k, v in model.state_dict().items():
        assert same(got[k], v), k


# ---- CuPy ------------------------------------------------------------------------------------


@pytest.fixture
def cupy(gpu):
    cupy = pytest.importorskip("cupy", reason="the CuPy tests need CuPy")
    cupy.cuda.Device(gpu[0]).use()
    return cupy


def cupy_cases(cupy):
    base = cupy.arange(4 * 6 * 8, dtype=cupy.float32).reshape(4, 6, 8)
    return {
        "contiguous": base,
        "negative strides": base[::-1, 1, ::-2],
        "float16": base.astype(cupy.float16)[1:, 2:],
        "complex64": (base + 1j * base).astype(cupy.complex64).T,
        "bool": base > 50,
    }


def test_a_pickled_cupy_array_arrives_on_the_same_gpu_with_its_layout_and_bytes(
    gpu, cupy, monkeypatch
):
    _, uuid = gpu
    sent = cupy_cases(cupy)
    with child(monkeypatch, uuid) as run:
        got = {k: run(loads_and_describe, pickle.dumps(a, protocol=5)) for k, a in sent.items()}
    for k, a in sent.items():
        assert same(got[k], a), k


def test_a_cupy_array_allocated_in_gpu_serde_memory_is_shared_without_a_copy(
    gpu, cupy, monkeypatch
):
    _, uuid = gpu
    with cupy.cuda.using_allocator(gpu_serde.tensors.cupy_allocator()):
        a = cupy.arange(1 << 16, dtype=cupy.float32)
    view = a.reshape(256, 256)[::-1, 3:]
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpu_serde.SharedCopyWarning)
        s, v = gpu_serde.share(a), gpu_serde.share(view)
    with child(monkeypatch, uuid) as run:
        got_view = run(describe, v)
        assert same(got_view, view)
        before = a.copy()
        run(describe_and_add, s)
        cupy.cuda.Device().synchronize()
        assert bool((a == before + 1000).all())  # the child wrote into the sender's memory


def test_a_cupy_array_outside_gpu_serde_memory_is_copied_once_and_said(gpu, cupy, monkeypatch):
    _, uuid = gpu
    a = cupy_cases(cupy)["negative strides"]
    with pytest.warns(gpu_serde.SharedCopyWarning):
        s = gpu_serde.share(a)
    with child(monkeypatch, uuid) as run:
        got = run(describe, s)
    assert same(got, a)


def test_a_cupy_array_for_a_process_that_sees_no_gpu_is_device_not_visible_error(
    gpu, cupy, monkeypatch
):
    blob = pickle.dumps(cupy.arange(8), protocol=5)
    with child(monkeypatch, "") as run:  # sees no GPU
        got = run(loads_and_error, blob)
    assert got["error"] == "DeviceNotVisibleError"


# ---- Ray -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_session(real_gpu):
    ray_by_value("tensortier")
    with ray_on(Tier("real", real_gpu, 1 << 30), __name__) as ray:
        yield ray


def test_ray_actor_and_task_receive_cuda_tensors_by_value_and_shared(ray_session, gpu):
    ray = ray_session
    ordinal, _ = gpu

    @ray.remote(num_gpus=0.25)
    class Consumer:
        def describe(self, x):
            return describe(x)

        def add(self, x):
            return describe_and_add(x)

    @ray.remote(num_gpus=0.25, max_calls=0)
    def consume(x):
        return describe(x)

    plain = cases(torch, torch.device("cuda", ordinal))["transposed"]
    arena = arena_cases(ordinal)["slice with steps"]
    consumer = Consumer.remote()
    by_value = ray_get(consumer.describe.remote(plain))
    shared = ray_get(consumer.describe.remote(gpu_serde.share(arena)))
    put = ray_get(consume.remote(ray.put(gpu_serde.share(arena))))
    base = arena_cases(ordinal)["contiguous"]
    before = base.clone()
    ray_get(consumer.add.remote(gpu_serde.share(base)))
    torch.cuda.synchronize()
    ray.kill(consumer)
    assert same(by_value, plain) and same(shared, arena) and same(put, arena)
    assert base.equal(before + 1000)  # the actor wrote into the driver's memory


def test_a_tensor_shared_from_a_ray_gpu_task_that_ray_ends_arrives_with_its_bytes(ray_session, gpu):
    """Ray ends a GPU task's worker after the task (max_calls=1, its default): a keeper serves
    the shared tensor's memory once the worker has exited."""
    ray = ray_session

    @ray.remote(num_gpus=0.25, num_returns=2)  # Ray's default max_calls
    def make():
        import torch

        x = gpu_serde.tensors.empty((1 << 20,), torch.float32, 0)
        x.copy_(torch.arange(1 << 20, dtype=torch.float32, device="cuda:0"))
        return os.getpid(), gpu_serde.share(x)

    @ray.remote(num_gpus=0.25, max_calls=0)
    def total(x):
        return float(x.double().sum())

    pid_ref, x_ref = make.remote()
    pid = ray_get(pid_ref)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")  # Ray ended the worker
    assert ray_get(total.remote(x_ref)) == float(sum(range(1 << 20)))


def test_a_ray_actor_returns_a_shared_tensor_to_another_actor(ray_session, gpu):
    ray = ray_session

    @ray.remote(num_gpus=0.25)
    class Producer:
        def make(self):
            import torch

            x = gpu_serde.tensors.empty((1 << 20,), torch.float32, 0)
            x.copy_(torch.arange(1 << 20, dtype=torch.float32, device="cuda:0"))
            return gpu_serde.share(x)  # the actor drops x: the memory stays for the receiver

    @ray.remote(num_gpus=0.25)
    class Consumer:
        def describe(self, x):
            return describe(x)

    producer, consumer = Producer.remote(), Consumer.remote()
    got = ray_get(consumer.describe.remote(producer.make.remote()))
    ray.kill(producer)
    ray.kill(consumer)
    assert pickle.loads(got["values"]).equal(torch.arange(1 << 20, dtype=torch.float32))
    assert got["uuid"] == gpu[1]


@pytest.mark.parametrize("noset", [False, True], ids=["ray-sets-cuda-visible-devices", "noset"])
def test_ray_direct_transport_hands_tensors_actor_to_actor_by_uuid(ray_session, gpu, noset):
    ray = ray_session
    import gpu_serde.ray

    if not gpu_serde.ray.tensor_transport.supported():
        pytest.fail(f"Ray {ray.__version__} has no custom tensor transports (2.55 and later)")
    env = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}} if noset else {}

    @ray.remote(num_gpus=0.25, enable_tensor_transport=True, runtime_env=env)
    class Sender:
        @ray.method(tensor_transport=gpu_serde.ray.TENSOR_TRANSPORT)
        def tensors(self):
            import torch

            last = torch.cuda.device_count() - 1  # under NOSET: every GPU of the node
            plain = torch.arange(1 << 20, dtype=torch.float32, device=f"cuda:{last}")
            arena = gpu_serde.tensors.empty((1 << 10,), torch.float32, last)
            arena.copy_(plain[: 1 << 10] * 2)
            return [plain.t(), arena]

    @ray.remote(num_gpus=0.25, enable_tensor_transport=True, runtime_env=env)
    class Receiver:
        def describe(self, tensors):
            return [describe(t) for t in tensors]

    sender, receiver = Sender.remote(), Receiver.remote()
    got = ray_get(receiver.describe.remote(sender.tensors.remote()))
    ray.kill(sender)
    ray.kill(receiver)
    want = torch.arange(1 << 20, dtype=torch.float32)
    assert pickle.loads(got[0]["values"]).equal(want)
    assert pickle.loads(got[1]["values"]).equal(want[: 1 << 10] * 2)
    assert {g["uuid"] for g in got} == {gpu[1]}


# ---- Dask ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dask_client(real_gpu):
    with dask_on(Tier("real", real_gpu, 1 << 30), n_workers=2) as client:
        yield client


def make_on_worker(kind):
    import torch

    import gpu_serde

    if kind == "plain":
        return torch.arange(4096, dtype=torch.float32, device="cuda:0").reshape(64, 64).t()
    if kind == "parameter":
        return torch.nn.Parameter(torch.ones(16, device="cuda:0"))
    x = gpu_serde.tensors.empty((4096,), torch.float32, 0)
    x.copy_(torch.arange(4096, dtype=torch.float32, device="cuda:0"))
    return gpu_serde.share(x)


@pytest.mark.parametrize("kind", ["plain", "parameter", "shared"])
def test_a_cuda_tensor_result_goes_worker_to_worker_and_the_future_settles(dask_client, gpu, kind):
    client = dask_client
    a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
    made = client.submit(make_on_worker, kind, workers=[a], pure=False)
    got = client.submit(describe, made, workers=[b], pure=False).result(timeout=300)
    assert got["uuid"] == gpu[1] and got["device"] == 0
    values = pickle.loads(got["values"])
    if kind == "parameter":
        assert got["type"] == "Parameter" and got["requires_grad"] and values.equal(torch.ones(16))
    elif kind == "plain":
        assert got["stride"] == [1, 64]
        assert values.equal(torch.arange(4096, dtype=torch.float32).reshape(64, 64).t())
    else:
        assert values.equal(torch.arange(4096, dtype=torch.float32))


def test_a_cuda_tensor_goes_client_to_worker_as_an_argument_and_scattered(dask_client, gpu):
    client = dask_client
    ordinal, _ = gpu
    x = cases(torch, torch.device("cuda", ordinal))["bf16"]
    as_argument = client.submit(describe, x, pure=False).result(timeout=300)
    [scattered] = client.scatter([x])
    from_scatter = client.submit(describe, scattered, pure=False).result(timeout=300)
    assert same(as_argument, x) and same(from_scatter, x)


def test_a_dask_result_gathered_by_the_client_is_on_the_clients_ordinal_of_the_gpu(
    dask_client, gpu
):
    got = dask_client.submit(make_on_worker, "plain", pure=False).result(timeout=300)
    assert got.device.index == gpu[0]
    assert got.cpu().equal(torch.arange(4096, dtype=torch.float32).reshape(64, 64).t())


def test_dask_on_routes_a_cuda_tensor_a_shared_tensor_and_a_cupy_array_to_their_gpu(
    dask_client, gpu
):
    from gpu_serde.dask import on
    from gpu_serde.routing import target_uuid

    ordinal, uuid = gpu
    x = torch.arange(64, dtype=torch.float32, device=torch.device("cuda", ordinal))
    y = gpu_serde.tensors.empty((64,), torch.float32, ordinal)
    y.copy_(x)
    sent = {"tensor": x, "parameter": torch.nn.Parameter(x.clone()), "shared": gpu_serde.share(y)}
    try:
        import cupy
    except ImportError:  # CuPy is no extra of gpu_serde's: the torch cases still run
        cupy = None
    if cupy is not None:
        with cupy.cuda.Device(ordinal):
            sent["cupy"] = cupy.arange(64, dtype=cupy.float32)
    for what, obj in sent.items():
        assert target_uuid(obj) == uuid, what
        got = dask_client.submit(describe, obj, pure=False, **on(obj)).result(timeout=300)
        assert got["uuid"] == uuid, what


def test_error_of_reports_what_a_placeholder_raises():
    """The job the no-GPU tests use reports the typed error (a check of the helper itself)."""
    from gpu_serde import wire
    from gpu_serde.format.device import encode_device

    stranger = encode_device(bytes(range(16)), False, 3, 42, "node-b", "NVIDIA H200")
    meta = ("torch", "Tensor", "float32", 4, (4,), (1,), 0, False)
    got = error_of(wire.tval((1, stranger, meta, 0, 16, bytes(16))))
    assert got["error"] == "DeviceNotVisibleError"
