"""torch tensors with gpu_serde installed, on the CPU tier (a CPU build of torch): CPU tensors
keep the engine's own path, the reducers are registered once torch is imported, and a by-value
payload's layout (dtype, shape, strides, offset, requires_grad, Parameter) survives the trip.
The CUDA paths themselves run on the GPU tier (tests/test_tensors_gpu.py).
"""

from __future__ import annotations

import copyreg
import importlib.util
import io
import pickle
import types

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is installed for the CPU tier on Python 3.11 only (scripts/_venv.sh)"
)

import gpu_serde  # noqa: E402
from gpu_serde import DeviceNotVisibleError, UnresolvedObject, registry, wire  # noqa: E402
from gpu_serde.format.device import encode_device  # noqa: E402
from gpu_serde.tensors import torch as reducers  # noqa: E402
from gpu_serde.tensors.common import torch_pickles  # noqa: E402

STRANGER = encode_device(bytes(range(16)), False, 3, 42, "node-b", "NVIDIA H200")
BASE = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
CASES = {
    "contiguous": BASE.clone(),
    "transposed": BASE.transpose(0, 2),
    "slice with steps": BASE[1:3, ::2, 3:],
    "storage offset": BASE.flatten()[17:40],
    "bf16": BASE.to(torch.bfloat16)[2:, 1],
    "requires_grad": BASE.clone().requires_grad_(True),
    "parameter": torch.nn.Parameter(BASE.clone()),
    "frozen parameter": torch.nn.Parameter(BASE.clone(), requires_grad=False),
    "expanded": torch.arange(8).expand(3, 8),
    "bool": BASE > 50,
    "complex": torch.complex(BASE, -BASE)[1],
    "empty": BASE[:, :0],
}


def cpu_payload(t) -> tuple:
    """What the sender's reducer puts on the wire for a CUDA tensor laid out like ``t`` (a CPU
    tensor here), naming a GPU no test process sees."""
    kind, grad = reducers._KINDS[type(t)], t.requires_grad
    meta = reducers.meta_of(t.detach())._replace(kind=kind, requires_grad=grad)
    low, high = meta.span()
    flat = t.detach().as_strided((high - low,), (1,), low)
    data = flat.contiguous().view(torch.uint8).numpy().tobytes() if high > low else b""
    return (1, STRANGER, meta.wire(), low, len(data), data)


@pytest.fixture
def installed_torch(simulated_gpus):
    gpu_serde.install()
    yield
    gpu_serde.uninstall()


@pytest.mark.parametrize("name", ["contiguous", "transposed", "storage offset", "parameter"])
def test_a_cpu_tensor_pickles_to_the_same_bytes_as_without_gpu_serde(simulated_gpus, name):
    t = CASES[name]
    before = pickle.dumps(t)
    gpu_serde.install()
    try:
        assert pickle.dumps(t) == before
    finally:
        gpu_serde.uninstall()


def test_torch_multiprocessing_shares_a_cpu_tensor_as_torch_does(installed_torch):
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    reducer = ForkingPickler._extra_reducers[torch.Tensor]
    assert reducer is reducers.reduce_tensor_mp
    assert reducer(CASES["contiguous"])[0] is reductions.rebuild_tensor  # torch's own


def test_the_reducers_are_registered_for_tensor_and_parameter_and_uninstall_puts_torchs_back(
    simulated_gpus,
):
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    assert {torch.Tensor, torch.nn.Parameter} <= set(registry.handled())
    gpu_serde.install()
    assert copyreg.dispatch_table[torch.Tensor] is reducers.reduce_tensor
    assert copyreg.dispatch_table[torch.nn.Parameter] is reducers.reduce_tensor
    gpu_serde.uninstall()
    assert torch.Tensor not in copyreg.dispatch_table
    assert ForkingPickler._extra_reducers[torch.Tensor] is reductions.reduce_tensor


