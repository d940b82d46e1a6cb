"""A GPU buffer handed to a worker on another host, beside the engine moving a host array of the
same size, from one run: Dask (a task result used by a worker on another host) and Ray (a
``gpu_serde.portable`` buffer as an actor-method argument, and gpu_serde's Ray Direct Transport
from an actor to an actor on another host).

    python benchmarks/cross_host.py [--engine dask|ray|both] [--sizes 1MiB,64MiB,1GiB]
                                    [--rounds N] [--json PATH]

"Another host" on one machine: the receiving worker (Dask) or node (Ray) runs with
``GPU_SERDE_HOST_ID`` set (docs/memory.md), so memory reaches it as it would reach another machine:
by value, through the engine's own transfer (loopback TCP between Dask workers; between two Ray
nodes' object stores). Each hand-off is the median over interleaved rounds of (the round trip with
the buffer) minus (the same round trip with an int), for gpu_serde and for the host array alike.

The baseline is what a user does by hand: copy the buffer to a host array (device to host), let the
engine move the array, copy it up on the other side (host to device). The engine's part is measured
as the host array's hand-off; the two copies are measured here, in the same run, with the same kind
of host memory (pageable). Target (issue 21): gpu_serde's hand-off <= 1.2x (the host array's
hand-off + the device-to-host copy + the host-to-device copy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import _results
import numpy as np
from _common import _versions as versions
from _common import machine, use_gpus

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback only

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
TIMEOUT_S = 600


def parse_size(text: str) -> int:
    for unit, factor in UNITS.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def label(size: int) -> str:
    for unit, factor in reversed(UNITS.items()):
        if size >= factor:
            return f"{size / factor:g} {unit}"
    return f"{size} B"


# ---- runs in the workers -------------------------------------------------------------------


def make_buffer(size: int) -> Any:
    """A buffer of ``size`` bytes, from an IPC-enabled pool of this process, with bytes in it."""
    import builtins

    from cuda.bindings import driver
    from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions

    d = Device(0)
    d.set_current()
    pools = builtins.__dict__.setdefault("_bench_pools", {})
    if size not in pools:
        pools[size] = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True))
    buf = pools[size].allocate(size, stream=d.default_stream)
    driver.cuMemsetD8(int(buf.handle), 7, size)
    return buf


def make_array(size: int) -> np.ndarray:
    """A host array of ``size`` bytes (what the baseline moves)."""
    return np.full(size, 7, dtype=np.uint8)


def consume(x: Any) -> int:
    """Read the first byte of what arrived (a Buffer on the GPU, an array or an int on the host);
    close a received Buffer."""
    import gpu_serde

    x = gpu_serde.resolve(x)
    if isinstance(x, (int, np.ndarray)):
        return int(np.asarray(x).flat[0]) if not isinstance(x, int) else x
    from cuda.bindings import driver
    from cuda.core import Device

    Device(x.device_id).set_current()
    out = np.zeros(1, dtype=np.uint8)
    driver.cuMemcpyDtoH(out, int(x.handle), 1)
    x.close()
    return int(out[0])


def copy_costs(size: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a device-to-host and of a host-to-device copy of ``size`` bytes with
    pageable host memory (what the baseline's user would do, and what gpu_serde does)."""
    from cuda.bindings import driver
    from cuda.core import Device

    d = Device(0)
    d.set_current()
    buf = d.memory_resource.allocate(size, stream=d.default_stream)
    host = np.empty(size, dtype=np.uint8)
    down, up = [], []
    for _ in range(repeats):
        host = np.empty(size, dtype=np.uint8)  # new pages, as a new copy would get
        t = time.perf_counter()
        driver.cuMemcpyDtoH(host, int(buf.handle), size)
        down.append(time.perf_counter() - t)
        t = time.perf_counter()
        driver.cuMemcpyHtoD(int(buf.handle), host, size)
        driver.cuCtxSynchronize()
        up.append(time.perf_counter() - t)
    buf.close()
    return statistics.median(down), statistics.median(up)


# ---- the engines ---------------------------------------------------------------------------


def median_minus(samples: dict[str, list[float]], case: str, base: str) -> float:
    return statistics.median(c - b for c, b in zip(samples[case], samples[base], strict=True))


