"""What runs in every process of ``handoff_table.py``: making the object each path hands off, and
receiving it. Imported by name in Ray workers, Dask workers and multiprocessing children (the
benchmarks folder is on their ``sys.path``), so that each process keeps its arena, its pool and
its scratch memory between calls.

Paths (what crosses from sender to receiver):
- ``int``: the int itself: the engine's own round trip, subtracted from every other path;
- ``plain``: a plain object the size of an arena buffer's pickle (bytes, no GPU memory): what the
  engine charges for carrying any pickled object instead of an int, gpu_serde aside;
- ``arena``: a Buffer of a gpu_serde ArenaMemoryResource (the new path);
- ``arena-again``: the same arena Buffer every round (sent again: a weight broadcast);
- ``arena-busy``: a new arena Buffer sent right after the sender queued other GPU work on
  another stream (a 256 MiB memset the buffer does not depend on);
- ``arena-new``: the whole of a new ArenaMemoryResource: the first hand-off from a region;
- ``pool``: a Buffer of an IPC-enabled DeviceMemoryResource that keeps its memory (release
  threshold = its size), today's gpu_serde path;
- ``torch``: a torch CUDA tensor, through whatever the engine does by default (Ray's object store,
  torch.multiprocessing's CUDA IPC), or Ray Direct Transport ``cuda_ipc`` when the caller asks;
- ``cupy``: a CuPy array (Dask's default for GPU arrays: distributed's serialization);
- ``share``: a torch tensor in the sender's arena, wrapped by ``gpu_serde.share`` (no copy);
- ``arena-tensor``: the same tensor, not wrapped (what a Ray Direct Transport hands over);
- ``torch-own``: a torch CUDA tensor pickled by torch's own reduction, as if gpu_serde were not
  installed (Ray's object store; through multiprocessing, torch.multiprocessing's CUDA IPC).

Every object carries a marker: its first 4-byte word is set (by the sender, before it sends) to a
value the caller picks, and the receiver reads that word back with ``cuMemcpyDtoH`` and returns it.
The ``int`` path writes and reads the same 4 bytes of scratch memory, so that the subtraction
leaves the hand-off alone.
"""

from __future__ import annotations

import os
import time
from typing import Any

ARENA_SLACK = 1 << 30  # an arena's room beyond two buffers of the largest size
_state: dict[str, Any] = {}


def _dev() -> Any:
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    return dev


def _check(call: str, result: tuple) -> Any:
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{call} failed: {result[0]!r}")
    return result[1] if len(result) > 1 else None


def setup(max_size: int) -> str:
    """Start CUDA here, install gpu_serde and make 4 bytes of scratch memory; a sender's arena
    (room for two buffers of ``max_size``) and pool are made on first use. Idempotent. Returns
    the process's pid."""
    if _state.get("max_size") == max_size:
        return str(os.getpid())
    import gpu_serde
    from gpu_serde.memory import lifetime as handoff

    gpu_serde.install()
    handoff.RELEASE_GRACE_S = 0.0  # a released buffer goes back at once (the benchmark reuses)
    dev = _dev()
    _state.clear()
    _state["max_size"] = max_size
    _state["scratch"] = dev.allocate(4, stream=dev.default_stream)
    dev.default_stream.sync()
    return str(os.getpid())


def _memory(kind: str) -> Any:
    """This sender's arena or pool, made the first time."""
    if kind not in _state:
        from _common import ipc_pool

        import gpu_serde

        dev, max_size = _dev(), _state["max_size"]
        if kind == "arena":  # arena and arena-busy: a buffer in flight and a new one
            room = 2 * max_size + min(ARENA_SLACK, max_size)
            _state[kind] = gpu_serde.ArenaMemoryResource(dev, room)
        elif kind == "again arena":  # arena-again's one buffer, kept for a size's rounds: in
            # the shared arena it split the free space (16 GiB found no block at 16 GiB)
            room = max_size + min(ARENA_SLACK, max_size)
            _state[kind] = gpu_serde.ArenaMemoryResource(dev, room)
        elif kind == "probe":  # a buffer pickled once and never received: kept until exit
            _state[kind] = gpu_serde.ArenaMemoryResource(dev, 1)
        else:
            _state[kind] = ipc_pool(dev, 2 * max_size, keep=True)
    return _state[kind]


