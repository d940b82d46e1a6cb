"""What the tensor tests of the GPU tier share: the tensors they send, and the jobs that
receivers run (memtier's spawned child with its own CUDA_VISIBLE_DEVICES, Ray and Dask workers) (each reports what arrived: its
type, dtype, layout, GPU by UUID and, as a pickled CPU copy, its values).

Imported by name in spawned children, Ray workers (shipped by value) and Dask workers.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
from collections.abc import Iterator
from typing import Any

import memtier

KEPT: dict[str, Any] = {}  # what a receiver keeps between jobs


def cases(torch: Any, device: Any, make: Any = None) -> dict[str, Any]:
    """The tensors every path is tested with; ``make(shape, dtype)`` allocates the base tensors
    (default: ``torch.empty`` on ``device``; gpu_serde memory for the zero-copy cases)."""
    if make is None:

        def make(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=device)

    base = make((4, 6, 8), torch.float32)
    base.copy_(torch.arange(4 * 6 * 8, dtype=torch.float32, device=device).reshape(4, 6, 8))
    half = make((4, 6, 8), torch.bfloat16)
    half.copy_(base)
    grad = make((4, 6, 8), torch.float32)
    grad.copy_(base)
    param = make((6, 8), torch.float32)
    param.copy_(base[1])
    flags = make((4, 6, 8), torch.bool)
    flags.copy_(base > 50)
    return {
        "contiguous": base,
        "transposed": base.transpose(0, 2),
        "slice with steps": base[1:3, ::2, 3:],
        "storage offset": base.flatten()[17:40],
        "bf16": half[2:, 1],
        "requires_grad": grad.requires_grad_(True),
        "parameter": torch.nn.Parameter(param),
        "bool": flags,
        "empty": base[:, :0],
    }


def describe(x: Any) -> dict[str, Any]:
    """Job: what arrived, resolved, with a pickled CPU copy of its values."""
    import gpu_serde

    x = gpu_serde.resolve(x)
    if type(x).__module__.startswith("cupy"):
        host = x.get()
        return {
            "type": type(x).__name__,
            "dtype": x.dtype.str,
            "shape": list(x.shape),
            "strides": list(x.strides),
            "device": int(x.device.id),
            "uuid": gpu_serde.visible_devices()[int(x.device.id)].uuid,
            "values": pickle.dumps(host),
            "pid": os.getpid(),
        }
    return {
        "type": type(x).__name__,
        "dtype": str(x.dtype),
        "shape": list(x.shape),
        "stride": list(x.stride()),
        "offset": int(x.storage_offset()),
        "requires_grad": bool(x.requires_grad),
        "device": int(x.device.index),
        "uuid": gpu_serde.visible_devices()[int(x.device.index)].uuid,
        "values": pickle.dumps(x.detach().cpu()),
        "pid": os.getpid(),
    }


def expected(x: Any) -> dict[str, Any]:
    """What :func:`describe` should report for ``x`` in a receiver, but the pid (and the device
    index, which is the receiver's own)."""
    got = describe(x)
    got.pop("pid")
    got.pop("device")
    return got


def same(got: dict[str, Any], x: Any) -> bool:
    """The receiver's report matches ``x`` (or what :func:`expected` said of it before it
    changed): type, dtype, layout, GPU and every value."""
    want = dict(x) if isinstance(x, dict) else expected(x)
    mine = {k: v for k, v in got.items() if k not in ("pid", "device")}
    values = pickle.loads(mine.pop("values")), pickle.loads(want.pop("values"))
    if mine != want:
        return False
    a, b = values
    if hasattr(a, "equal"):  # torch
        return bool(a.equal(b))
    import numpy as np

    return bool(np.array_equal(a, b))


def describe_and_add(x: Any) -> dict[str, Any]:
    """Job: describe, then add 1000 to every element in place (on the GPU, waited for): the
    sender sees it only if it shares the memory."""
    import gpu_serde

    x = gpu_serde.resolve(x)
    got = describe(x)
    if type(x).__module__.startswith("cupy"):
        import cupy

        x += 1000
        cupy.cuda.Device(int(x.device.id)).synchronize()
    else:
        import torch

        with torch.no_grad():
            x.add_(1000)
        torch.cuda.synchronize(x.device)
    return got


def error_of(x: Any) -> dict[str, Any]:
    """Job: the typed error that using what arrived raises (or None)."""
    import gpu_serde

    try:
        gpu_serde.resolve(x)
        x.shape  # noqa: B018
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def loads_and_describe(blob: bytes) -> dict[str, Any]:
    """Job: unpickle (stdlib pickle: the by-value path) and describe."""
    return describe(pickle.loads(blob))


def loads_and_error(blob: bytes) -> dict[str, Any]:
    """Job: unpickle and report the error using it raises."""
    return error_of(pickle.loads(blob))


def keep(x: Any) -> dict[str, Any]:
    """Job: describe and keep what arrived until :func:`drop`."""
    import gpu_serde

    KEPT["x"] = gpu_serde.resolve(x)
    return describe(KEPT["x"])


def describe_kept(_: Any) -> dict[str, Any]:
    """Job: describe what :func:`keep` kept (after its sender let go of its own)."""
    return describe(KEPT["x"])


def drop(_: Any) -> bool:
    """Job: drop what :func:`keep` kept."""
    KEPT.pop("x", None)
    gc.collect()
    return True


#: GPU clock cycles of ``torch.cuda._sleep`` that keep a stream busy for a second or more
BUSY_CYCLES = 1 << 32


def busy_then_drop(where: str) -> bool:
    """Job: on torch's current stream (``"the current stream"``) or a side stream, queue a
    second or more of GPU work and then a read of what :func:`keep` kept; drop it at once."""
    import torch

    x = KEPT.pop("x")
    here = torch.cuda.current_stream(x.device)
    stream = here if where == "the current stream" else torch.cuda.Stream(x.device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(BUSY_CYCLES)
        KEPT["read"] = x.sum()  # reads x once the sleep is done
    KEPT["stream"] = stream
    del x
    gc.collect()
    return True


def still_busy(_: Any) -> bool:
    """Job: True while the stream :func:`busy_then_drop` used has work left."""
    return not KEPT["stream"].query()


@contextlib.contextmanager
def child(monkeypatch: Any, uuid: str, **env: str) -> Iterator[Any]:
    """memtier's spawned receiver that sees only the GPU ``uuid`` (its ordinal 0): yields its
    ``run(job, arg)``, which sends the job and waits for its answer."""
    with memtier.child(monkeypatch, uuid, **env) as receiver:
        yield receiver.run
