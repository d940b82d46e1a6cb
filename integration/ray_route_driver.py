"""A Ray driver as users write one, run by the route tests as a script or as a submitted job.

``python ray_route_driver.py init|plain``: ``init`` starts with ``gpu_serde.ray.init()``, ``plain``
with ``ray.init()`` (whatever the route installs). It sends each of the host's GPUs (or those whose
ordinals ``GPU_SERDE_TEST_ORDINALS`` lists), as the driver's own ``Device``, to a task on every
node (given all of that node's GPUs), and prints one ``RESULT {json}`` line: whether Devices
pickle by UUID here, and what each node made of each one.
"""

import json
import os
import pickle
import sys

import ray
from cuda.core import Device

import gpu_serde
import gpu_serde.ray  # importing installs nothing: only init() or the hooks do


@ray.remote(max_retries=0)
def where_is(device: object) -> list:
    """On a worker: the received Device's ordinal and UUID, checked against this task's view."""
    d = gpu_serde.resolve(device)
    seen = gpu_serde.visible_devices()[d.device_id].uuid
    assert seen == "GPU-" + d.uuid, (seen, d.uuid)
    return [d.device_id, seen]


@ray.remote(max_retries=0)
def view() -> list:
    """On a worker: the GPUs this task sees."""
    return [d.uuid for d in gpu_serde.visible_devices()]


def main(mode: str) -> None:
    address = os.environ.get("GPU_SERDE_TEST_RAY_ADDRESS", "auto")
    ip = os.environ.get("GPU_SERDE_TEST_NODE_IP")
    extra = {"_node_ip_address": ip} if ip else {}
    if mode == "init":
        gpu_serde.ray.init(address=address, **extra)
    else:
        ray.init(address=address, **extra)
    host = [d.uuid for d in gpu_serde.visible_devices()]
    by_uuid = b"gpu_serde" in pickle.dumps(Device(0))  # what this driver sends
    only = os.environ.get("GPU_SERDE_TEST_ORDINALS")  # the Devices to send (default: all)
    ordinals = [int(k) for k in only.split(",")] if only else list(range(len(host)))
    results: dict = {}
    for node in ray.nodes():
        names = [r[5:] for r in node["Resources"] if r.startswith("node_")]
        if not node["Alive"] or not names:
            continue
        gpus = int(node["Resources"].get("GPU", 0))
        on = {"num_gpus": gpus, "resources": {f"node_{names[0]}": 1}}
        seen = view.options(**on).remote()
        sent = [where_is.options(**on).remote(Device(k)) for k in ordinals]
        got = {}
        for uuid, ref in zip([host[k] for k in ordinals], sent, strict=True):
            try:
                got[uuid] = ray.get(ref, timeout=120)
            except gpu_serde.DeviceNotVisibleError as exc:
                got[uuid] = ["DeviceNotVisibleError", exc.uuid]
            except Exception as exc:  # what a driver without gpu_serde gets: any error at all
                got[uuid] = [type(exc).__name__, str(exc)[:300]]
        results[names[0]] = {"gpus": gpus, "seen": ray.get(seen, timeout=120), "got": got}
    print("RESULT " + json.dumps({"by_uuid": by_uuid, "host": host, "nodes": results}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
