"""A Dask client as users write one, run by the route tests in a process of its own.

``python dask_route_client.py ADDRESS N``: connects (installing nothing itself: Dask's config
preloads gpu_serde, or not), waits for N workers, sends each of the host's GPUs as this client's
own ``Device`` to every worker, and prints one ``RESULT {json}`` line: whether Devices pickle by
UUID here, and what each worker (by name) made of each one.
"""

import json
import pickle
import sys

from cuda.core import Device
from distributed import Client

import gpu_serde


def where_is(device: object) -> list:
    """On a worker: the received Device's ordinal and UUID, checked against the worker's view."""
    d = gpu_serde.resolve(device)
    seen = gpu_serde.visible_devices()[d.device_id].uuid
    assert seen == "GPU-" + d.uuid, (seen, d.uuid)
    return [d.device_id, seen]


def view() -> list:
    return [d.uuid for d in gpu_serde.visible_devices()]


def main(address: str, n: int) -> None:
    with Client(address, timeout=60) as client:
        client.wait_for_workers(n, timeout=120)
        by_uuid = b"gpu_serde" in pickle.dumps(Device(0))  # what this client sends
        host = [d.uuid for d in gpu_serde.visible_devices()]
        info = client.scheduler_info(n_workers=-1)["workers"]
        results = {}
        for addr, w in info.items():
            got = {}
            for ordinal, uuid in enumerate(host):
                fut = client.submit(where_is, Device(ordinal), workers=[addr], pure=False)
                try:
                    got[uuid] = fut.result(timeout=60)
                except gpu_serde.DeviceNotVisibleError as exc:
                    got[uuid] = ["DeviceNotVisibleError", exc.uuid]
                except Exception as exc:  # what a client without gpu_serde gets: any error
                    got[uuid] = [type(exc).__name__, str(exc)[:300]]
            seen = client.submit(view, workers=[addr], pure=False).result(timeout=60)
            results[w["name"]] = {"seen": seen, "got": got}
    print(
        "RESULT " + json.dumps({"by_uuid": by_uuid, "host": host, "workers": results}), flush=True
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
