"""Payload bytes and pickle round-trip time of a Device: gpu_serde (by UUID) vs cuda.core (ordinal).

    python benchmarks/device_pickle.py

Targets (issue 2): time <= 1.3x, bytes <= 2x of cuda.core's own pickle, from one run.
"""

from __future__ import annotations

import pickle

from _common import interleaved, machine, use_gpus, verdict


def main() -> None:
    gpus = use_gpus()
    from cuda.core import Device

    import gpu_serde

    dev = Device(0)
    gpu_serde.uninstall()
    base_bytes = pickle.dumps(dev)
    gpu_serde.install()
    ours_bytes = pickle.dumps(dev)
    assert pickle.loads(ours_bytes) is dev

    def baseline() -> None:
        pickle.loads(pickle.dumps(dev))

    def ours() -> None:
        pickle.loads(pickle.dumps(dev))

    baseline.setup = gpu_serde.uninstall
    ours.setup = gpu_serde.install
    t = interleaved({"cuda.core": baseline, "gpu_serde": ours}, rounds=41, per_round=20_000)
    gpu_serde.install()

    size_ratio = len(ours_bytes) / len(base_bytes)
    time_ratio = t["gpu_serde"] / t["cuda.core"]
    print(f"# Device pickle round trip ({gpus}; {machine()})")
    print("| | cuda.core 1.2 (ordinal) | gpu_serde (UUID) | ratio | target |")
    print("|---|---|---|---|---|")
    print(
        f"| payload bytes | {len(base_bytes)} | {len(ours_bytes)} | {size_ratio:.2f}x | "
        f"<= 2x: {verdict(size_ratio, 2.0)} |"
    )
    base_us, ours_us = t["cuda.core"] * 1e6, t["gpu_serde"] * 1e6
    print(
        f"| round trip (dumps+loads) | {base_us:.2f} us | {ours_us:.2f} us "
        f"| {time_ratio:.2f}x | <= 1.3x: {verdict(time_ratio, 1.3)} |"
    )


if __name__ == "__main__":
    main()