@pytest.mark.parametrize("name", list(CASES))
def test_a_by_value_payload_keeps_the_layout_and_bytes_when_placed_on_the_cpu(installed, name):
    t = CASES[name]
    got = pickle.loads(pickle.dumps(_Call(wire.tval, cpu_payload(t)), protocol=5))
    assert isinstance(got, UnresolvedObject)  # its GPU is not visible here
    with pytest.raises(DeviceNotVisibleError):
        gpu_serde.resolve(got)
    placed = gpu_serde.tensors.place(got, "cpu")
    assert type(placed) is type(t) and placed.dtype == t.dtype
    assert placed.shape == t.shape and placed.stride() == t.stride()
    assert placed.storage_offset() == t.storage_offset()
    assert placed.requires_grad == t.requires_grad
    assert torch.equal(placed.detach(), t.detach())


@pytest.mark.parametrize("elements_before", [1 << 20, 1 << 40])
def test_a_slice_far_into_its_storage_arrives_without_the_storage_before_it(
    installed, elements_before
):
    """A receiver allocates what a payload carries, not what its offset claims: the last row of
    a big tensor, or a forged offset, never costs the memory before it."""
    t = torch.arange(8, dtype=torch.float32)
    payload = cpu_payload(t)
    meta = (*payload[2][:6], elements_before, False)
    placed = gpu_serde.tensors.place(
        wire.tval((1, STRANGER, meta, elements_before, 32, payload[5])), "cpu"
    )
    assert placed.untyped_storage().nbytes() == 32 and placed.storage_offset() == 0
    assert torch.equal(placed, t)


def test_torch_given_a_placeholder_raises_its_reason(installed):
    x = wire.tval(cpu_payload(torch.zeros(2, 2)))
    with pytest.raises(DeviceNotVisibleError):
        torch.sum(x)
    with pytest.raises(DeviceNotVisibleError):
        torch.cat([x, x])
    with pytest.raises(DeviceNotVisibleError):
        torch.nn.Linear(2, 2).load_state_dict({"weight": x, "bias": x})


def test_place_moves_a_tensor_that_arrived_as_a_tensor():
    assert gpu_serde.tensors.place(CASES["contiguous"], "cpu") is CASES["contiguous"]


@pytest.mark.parametrize("device", ["cuda:0", 0, "cuda", torch.device("cuda", 3)])
def test_place_on_a_gpu_torch_cannot_use_is_device_not_visible_error(installed, device):
    # this tier's torch is a CPU build: torch itself would raise an AssertionError
    if torch.backends.cuda.is_built():
        pytest.skip("a CUDA build of torch: the CPU tier's torch is a CPU build")
    for x in (CASES["contiguous"], wire.tval(cpu_payload(torch.zeros(2, 2)))):
        with pytest.raises(DeviceNotVisibleError, match="torch was built without CUDA"):
            gpu_serde.tensors.place(x, device)


@pytest.mark.parametrize("device", ["gpu", 1.5, None, "cuda:x"])
def test_place_on_what_names_no_device_is_a_type_error(device):
    with pytest.raises(TypeError, match=r"device is 'cpu', 'cuda:N', a torch\.device or a GPU"):
        gpu_serde.tensors.place(CASES["contiguous"], device)


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_place_on_the_meta_device_is_a_type_error(installed, device):
    # "meta" would give a tensor without the bytes that came: nothing is lost without a word
    for x in (CASES["contiguous"], wire.tval(cpu_payload(torch.zeros(2, 2)))):
        with pytest.raises(TypeError, match="a 'meta' device keeps no bytes"):
            gpu_serde.tensors.place(x, device)


