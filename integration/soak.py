"""Soak: 10,000 tasks with Device arguments on each engine; worker memory and descriptors stay flat.

    python integration/soak.py [--tasks 10000] [--engine ray|dask|both]

Runs on the real GPUs where a driver is present, else on four simulated GPUs. Prints, per engine,
each worker process's resident memory and open descriptors after a warm-up and after every
quarter of the run, and the change from warm-up to the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from _common import machine, use_gpus


def sample(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and open descriptors of a process on this host."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def touch(device) -> int:
    import gpu_serde

    gpu_serde.resolve(device)
    return os.getpid()


def report(engine: str, rows: list[tuple[int, dict[int, tuple[float, int]]]]) -> None:
    print(f"\n## {engine}: worker RSS (MiB) / open fds by tasks done")
    pids = sorted(rows[0][1])
    print("| tasks done | " + " | ".join(f"pid {p}" for p in pids) + " |")
    print("|---" * (len(pids) + 1) + "|")
    for done, snap in rows:
        cells = [f"{snap[p][0]:.1f} / {snap[p][1]}" if p in snap else "gone" for p in pids]
        print(f"| {done} | " + " | ".join(cells) + " |")
    first, last = rows[0][1], rows[-1][1]
    for p in pids:
        if p in last:
            rss, fds = last[p][0] - first[p][0], last[p][1] - first[p][1]
            print(f"- pid {p}: RSS {rss:+.1f} MiB, fds {fds:+d}")


def run_dask(tasks: int, dev) -> None:
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    from distributed import Client, LocalCluster

    import gpu_serde.dask

    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        pids = set(client.run(os.getpid).values())
        client.gather(client.map(touch, [dev] * 500, pure=False))  # warm-up
        rows = [(0, {p: sample(p) for p in pids})]
        done, batch = 0, 500
        while done < tasks:
            client.gather(client.map(touch, [dev] * batch, pure=False))
            done += batch
            if done % (tasks // 4) == 0:
                rows.append((done, {p: sample(p) for p in pids}))
    report("Dask", rows)


def run_ray(tasks: int, dev) -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray

    import gpu_serde.ray

    gpu_serde.ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(touch)
        pids = set(ray.get([task.remote(dev) for _ in range(500)]))  # warm-up
        rows = [(0, {p: sample(p) for p in pids})]
        done, batch = 0, 500
        while done < tasks:
            pids |= set(ray.get([task.remote(dev) for _ in range(batch)]))
            done += batch
            if done % (tasks // 4) == 0:
                rows.append((done, {p: sample(p) for p in pids if os.path.exists(f"/proc/{p}")}))
    finally:
        ray.shutdown()
    report("Ray", rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--engine", choices=["ray", "dask", "both"], default="both")
    args = parser.parse_args()
    gpus = use_gpus()
    from cuda.core import Device

    import gpu_serde

    gpu_serde.install()
    dev = Device(0)
    print(f"# Soak: {args.tasks} tasks with a Device argument per engine ({gpus}; {machine()})")
    started = time.monotonic()
    if args.engine in ("dask", "both"):
        run_dask(args.tasks, dev)
    if args.engine in ("ray", "both"):
        run_ray(args.tasks, dev)
    print(f"\n{time.monotonic() - started:.0f} s in all")


if __name__ == "__main__":
    main()
