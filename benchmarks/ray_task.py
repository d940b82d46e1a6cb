"""Ray task round trip with a Device argument vs the same task with an int, from one run.

    python benchmarks/ray_task.py [--json PATH]

Target (issue 3): <= 1.05x. Each call is ``ray.get(f.remote(arg))`` on a warm local cluster.
"""

from __future__ import annotations

import os

from _common import interleaved, machine, parser, task_rows, task_table, use_gpus, write_json


def main() -> None:
    args = parser(__doc__).parse_args()
    gpus = use_gpus()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray
    from cuda.core import Device

    import gpu_serde
    import gpu_serde.ray

    gpu_serde.ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        def touch(arg):
            return 0

        dev = Device(0)
        ray.get([touch.remote(dev) for _ in range(50)])  # warm the worker pool and the hook

        def with_int() -> None:
            ray.get(touch.remote(0))

        def with_ordinal_device() -> None:  # cuda.core's own pickle, for reference
            ray.get(touch.remote(dev))

        with_ordinal_device.setup = gpu_serde.uninstall

        def with_device() -> None:
            ray.get(touch.remote(dev))

        with_device.setup = gpu_serde.install
        cases = {"int": with_int, "ordinal": with_ordinal_device, "Device": with_device}
        t = interleaved(cases, rounds=21, per_round=100)
    finally:
        ray.shutdown()
    task_table(f"Ray {ray.__version__} task round trip ({gpus}; {machine()})", t)
    write_json(args.json, "ray_task", task_rows("ray", t, "ray.get(f.remote(arg))"))


if __name__ == "__main__":
    main()
