"""Payload bytes and pickle round-trip time of a Device: gpu_serde (by UUID) vs cuda.core (ordinal).

    python benchmarks/device_pickle.py [--json PATH]

Targets (issue 2): time <= 1.3x, bytes <= 2x of cuda.core's own pickle, from one run.

gpu_serde's payload carries the sender's host name and device name, for error messages: each
byte of either is a byte of the pickle. So the payload size is printed for this host's name (its
length said) and for a realistic cluster host name, ``REALISTIC_HOST`` (a string of that length,
not an address anything connects to).
"""

from __future__ import annotations

import os
import pickle

from _common import interleaved, machine, parser, result, use_gpus, verdict, write_json

#: A host name of the length a cluster's fully qualified names have (32 characters).
REALISTIC_HOST = "gpu-node-017.cluster.example.com"


class _Sent:
    """Pickles as a Device payload does: ``(gpu_serde.wire.dev, (payload,))``."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[object, tuple[bytes]]:
        from gpu_serde import wire

        return (wire.dev, (self.payload,))


def pickled_size_with_host(dev, host: str) -> int:
    """The size of ``dev``'s gpu_serde pickle had it been sent from a host named ``host``."""
    from gpu_serde.device import device_payload
    from gpu_serde.format.device import encode_device
    from gpu_serde.identity import uuid_bytes
    from gpu_serde.inventory import inventory

    info = inventory().devices[dev.device_id]
    payload = encode_device(
        uuid_bytes(info.uuid),
        info.uuid.startswith("MIG-"),
        dev.device_id,
        os.getpid(),
        host,
        info.name,
    )
    if host == inventory().host:  # the stand-in pickles exactly as a Device does
        assert payload == device_payload(dev)
        assert pickle.dumps(_Sent(payload)) == pickle.dumps(dev)
    return len(pickle.dumps(_Sent(payload)))


def main() -> None:
    args = parser(__doc__).parse_args()
    gpus = use_gpus()
    from cuda.core import Device

    import gpu_serde
    from gpu_serde.inventory import inventory

    dev = Device(0)
    gpu_serde.uninstall()
    base_bytes = pickle.dumps(dev)
    gpu_serde.install()
    ours_bytes = pickle.dumps(dev)
    assert pickle.loads(ours_bytes) is dev
    host = inventory().host
    realistic = pickled_size_with_host(dev, REALISTIC_HOST)
    assert pickled_size_with_host(dev, host) == len(ours_bytes)

    def baseline() -> None:
        pickle.loads(pickle.dumps(dev))

    def ours() -> None:
        pickle.loads(pickle.dumps(dev))

    baseline.setup = gpu_serde.uninstall
    ours.setup = gpu_serde.install
    t = interleaved({"cuda.core": baseline, "gpu_serde": ours}, rounds=41, per_round=20_000)
    gpu_serde.install()

    size_ratio = len(ours_bytes) / len(base_bytes)
    realistic_ratio = realistic / len(base_bytes)
    time_ratio = t["gpu_serde"] / t["cuda.core"]
    name = inventory().devices[0].name
    print(f"# Device pickle round trip ({gpus}; {machine()})")
    print("| | cuda.core 1.2 (ordinal) | gpu_serde (UUID) | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| payload bytes, this host ({host!r}: {len(host)} characters) | {len(base_bytes)} | "
        f"{len(ours_bytes)} | {size_ratio:.2f}x | <= 2x: {verdict(size_ratio, 2.0)} |"
    )
    print(
        f"| payload bytes, a host named {REALISTIC_HOST!r} ({len(REALISTIC_HOST)} characters) "
        f"| {len(base_bytes)} | {realistic} | {realistic_ratio:.2f}x | <= 2x: "
        f"{verdict(realistic_ratio, 2.0)} |"
    )
    base_us, ours_us = t["cuda.core"] * 1e6, t["gpu_serde"] * 1e6
    print(
        f"| round trip (dumps+loads) | {base_us:.2f} us | {ours_us:.2f} us "
        f"| {time_ratio:.2f}x | <= 1.3x: {verdict(time_ratio, 1.3)} |"
    )
    print(
        f"\ngpu_serde's pickle is {len(ours_bytes) - len(host)} bytes plus one per byte of the "
        f"sending host's name (and it carries the device name, {name!r}: {len(name.encode())} "
        "bytes here)."
    )
    pickle_ = {"engine": "pickle", "path": "pickle.dumps"}
    write_json(
        args.json,
        "device_pickle",
        [
            result(
                "payload_bytes", series="cuda.core", value=len(base_bytes), unit="bytes", **pickle_
            ),
            result(
                "payload_bytes",
                series="gpu_serde",
                value=len(ours_bytes),
                unit="bytes",
                host_name_length=len(host),
                device_name=name,
                **pickle_,
            ),
            result(
                "payload_bytes",
                series="gpu_serde",
                value=realistic,
                unit="bytes",
                host_name_length=len(REALISTIC_HOST),
                device_name=name,
                **pickle_,
            ),
            result("pickle_round_trip", series="cuda.core", value=t["cuda.core"], **pickle_),
            result("pickle_round_trip", series="gpu_serde", value=t["gpu_serde"], **pickle_),
        ],
        host_name_length=len(host),
    )


if __name__ == "__main__":
    main()
