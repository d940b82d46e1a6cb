"""The first task of a new Ray worker: without a runtime_env, and with gpu_serde's
``worker_process_setup_hook``, from one run.

    python benchmarks/ray_first_task.py [--rounds N] [--json PATH]

Two measurements, each a table with ratios against its baseline (medians, cases interleaved):

1. **A new job's first task** (what a user's script meets): a driver process starts a local Ray
   (``ray.init(num_cpus=1)``), then times ``ray.get(f.remote())``; baseline ``ray.init()``, against
   ``gpu_serde.ray.init()`` (the same, with gpu_serde's hook in the job's runtime_env). One new
   driver and cluster per sample.
2. **Every new worker's first task**, on one cluster: a task declared with ``max_calls=1`` (its
   worker exits after it, so every call starts a new worker process, as Ray's GPU tasks do by
   default), with these runtime_envs:

- ``no runtime_env``: the baseline;
- ``runtime_env with env_vars only``: what any runtime_env costs (Ray's runtime-env agent
  prepares it; a worker pool of its own);
- ``setup hook that does nothing``: ``worker_process_setup_hook="gc.collect"``: the hook
  mechanism alone;
- ``gpu_serde's setup hook``: ``gpu_serde.ray.runtime_env()`` (what ``gpu_serde.ray.init`` gives
  every worker of a job): the hook imports gpu_serde (and so cuda.core) and installs it.

No target: what it measures is documented in docs/performance.md ("The first task of a Ray
worker").
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from _common import machine, parser, result, times, use_gpus, write_json

FRESH = """
import os, sys, time
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
import ray
import gpu_serde.ray
init = gpu_serde.ray.init if sys.argv[1] == "gpu_serde" else ray.init
init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
@ray.remote
def first():
    return os.getpid()
start = time.perf_counter()
ray.get(first.remote())
print("FIRST", time.perf_counter() - start)
ray.shutdown()
"""


def fresh_job(kind: str) -> float:
    """Seconds from submitting a new job's first task to its result (``kind``: "ray" or
    "gpu_serde", which ``init`` the driver calls)."""
    done = subprocess.run(
        [sys.executable, "-c", FRESH, kind], capture_output=True, text=True, timeout=300
    )
    for line in done.stdout.splitlines():
        if line.startswith("FIRST "):
            return float(line.split()[1])
    raise RuntimeError(f"the driver failed ({done.returncode}):\n{done.stderr[-2000:]}")


def table(title: str, t: dict[str, float]) -> None:
    base = next(iter(t.values()))
    print(f"# {title}")
    print("| case | median | ratio |")
    print("|---|---|---|")
    for name, seconds in t.items():
        print(f"| {name} | {seconds * 1e3:.0f} ms | {times(seconds / base)} |")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=15, help="samples per case (default 15)")
    args = p.parse_args()
    gpus = use_gpus()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # leaves ~/.ray alone
    import ray

    import gpu_serde.ray

    jobs: dict[str, list[float]] = {"ray.init()": [], "gpu_serde.ray.init()": []}
    for r in range(args.rounds):
        kinds = [("ray.init()", "ray"), ("gpu_serde.ray.init()", "gpu_serde")]
        for name, kind in kinds[::-1] if r % 2 else kinds:
            jobs[name].append(fresh_job(kind))
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(max_calls=1, num_cpus=1)
        def first() -> int:
            return os.getpid()

        envs = {
            "no runtime_env": None,
            "runtime_env with env_vars only": {"env_vars": {"GPU_SERDE_BENCH": "1"}},
            "setup hook that does nothing": {"worker_process_setup_hook": "gc.collect"},
            "gpu_serde's setup hook": gpu_serde.ray.runtime_env(),
        }

        def case(env: dict | None) -> Callable[[], None]:
            task = first if env is None else first.options(runtime_env=env)
            return lambda: ray.get(task.remote())

        cases = {name: case(env) for name, env in envs.items()}
        for fn in cases.values():  # each runtime_env prepared once, before timing
            fn()
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            order = list(cases.items())
            for name, fn in order[::-1] if r % 2 else order:
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    finally:
        ray.shutdown()
    where = f"Ray {ray.__version__}; {gpus}; {machine()}; {args.rounds} rounds"
    j = {name: statistics.median(v) for name, v in jobs.items()}
    table(f"A new job's first task ({where})", j)
    print()
    t = {name: statistics.median(v) for name, v in samples.items()}
    table(f"Every new worker's first task, max_calls=1 ({where})", t)
    rows = [
        result("first_task", "ray", name, seconds, path="new job", stat="median")
        for name, seconds in j.items()
    ]
    rows += [
        result("first_task", "ray", name, seconds, path="max_calls=1 task", stat="median")
        for name, seconds in t.items()
    ]
    write_json(args.json, "ray_first_task", rows)


if __name__ == "__main__":
    main()