def _retry(allocate: Any) -> Any:
    """Allocate, waiting up to 30 s for released memory (the last hand-off's importer releases
    it in the background)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return allocate()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.002)


def _mark(ptr: int, value: int) -> None:
    from cuda.bindings import driver

    _check("cuMemsetD32", driver.cuMemsetD32(ptr, value, 1))


def make_object(path: str, size: int, value: int) -> Any:
    """The object ``path`` hands off, ``size`` bytes, marked with ``value`` (see the module)."""
    dev = _dev()
    if path == "int":
        _mark(int(_state["scratch"].handle), value)
        return value
    if path == "plain":
        _mark(int(_state["scratch"].handle), value)
        return Plain(value, bytes(_arena_pickle_bytes()))
    if path == "arena":
        arena = _memory("arena")
        obj = _retry(lambda: arena.allocate(size))
    elif path == "arena-again":
        if "again" not in _state or _state["again"].size != size:
            # no reference to the last size's buffer may stay here: it is freed (once its
            # importers released it) only when the last one goes, and the new one needs its room
            _state.pop("again", None)
            arena = _memory("again arena")
            _state["again"] = _retry(lambda: arena.allocate(size))
        obj = _state["again"]
    elif path == "arena-busy":
        arena = _memory("arena")
        obj = _retry(lambda: arena.allocate(size))
        _traffic()
    elif path == "arena-new":
        import gpu_serde

        # a new region each time (the previous one is freed once its importer released it)
        arena = gpu_serde.ArenaMemoryResource(dev, size)
        obj = arena.allocate(arena.size)
    elif path == "pool":
        pool = _memory("pool")
        obj = _retry(lambda: pool.allocate(size, stream=dev.default_stream))
        dev.default_stream.sync()
    elif path == "torch":
        import torch

        if _state.get("torch size") != size:  # a new size: give the last one's cache back
            _state.pop("torch", None)
            torch.cuda.empty_cache()
            _state["torch size"] = size
        obj = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        _mark(obj.data_ptr(), value)
        return obj
    elif path == "cupy":
        import cupy

        obj = cupy.empty(size, dtype=cupy.uint8)
        _mark(obj.data.ptr, value)
        return obj
    elif path in ("share", "arena-tensor"):
        import torch

        import gpu_serde

        arena = _memory("arena")
        t = _retry(lambda: gpu_serde.tensors.empty((size,), torch.uint8, 0, arena=arena))
        _mark(t.data_ptr(), value)
        return gpu_serde.share(t) if path == "share" else t
    elif path == "torch-own":
        return TorchOwn(make_object("torch", size, value))
    else:
        raise ValueError(f"unknown path {path!r}")
    _mark(int(obj.handle), value)
    return obj


class Plain:
    """A plain object: the marker value and padding, pickled by value."""

    def __init__(self, value: int, padding: bytes) -> None:
        self.value, self.padding = value, padding


def _arena_pickle_bytes() -> int:
    """How many bytes an arena buffer's pickle takes (the payload a hand-off carries)."""
    if "pickle bytes" not in _state:
        import pickle

        buf = _memory("probe").allocate(1)
        _state["pickle bytes"] = len(pickle.dumps(buf))
        buf.close()
    return int(_state["pickle bytes"])


def _traffic() -> None:
    """Queue 256 MiB of memset on a stream of its own, which the hand-off does not depend on."""
    from cuda.bindings import driver

    dev = _dev()
    if "traffic" not in _state:
        _state["traffic stream"] = dev.create_stream()
        _state["traffic"] = dev.allocate(256 << 20, stream=_state["traffic stream"])
    stream, buf = _state["traffic stream"], _state["traffic"]
    _check(
        "cuMemsetD8Async",
        driver.cuMemsetD8Async(int(buf.handle), 0, buf.size, int(stream.handle)),
    )