@pytest.mark.parametrize(
    ("make", "error", "says"),
    [
        (lambda: torch.nn.Linear(2, 2), ValueError, "this Linear holds no CUDA tensor"),
        (lambda: torch.zeros(2), ValueError, r"this tensor \(on cpu\) holds no CUDA tensor"),
        (
            lambda: [torch.zeros(2)],
            TypeError,
            "takes a torch.nn.Module or a torch.Tensor, not list",
        ),
    ],
)
def test_to_arena_of_what_is_not_on_a_gpu_says_to_move_it_there_first(make, error, says):
    with pytest.raises(error, match=says):
        gpu_serde.tensors.to_arena(make())


@pytest.mark.parametrize("shape", [(2, 3), 4, torch.Size([4])])
def test_empty_where_torch_has_no_gpu_says_so(installed, shape):
    # an int is a shape of one dimension, as torch.empty(4) takes it
    with pytest.raises(DeviceNotVisibleError, match="torch here has no GPU"):
        gpu_serde.tensors.empty(shape)


@pytest.mark.parametrize(
    ("args", "error", "says"),
    [
        (("x",), TypeError, "torch.Size"),
        (((2,), "x"), TypeError, "dtype"),
        (((2,), None, "cpu"), ValueError, "GPU memory, not cpu"),
        (((2,), None, "garbage\x1b"), ValueError, r"'garbage\\x1b' names no torch device"),
        (((2,), None, -1), ValueError, "0 or more"),
        (((2,), None, True), TypeError, "device must be"),
    ],
)
def test_empty_says_what_is_wrong_with_its_arguments_before_that_torch_has_no_gpu(
    installed, args, error, says
):
    with pytest.raises(error, match=says):
        gpu_serde.tensors.empty(*args)


@pytest.mark.parametrize("arena", ["arena", 1 << 30, torch.cuda.memory])
def test_empty_in_what_is_not_an_arena_is_a_type_error_before_that_torch_has_no_gpu(
    installed, arena
):
    with pytest.raises(TypeError, match=r"arena= takes a gpu_serde\.ArenaMemoryResource"):
        gpu_serde.tensors.empty((2,), arena=arena)


def test_cupy_allocator_without_cupy_says_to_install_it_here(installed):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(gpu_serde.HandoffError) as info:
        gpu_serde.tensors.cupy_allocator()
    assert "which gpu_serde.tensors.cupy_allocator() needs: install cupy here" in str(info.value)
    assert "receive it" not in str(info.value)  # nothing was received


def test_to_arena_into_what_is_not_an_arena_is_a_type_error_even_with_nothing_to_move():
    with pytest.raises(TypeError, match=r"arena= takes a gpu_serde\.ArenaMemoryResource"):
        gpu_serde.tensors.to_arena(torch.nn.ReLU(), arena="arena")


def test_to_arena_of_a_module_with_no_tensor_returns_it_as_it_was():
    relu = torch.nn.ReLU()
    assert gpu_serde.tensors.to_arena(relu) is relu


def test_a_non_float_payload_that_asks_for_grad_is_a_payload_error(installed):
    payload = cpu_payload(CASES["expanded"])
    meta = (*payload[2][:7], True)
    got = wire.tval((*payload[:2], meta, *payload[3:]))
    with pytest.raises(gpu_serde.PayloadError, match="cannot require grad"):
        gpu_serde.tensors.place(got, "cpu")


def test_a_dtype_this_torch_does_not_have_is_a_payload_error(installed):
    payload = cpu_payload(CASES["contiguous"])
    meta = ("torch", "Tensor", "float4_e9", 4, *payload[2][4:])
    got = wire.tval((*payload[:2], meta, *payload[3:]))
    with pytest.raises(gpu_serde.PayloadError, match=r"no dtype .float4_e9."):
        gpu_serde.tensors.place(got, "cpu")


@pytest.mark.parametrize(
    "obj", [CASES["contiguous"], [1, 2], "x"], ids=["cpu tensor", "list", "str"]
)
def test_share_takes_only_cuda_tensors_and_arrays(obj):
    with pytest.raises(TypeError, match=r"gpu_serde\.share\(\) takes"):
        gpu_serde.share(obj)


