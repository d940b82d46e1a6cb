"""Write the pickles that a gpu_serde release makes, for the backward-compatibility test.

Run it with the release's code on simulated GPUs (``python tests/old_pickles/generate.py OUT``);
commit what it writes under ``tests/old_pickles/<version>/``. Each file is what that release's
reducers put on the wire for one object. Every payload names a GPU, a host or an exporter that no
test process has, so loading it gives a placeholder that must re-pickle to the very same bytes (a
buffer by value gives a new buffer with its bytes).
Never regenerate an old release's folder: those files are the compatibility surface.
"""

from __future__ import annotations

import copyreg
import json
import pickle
import sys
from pathlib import Path

from gpu_serde.testing import activate, make_gpus

# A simulated GPU that the tests never make visible, so its Device arrives as a placeholder.
activate(make_gpus(1, seed="old-pickles"))

import gpu_serde  # noqa: E402
from gpu_serde import wire  # noqa: E402

PROTOCOLS = (2, 4, 5)
BOOT = bytes.fromhex("0123456789abcdef0123456789abcdef")  # no machine's kernel boot_id
ADDRESS = "@gpu_serde-4242-00112233aabbccdd"
TOKEN = bytes(range(16))
POOL_ID = bytes(range(16, 32))


class Reduced:
    """An object that reduces exactly as the release's reducer reduced a cuda.core object."""

    def __init__(self, reduced: tuple) -> None:
        self.reduced = reduced

    def __reduce__(self) -> tuple:
        return self.reduced


class ReducedByProtocol:
    """An object that reduces as the release's reducer did under each pickle protocol (a host
    copy's bytes travel out-of-band under protocol 5, as a writable buffer: in-band here)."""

    def __init__(self, make: object) -> None:
        self.make = make

    def __reduce_ex__(self, protocol: object) -> tuple:  # type: ignore[override]
        return self.make(protocol)  # type: ignore[operator, no-any-return]


def objects() -> dict[str, object]:
    from cuda.core import Device, VirtualMemoryResourceOptions

    gpu_serde.install()
    device = Device(0)
    dev_payload = copyreg.dispatch_table[Device](device)[1][0]
    assert isinstance(dev_payload, bytes)
    pool = (1, dev_payload, BOOT, ADDRESS, TOKEN, POOL_ID)
    pinned = (1, None, BOOT, ADDRESS, TOKEN, POOL_ID)
    buffer = (1, pool, bytes(range(64)), 1 << 20, bytes(range(32, 48)))
    options = VirtualMemoryResourceOptions(peers=(0,), self_access="rw", peer_access="r")
    options_payload = copyreg.dispatch_table[type(options)](options)[1][0]
    vmm = (1, dev_payload, options_payload)
    vbuf = (1, vmm, BOOT, ADDRESS, TOKEN, 2 << 20, bytes(range(48, 64)))
    # the tensor kinds (torch tensors and CuPy arrays: gpu_serde.tensors), added before 0.1.0
    meta = ("torch", "Parameter", "bfloat16", 2, (3, 4), (1, 3), 2, True)
    cupy_meta = ("cupy", "ndarray", "<f4", 4, (4, 3), (-3, 1), 9, False)
    tval = (1, dev_payload, meta, 2, 28, bytes(range(28)))
    region = (1, dev_payload, BOOT, ADDRESS, TOKEN, POOL_ID, 4 << 20, bytes(range(64)))
    tshr = (1, cupy_meta, (1, region, 1 << 20, 4096, bytes(range(32, 48))))
    tipc = (1, dev_payload, BOOT, meta, bytes(range(64)), 28, 512, b"/torch_42_7_0", 3, None, True)
    # the arena, by-value and portable kinds, and what could not be sent (added before 0.1.0)
    abuf = (1, region, 1 << 20, 4096, bytes(range(32, 48)))

    def data(protocol: int) -> object:
        raw = bytes(range(64))
        return pickle.PickleBuffer(bytearray(raw)) if protocol >= 5 else raw

    def hbuf(protocol: int) -> tuple:
        return (wire.hbuf, ((1, dev_payload, 64, data(protocol)),))

    def pbuf(protocol: int) -> tuple:
        return (wire.pbuf, ((1, "abuf", abuf, (1, dev_payload, 64, data(protocol))),))

    unsent = (1, "a Buffer", "HandoffError", "this Buffer was closed by its exporter")
    return {
        "device": device,
        "options": options,
        "options_default": VirtualMemoryResourceOptions(),
        "pool": Reduced((wire.pool, (pool,))),
        "pinned_pool": Reduced((wire.pool, (pinned,))),
        "buffer": Reduced((wire.buf, (buffer,))),
        "vmm_resource": Reduced((wire.vmm, (vmm,))),
        "vmm_buffer": Reduced((wire.vbuf, (vbuf,))),
        "placeholder": pickle.loads(pickle.dumps(device)),  # re-pickled as it came
        "tensor_value": Reduced((wire.tval, (tval,))),
        "tensor_shared": Reduced((wire.tshr, (tshr,))),
        "tensor_ipc": Reduced((wire.tipc, (tipc,))),
        "arena": Reduced((wire.arena, (region,))),
        "arena_buffer": Reduced((wire.abuf, (abuf,))),
        "host_copy": ReducedByProtocol(hbuf),
        "portable": ReducedByProtocol(pbuf),
        "unsent": Reduced((wire.unsent, (unsent,))),
    }


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, obj in objects().items():
        for protocol in PROTOCOLS:
            data = pickle.dumps(obj, protocol=protocol)
            (out / f"{name}.p{protocol}.pkl").write_bytes(data)
            index[f"{name}.p{protocol}.pkl"] = name
    meta = {"gpu_serde": gpu_serde.__version__, "python": sys.version.split()[0], "files": index}
    (out / "index.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