class TorchOwn:
    """A torch tensor that pickles as torch itself reduces it (gpu_serde registers its own
    reducers for CUDA tensors): torch's CUDA IPC through multiprocessing, torch's by-value
    pickling elsewhere. The receiver gets the tensor."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __reduce_ex__(self, protocol: Any) -> Any:
        import threading

        # multiprocessing pickles in a queue's feeder thread: torch.multiprocessing's reducer
        if threading.current_thread().name.startswith("QueueFeederThread"):
            from torch.multiprocessing import reductions

            return reductions.reduce_tensor(self.tensor)
        return self.tensor.__reduce_ex__(protocol)


def _pointer(obj: Any) -> tuple[int, Any]:
    """The device address of what arrived, and how to let go of it."""
    import gpu_serde

    obj = gpu_serde.resolve(obj)
    if hasattr(obj, "data_ptr"):  # torch
        return obj.data_ptr(), None
    if hasattr(obj, "data") and hasattr(obj.data, "ptr"):  # cupy
        return obj.data.ptr, None
    return int(obj.handle), obj.close  # a cuda.core Buffer: close it, as docs/memory.md advises


def consume(obj: Any) -> int:
    """Receive: read the marker of what arrived (for an int: the same read of scratch memory)."""
    from cuda.bindings import driver

    _dev()
    word = bytearray(4)  # not a 1-element array: cuda-bindings 13.4 takes that for a scalar
    if isinstance(obj, Plain):  # the int's read, and the value it carried
        _check("cuMemcpyDtoH", driver.cuMemcpyDtoH(word, int(_state["scratch"].handle), 4))
        return obj.value
    if isinstance(obj, int):
        ptr, close = int(_state["scratch"].handle), None
    else:
        ptr, close = _pointer(obj)
    _check("cuMemcpyDtoH", driver.cuMemcpyDtoH(word, ptr, 4))
    if close is not None:
        close()
    return obj if isinstance(obj, int) else int.from_bytes(word, "little")


# ---- Ray: long-lived actors (made remote by the caller) and tasks ----
class Sender:
    """A Ray actor that prepares one object ahead (untimed) and hands it out in ``make``."""

    def __init__(self, max_size: int) -> None:
        setup(max_size)
        self.ready: Any = None

    def prepare(self, path: str, size: int, value: int) -> None:
        self.ready = None
        self.ready = make_object(path, size, value)

    def make(self) -> Any:
        obj, self.ready = self.ready, None
        return obj

    def pid(self) -> int:
        return os.getpid()


class Receiver:
    """A Ray actor that receives."""

    def __init__(self, max_size: int) -> None:
        setup(max_size)

    def consume(self, obj: Any) -> int:
        return consume(obj)

    def pid(self) -> int:
        return os.getpid()


def make_task(path: str, size: int, value: int, max_size: int) -> Any:
    """A Ray or Dask task that makes the object (its process keeps its memory between tasks)."""
    setup(max_size)
    return make_object(path, size, value)


def consume_task(obj: Any, max_size: int) -> int:
    """A Ray or Dask task that receives it."""
    setup(max_size)
    return consume(obj)


# ---- multiprocessing: a warm spawned child ----
def serve(inbox: Any, outbox: Any, max_size: int, drop_first: bool = False) -> None:
    """The child: answers each object with its marker until it gets None. It lets go of what it
    received after replying, or before when ``drop_first`` (a Buffer is closed in ``consume``
    either way; a tensor is released when dropped)."""
    outbox.put(setup(max_size))
    while True:
        obj = inbox.get()
        if obj is None:
            return
        got = consume(obj)
        if drop_first:
            del obj
        outbox.put(got)
        obj = None