def test_sending_on_torchs_default_stream_needs_no_event_and_another_stream_one(installed):
    from gpu_serde.errors import HandoffError
    from gpu_serde.memory.driver import LEGACY_STREAM
    from gpu_serde.tensors.sharing import follow

    absent = len(installed) + 5  # no such device: any driver call on it is refused
    follow(absent, 0, LEGACY_STREAM)  # torch's and CuPy's 0 is cuda.core's default stream
    follow(absent, 77, 77)
    with pytest.raises(HandoffError, match="cuDeviceGet"):
        follow(absent, 77, LEGACY_STREAM)  # another stream: an event on the device


def test_torch_pickling_keeps_torchs_own_reduction():
    """torch.save, torch.package, torch.distributed and copy.copy pickle from torch's (or copy's)
    own frames: there a tensor keeps torch's reduction."""

    def called_from(module: str) -> bool:
        code = compile("check()", module, "eval")
        return eval(code, {"__name__": module, "check": torch_pickles})

    assert called_from("torch.serialization") and called_from("copy")
    assert not called_from("ray.cloudpickle") and not called_from("__main__")
    assert not torch_pickles()  # this test module pickles as any user does


def test_torch_save_of_a_cpu_tensor_loads_with_weights_only(installed_torch):
    f = io.BytesIO()
    torch.save({"w": CASES["transposed"]}, f)
    f.seek(0)
    got = torch.load(f, weights_only=True)["w"]
    assert torch.equal(got, CASES["transposed"]) and got.stride() == CASES["transposed"].stride()


def test_dask_sends_a_cpu_tensor_through_distributeds_own_entry(installed_torch):
    from distributed.protocol import deserialize, serialize
    from distributed.protocol.torch import serialize_torch_Tensor

    import gpu_serde.dask  # noqa: F401  (its entries, in place once torch is imported)

    t = CASES["storage offset"]
    header, frames = serialize(t, serializers=("dask",))
    assert header["sub-header"]["gpu_serde-theirs"] == "torch.Tensor"
    _, theirs = serialize_torch_Tensor(t)
    assert [bytes(memoryview(f)) for f in frames] == [bytes(memoryview(f)) for f in theirs]
    assert torch.equal(deserialize(header, frames), t)


def test_dask_sends_a_bfloat16_cpu_tensor_that_distributeds_entry_cannot(installed_torch):
    from distributed.protocol import deserialize, serialize

    import gpu_serde.dask  # noqa: F401  (its entries, in place once torch is imported)

    t = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()
    header, frames = serialize(t, serializers=("dask",))
    got = deserialize(header, frames)
    assert got.dtype == torch.bfloat16 and got.stride() == t.stride() and torch.equal(got, t)


def test_dask_sends_a_cpu_parameter_through_distributeds_own_entry(installed_torch):
    from distributed.protocol import deserialize, serialize

    import gpu_serde.dask  # noqa: F401

    p = CASES["parameter"]
    got = deserialize(*serialize(p, serializers=("dask",)))
    assert type(got) is torch.nn.Parameter and torch.equal(got.detach(), p.detach())


def test_a_placeholder_sent_through_dask_arrives_as_the_same_placeholder(installed_torch):
    from distributed.protocol import deserialize, serialize

    got = wire.tval(cpu_payload(CASES["bf16"]))
    again = deserialize(*serialize(got, serializers=("pickle",)))
    assert isinstance(again, UnresolvedObject)
    assert pickle.dumps(again, protocol=5) == pickle.dumps(got, protocol=5)


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def test_the_lazy_hook_left_torchs_module_as_torch_loaded_it():
    assert isinstance(torch, types.ModuleType)
    assert type(torch.__loader__).__name__ == "SourceFileLoader"
    assert torch.__spec__ is not None and torch.__spec__.loader is torch.__loader__


def _return(x):
    return x


def _use(x):
    import gpu_serde

    gpu_serde.resolve(x)
    return x.sum().item()


