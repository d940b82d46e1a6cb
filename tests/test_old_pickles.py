"""Pickles made by earlier releases still load, and travel on as the very same bytes.

The files under ``tests/old_pickles/<version>/`` were written by that release's reducers
(``tests/old_pickles/generate.py``). Each names a GPU, host or exporter that this process does not
have, so it arrives as a placeholder, which must re-pickle byte for byte: a scheduler or CPU-only
hop running this release forwards what an older one sent without changing it. A buffer sent by
value (a host copy, a portable buffer from another host) arrives as a new buffer with its bytes.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

import gpu_serde

HERE = Path(__file__).with_name("old_pickles")
FILES = sorted(HERE.glob("*/*.pkl"))
KINDS = {
    "device": "UnresolvedDevice",
    "placeholder": "UnresolvedDevice",
    "options": "UnresolvedObject",  # its peer is a GPU no test process sees
    "options_default": "VirtualMemoryResourceOptions",
    "pool": "UnresolvedObject",
    "pinned_pool": "UnresolvedObject",
    "buffer": "UnresolvedObject",
    "vmm_resource": "UnresolvedObject",
    "vmm_buffer": "UnresolvedObject",
    "tensor_value": "UnresolvedObject",  # its GPU is not visible: DeviceNotVisibleError
    "tensor_shared": "UnresolvedObject",
    "tensor_ipc": "UnresolvedObject",  # from another host: OtherHostError
    "arena": "UnresolvedObject",  # from another host: OtherHostError
    "arena_buffer": "UnresolvedObject",
    # by value: a new buffer here, on this process's GPU when the sender's is not visible
    "host_copy": "Buffer",
    "portable": "Buffer",  # from another host: by its copy
    "unsent": "UnresolvedObject",  # the sender's HandoffError
}
BY_VALUE = {"host_copy", "portable"}  # new objects here: they travel on as themselves


def _kind(path: Path) -> str:
    index = json.loads((path.parent / "index.json").read_text())
    return str(index["files"][path.name])


def _protocol(path: Path) -> int:
    return int(path.suffixes[-2][2:])  # name.p<protocol>.pkl


def test_there_are_old_pickles_of_every_kind():
    assert {_kind(p) for p in FILES} == set(KINDS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_old_pickle_loads_as_what_it_was(installed, path):
    assert type(pickle.loads(path.read_bytes())).__name__ == KINDS[_kind(path)]


FORWARDED = [p for p in FILES if _kind(p) not in BY_VALUE]


@pytest.mark.parametrize("path", FORWARDED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_an_old_pickle_repickles_byte_for_byte(installed, path):
    data = path.read_bytes()
    assert pickle.dumps(pickle.loads(data), protocol=_protocol(path)) == data


@pytest.mark.parametrize("path", [p for p in FORWARDED if _kind(p) != "options_default"], ids=str)
def test_an_old_placeholder_raises_a_typed_error_when_used(installed, path):
    with pytest.raises((gpu_serde.DeviceNotVisibleError, gpu_serde.HandoffError)):
        gpu_serde.resolve(pickle.loads(path.read_bytes()))


@pytest.mark.parametrize(
    "path", [p for p in FILES if _kind(p) in BY_VALUE], ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_an_old_buffer_sent_by_value_arrives_with_its_bytes(installed, path):
    import numpy as np
    from cuda.bindings import driver

    buf = pickle.loads(path.read_bytes())
    out = np.empty(buf.size, dtype=np.uint8)
    (err,) = driver.cuMemcpyDtoH(out, int(buf.handle), buf.size)
    assert err == driver.CUresult.CUDA_SUCCESS
    assert out.tobytes() == bytes(range(64))