def run_dask(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    from distributed import Client, SpecCluster

    import gpu_serde
    import gpu_serde.dask
    from gpu_serde.testing import spec_cluster_options

    uuid = gpu_serde.visible_devices()[0].uuid
    options = spec_cluster_options({"a": uuid, "b": uuid}, hosts={"b": "bench-other-host"})
    rows = []
    with SpecCluster(**options) as cluster, Client(cluster) as client:
        gpu_serde.dask.register(client)
        client.wait_for_workers(2, timeout=120)
        by = {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        a, b = [by["a"]], [by["b"]]

        def hand_off(maker: Any, arg: Any) -> float:
            made = client.submit(maker, arg, workers=a, pure=False)
            made.result(TIMEOUT_S)
            start = time.perf_counter()
            client.submit(consume, made, workers=b, pure=False).result(TIMEOUT_S)
            elapsed = time.perf_counter() - start
            del made
            return elapsed

        client.submit(consume, 0, workers=b, pure=False).result(TIMEOUT_S)  # warm
        for size in sizes:
            print(f"dask {label(size)} ...", flush=True)
            hand_off(make_buffer, size)  # the first: pools and connections
            samples: dict[str, list[float]] = {"buffer": [], "array": [], "int": []}
            for _ in range(rounds):
                samples["int"].append(hand_off(lambda x: x, 0))
                samples["buffer"].append(hand_off(make_buffer, size))
                samples["array"].append(hand_off(make_array, size))
            down, up = client.submit(copy_costs, size, 5, workers=a, pure=False).result(TIMEOUT_S)
            rows.append(row("dask", "task result, worker to worker", size, samples, down, up))
    return rows


def run_ray(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    import ray
    from ray.cluster_utils import Cluster

    import gpu_serde
    import gpu_serde.ray

    uuid = gpu_serde.visible_devices()[0].uuid
    store = 3 * max(sizes) + (256 << 20)
    node = {"num_cpus": 2, "num_gpus": 1, "object_store_memory": store}
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    cluster = Cluster(initialize_head=True, head_node_args={**node, "resources": {"a": 10}})
    cluster.add_node(
        **node,
        resources={"b": 10},
        env_vars={"CUDA_VISIBLE_DEVICES": uuid, "GPU_SERDE_HOST_ID": "bench-other-host"},
    )
    gpu_serde.ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        rdt = gpu_serde.ray.transport.supported()
        options = {"enable_tensor_transport": True} if rdt else {}

        @ray.remote(num_gpus=0.25, **options)
        class Actor:
            def consume(self, x: Any) -> int:
                return consume(x)

            def hold(self, size: int) -> int:
                self.buf, self.array = make_buffer(size), make_array(size)
                return 0

            def give_int(self) -> int:
                return 0

            def give_array(self) -> np.ndarray:
                return self.array

            if rdt:

                @ray.method(tensor_transport=gpu_serde.ray.TRANSPORT)
                def give_buffer(self) -> Any:
                    return self.buf

        receiver = Actor.options(resources={"b": 1}).remote()
        sender = Actor.options(resources={"a": 1}).remote()
        ray.get(receiver.consume.remote(0), timeout=TIMEOUT_S)

        def call(arg: Any) -> float:
            start = time.perf_counter()
            ray.get(receiver.consume.remote(arg), timeout=TIMEOUT_S)
            return time.perf_counter() - start

        def relay(method: Any) -> float:
            start = time.perf_counter()
            ray.get(receiver.consume.remote(method.remote()), timeout=TIMEOUT_S)
            return time.perf_counter() - start

        for size in sizes:
            print(f"ray {label(size)} ...", flush=True)
            buf, array = make_buffer(size), make_array(size)
            ray.get(sender.hold.remote(size), timeout=TIMEOUT_S)
            call(gpu_serde.portable(buf))  # the first: pools, imports
            samples: dict[str, list[float]] = {"buffer": [], "array": [], "int": []}
            for _ in range(rounds):
                samples["int"].append(call(0))
                samples["buffer"].append(call(gpu_serde.portable(buf)))
                samples["array"].append(call(array))
            down, up = copy_costs(size, 5)
            rows.append(row("ray", "portable buffer, driver to actor", size, samples, down, up))
            if rdt:
                relay(sender.give_buffer)
                samples = {"buffer": [], "array": [], "int": []}
                for _ in range(rounds):
                    samples["int"].append(relay(sender.give_int))
                    samples["buffer"].append(relay(sender.give_buffer))
                    samples["array"].append(relay(sender.give_array))
                rows.append(
                    row("ray", "Ray Direct Transport, actor to actor", size, samples, down, up)
                )
            del buf, array
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def row(
    engine: str, path: str, size: int, samples: dict[str, list[float]], down: float, up: float
) -> dict[str, Any]:
    ours = median_minus(samples, "buffer", "int")
    engine_bulk = median_minus(samples, "array", "int")
    baseline = engine_bulk + down + up
    return {
        "engine": engine,
        "path": path,
        "size": size,
        "rounds": len(samples["int"]),
        "gpu_serde_ms": ours * 1e3,
        "host_array_ms": engine_bulk * 1e3,
        "dtoh_ms": down * 1e3,
        "htod_ms": up * 1e3,
        "baseline_ms": baseline * 1e3,
        "int_round_trip_ms": statistics.median(samples["int"]) * 1e3,
        "ratio": ours / baseline if baseline > 0 else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["dask", "ray", "both"], default="both")
    parser.add_argument("--sizes", default="1MiB,64MiB,1GiB")
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", "11")))
    parser.add_argument("--json", help="also write the results here, as JSON")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    gpus = use_gpus()
    print(f"# cross-host hand-off: {gpus}; {machine()}", flush=True)
    rows = []
    if args.engine in ("dask", "both"):
        rows += run_dask(sizes, args.rounds)
    if args.engine in ("ray", "both"):
        rows += run_ray(sizes, args.rounds)
    print("| engine | path | size | gpu_serde | host array | + DtoH | + HtoD | baseline | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        verdict = "meets <= 1.2x" if r["ratio"] <= 1.2 else "MISSES <= 1.2x"
        print(
            f"| {r['engine']} | {r['path']} | {label(r['size'])} | {r['gpu_serde_ms']:.2f} ms | "
            f"{r['host_array_ms']:.2f} ms | {r['dtoh_ms']:.2f} ms | {r['htod_ms']:.2f} ms | "
            f"{r['baseline_ms']:.2f} ms | {r['ratio']:.2f}x ({verdict}) |"
        )
    if args.json:  # the results format (benchmarks/results/README.md)
        raw = {
            "gpus": gpus,
            "machine": machine(),
            "versions": versions(),
            "date": time.strftime("%Y-%m-%d"),
            "rows": rows,
        }
        command = "python benchmarks/cross_host.py " + " ".join(sys.argv[1:])
        doc = _results.document(raw, _results.cross_host_rows(raw), "cross_host", command)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