def test_dask_carries_cpu_tensors_and_placeholders_worker_to_worker_and_no_future_hangs(
    installed_torch,
):
    from distributed import Client, LocalCluster

    import gpu_serde.dask

    t = CASES["transposed"]
    stranger = wire.tval(cpu_payload(CASES["bf16"]))  # a GPU no process here sees
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
        made = client.submit(_return, t, workers=[a], pure=False)
        total = client.submit(_use, made, workers=[b], pure=False).result(timeout=60)
        far = client.submit(_return, stranger, workers=[a], pure=False)
        used = client.submit(_use, far, workers=[b], pure=False)
        with pytest.raises(DeviceNotVisibleError):
            used.result(timeout=60)  # the typed error, not a future that never settles
    assert total == t.sum().item()


# ---- gpu_serde.testing.sent_tensor: what a GPU worker's CUDA tensor looks like on a CPU machine
COMPLEX = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (1 + 2j)
VIEWS = {
    **CASES,
    "conjugate slice": COMPLEX[1:].conj(),
    "conjugate with steps": COMPLEX[:, ::2].conj(),
    "imaginary part of a conjugate": COMPLEX.conj().imag,
    "negative view": torch._neg_view(COMPLEX[1:]),
    "empty": torch.empty((0, 3)),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_a_cuda_tensor_from_a_gpu_worker_arrives_as_a_placeholder_whose_bytes_place_on_cpu(
    installed, name
):
    from gpu_serde.testing import sent_tensor

    t = VIEWS[name]
    x = pickle.loads(sent_tensor(t, installed[0]))  # the GPU is this process's; torch's is CPU
    assert isinstance(x, UnresolvedObject)
    with pytest.raises(DeviceNotVisibleError, match="torch here has no GPU") as info:
        x.sum()
    assert "gpu_serde.tensors.place(x, 'cpu')" in str(info.value)
    assert info.value.uuid == installed[0].uuid and installed[0].uuid in str(info.value)
    assert info.value.host and info.value.visible
    got = gpu_serde.tensors.place(x, "cpu")
    assert type(got) is type(t) and got.requires_grad == t.requires_grad
    assert got.shape == t.shape and torch.equal(got.resolve_conj().resolve_neg(), t.resolve_conj())
    if not (t.is_conj() or t.is_neg()):  # those arrive resolved, as the sender's reducer sends
        assert got.stride() == t.stride()


def test_a_cuda_tensor_from_a_gpu_this_process_does_not_see_says_which_gpu(installed):
    from gpu_serde.testing import make_gpus, sent_tensor

    elsewhere = make_gpus(1, seed="another node")[0]
    x = pickle.loads(sent_tensor(CASES["contiguous"], elsewhere, host="node-b"))
    with pytest.raises(DeviceNotVisibleError, match=elsewhere.uuid) as info:
        x.sum()
    assert "node-b" in str(info.value)
    assert torch.equal(gpu_serde.tensors.place(x, "cpu"), CASES["contiguous"])


@pytest.mark.parametrize(
    ("t", "gpu", "says"),
    [
        ([1, 2], "gpu", "a CPU torch.Tensor, not list"),
        (torch.zeros(2), "GPU-0", "a SimulatedGPU, not str"),
        (torch.zeros(2).to_sparse(), None, "dense"),
    ],
)
def test_sent_tensor_says_what_it_takes(installed, t, gpu, says):
    from gpu_serde.testing import sent_tensor

    with pytest.raises(TypeError, match=says):
        sent_tensor(t, installed[0] if gpu is None else gpu)


@pytest.mark.parametrize("host", [5, "", "node\x1b[31m"])
def test_sent_tensor_takes_a_printable_host_name(installed, host):
    from gpu_serde.testing import sent_tensor

    with pytest.raises(TypeError, match=r"sent_tensor\(host=\.\.\.\): a host name"):
        sent_tensor(torch.zeros(2), installed[0], host=host)
