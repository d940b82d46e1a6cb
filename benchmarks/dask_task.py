"""Dask task round trip with a Device argument vs the same task with an int, from one run.

    python benchmarks/dask_task.py [--json PATH]

Target (issue 4): <= 1.05x. Each call is ``client.submit(f, arg, pure=False).result()`` on a warm
local cluster of one worker process.
"""

from __future__ import annotations

import os

from _common import interleaved, machine, parser, task_rows, task_table, use_gpus, write_json


def touch(arg) -> int:
    return 0


def main() -> None:
    args = parser(__doc__).parse_args()
    gpus = use_gpus()
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    import distributed
    from cuda.core import Device
    from distributed import Client, LocalCluster

    import gpu_serde
    import gpu_serde.dask

    dev = Device(0)
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, host="127.0.0.1", dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        for _ in range(30):
            client.submit(touch, dev, pure=False).result()

        def with_int() -> None:
            client.submit(touch, 0, pure=False).result()

        def with_ordinal_device() -> None:  # cuda.core's own pickle, for reference
            client.submit(touch, dev, pure=False).result()

        with_ordinal_device.setup = gpu_serde.uninstall

        def with_device() -> None:
            client.submit(touch, dev, pure=False).result()

        with_device.setup = gpu_serde.install
        cases = {"int": with_int, "ordinal": with_ordinal_device, "Device": with_device}
        t = interleaved(cases, rounds=15, per_round=40)
    task_table(
        f"Dask distributed {distributed.__version__} task round trip ({gpus}; {machine()})", t
    )
    path = "client.submit(f, arg).result()"
    write_json(args.json, "dask_task", task_rows("dask", t, path))


if __name__ == "__main__":
    main()
