"""Ray: run a task or actor on the node that has its GPU, seeing that GPU (``gpu_serde.ray.on``).

Ray hands out GPUs by count, never by name: ``num_gpus=1`` gives a task *a* GPU of the node,
chosen by the raylet, and no option of ``.options()`` names one. What Ray does let us say (2.50 to
2.60):

- **the node**: ``NodeAffinitySchedulingStrategy(node_id, soft=False)``: the task runs there or
  fails (``TaskUnschedulableError``/``ActorUnschedulableError`` when the node is gone); it never
  runs elsewhere.
- **which GPUs the process sees**: a ``num_gpus=0`` task's ``CUDA_VISIBLE_DEVICES`` is whatever
  its worker process was started with. Ray 2.58 and 2.60 never override it then; Ray 2.50 to
  2.55 set it to ``""`` unless ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0`` is in the worker's
  environment (read by the worker at each task, ``ray._private.utils.set_visible_accelerator_ids``).
  A per-task ``runtime_env={"env_vars": ...}`` sets both in a worker process of its own: Ray
  keys its worker pool by runtime_env, so that process only ever runs work routed to the same
  GPU, and its CUDA can never have been started under another assignment.

So ``on(dev)`` returns ``num_gpus=0``, hard node affinity to the node whose GPUs include the UUID,
and ``runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": uuid, ...}}``: the task runs on that node
and sees exactly that GPU, as its ``Device(0)``. What it does **not** give: Ray does not count
the GPU as used (a ``num_gpus=1`` task may be given the same GPU at the same time);
``ray.get_gpu_ids()`` is empty in it. ``exclusive=True`` adds
``resources={"gpu_serde:GPU-…": 1}`` (:func:`gpu_serde.routing.resource_name`), which needs the
node to declare that resource (``ray start --resources='{"gpu_serde:GPU-…": 1}'``): then one
routed task at a time holds the GPU (routed tasks only: Ray's own ``num_gpus`` accounting still
ignores it).

Which node has which GPU: on first use of a node, one survey task runs there
(hard affinity, ``num_gpus=0``, unmasked, in a worker of its own) and reports the GPUs the node's
worker processes see; the answer is cached by node id (a node's GPUs are fixed when its raylet
starts). Where several nodes see a GPU (several raylets on one host), the nodes that give Ray GPUs
come first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gpu_serde.errors import DeviceNotVisibleError, PlacementError
from gpu_serde.inventory import inventory
from gpu_serde.routing import resource_name, target_uuid

UNMASK = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}  # Ray < 2.60: don't blank num_gpus=0 tasks
SURVEY_TIMEOUT_S = 120


@dataclass(frozen=True)
class NodeView:
    """What one Ray node's worker processes see.

    Attributes:
        node_id: Ray's hex node id.
        address: the node's IP address as Ray knows it.
        uuids: canonical UUIDs of the GPUs its workers see, in their ordinal order.
        ray_gpus: how many GPUs Ray schedules on it (its ``GPU`` resource).
        reason: why ``uuids`` is empty, or why the node could not be asked.
        declared: the names of the custom resources it declares with an amount of at least 1.
    """

    node_id: str
    address: str
    uuids: tuple[str, ...]
    ray_gpus: float
    reason: str = ""
    declared: frozenset[str] = frozenset()


_lock = threading.Lock()
_views: dict[str, NodeView] = {}


def survey() -> tuple[str, list[str], str]:
    """Runs on a node (as a ``num_gpus=0`` task): its node id, the canonical UUIDs its workers see,
    and why none when empty."""
    inv = inventory()
    return ray.get_runtime_context().get_node_id(), [d.uuid for d in inv.devices], inv.reason


def _survey(nodes: list[dict[str, Any]]) -> dict[str, NodeView]:
    """Ask each of ``nodes`` what its workers see; cache the answers (not the failures, which a
    later call asks again)."""
    task = ray.remote(num_cpus=0, num_gpus=0, max_retries=0)(survey)
    env = {"env_vars": {**UNMASK, "GPU_SERDE_WORKER": "survey"}}  # a fresh worker, all GPUs
    refs = {}
    for node in nodes:
        where = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
        refs[node["NodeID"]] = task.options(scheduling_strategy=where, runtime_env=env).remote()
    views = {}
    for node in nodes:
        node_id = node["NodeID"]
        resources = node.get("Resources", {})
        gpus = float(resources.get("GPU", 0))
        declared = frozenset(k for k, v in resources.items() if v >= 1)
        address = str(node.get("NodeManagerAddress", "?"))
        try:
            _, uuids, reason = ray.get(refs[node_id], timeout=SURVEY_TIMEOUT_S)
        except Exception as exc:  # a node that cannot answer is not a candidate, and is named
            views[node_id] = NodeView(node_id, address, (), gpus, f"could not ask it: {exc!r:.300}")
            continue
        views[node_id] = view = NodeView(node_id, address, tuple(uuids), gpus, reason, declared)
        with _lock:
            _views[node_id] = view
    return views


def node_views() -> list[NodeView]:
    """What every alive node of the connected Ray cluster sees (surveying new nodes once).

    Raises:
        RuntimeError: Ray is not initialised in this process.
    """
    if not ray.is_initialized():
        raise RuntimeError(
            "gpu_serde.ray.on() needs a connected Ray: call gpu_serde.ray.init() first"
        )
    nodes: list[dict[str, Any]] = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    with _lock:
        known = {n["NodeID"]: _views[n["NodeID"]] for n in alive if n["NodeID"] in _views}
    new = [n for n in alive if n["NodeID"] not in known]
    if new:
        known.update(_survey(new))
    return [known[n["NodeID"]] for n in alive]


def _not_seen(uuid: str, views: list[NodeView]) -> DeviceNotVisibleError:
    lines = [
        f"  node {v.node_id[:12]} ({v.address}, Ray GPUs {v.ray_gpus:g}): "
        + (", ".join(v.uuids) if v.uuids else f"no GPU ({v.reason})")
        for v in views
    ]
    return DeviceNotVisibleError(
        f"no alive node of this Ray cluster sees GPU {uuid}; the nodes' workers see:\n"
        + ("\n".join(lines) or "  (no alive nodes)")
        + "\nStart a node on the host that has that GPU, with it in the raylet's "
        "CUDA_VISIBLE_DEVICES (or that variable unset).",
        uuid=uuid,
    )


def on(
    device: Any, *, runtime_env: dict[str, Any] | None = None, exclusive: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``.options()`` that run a task or actor on the node that has
    ``device``'s GPU, with that GPU (and only it) visible, as its ``Device(0)``.

    ``f.options(**gpu_serde.ray.on(dev)).remote(dev)``. The result sets ``num_gpus=0`` (it
    overrides a ``num_gpus`` given to ``@ray.remote``; passing ``num_gpus`` too is a
    ``TypeError``: Ray would then pick the GPU), hard node affinity, and a runtime_env whose
    ``env_vars`` choose the GPU (see the module docstring for what Ray guarantees and what not).

    Args:
        device: what the work is for: a GPU's UUID (``"GPU-..."``), a Device, a placeholder, a
            device memory resource, a buffer, a CUDA torch tensor or CuPy array (or what
            ``gpu_serde.share`` made of one, or the placeholder of one sent from a GPU not seen
            here), or a list of them on one GPU (:func:`gpu_serde.routing.target_uuid`).
        runtime_env: the task's own runtime_env, to merge the GPU's ``env_vars`` into.
        exclusive: also hold ``resources={"gpu_serde:<uuid>": 1}``, so that one routed task at
            a time uses the GPU; the node must declare that resource (``ray start --resources``).

    Returns:
        a dict of ``num_gpus`` (0), ``scheduling_strategy`` (a hard
        ``NodeAffinitySchedulingStrategy``) and ``runtime_env``, plus ``resources`` when
        ``exclusive``.

    Raises:
        DeviceNotVisibleError: no alive node sees that GPU; the message lists every node's GPUs.
            (Also the reason of a memory placeholder passed as ``device``: as
            :func:`gpu_serde.routing.target_uuid`.)
        PlacementError: ``exclusive`` and the node declares no resource for the GPU, or
            ``runtime_env`` sets ``CUDA_VISIBLE_DEVICES`` to something else.
        TypeError: ``device`` is not one of those; ``runtime_env`` is not a dict.
        RuntimeError: Ray is not initialised here.
    """
    uuid = target_uuid(device)
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise TypeError(f"runtime_env must be a dict, not {type(runtime_env).__name__}")
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    if env_vars.get("CUDA_VISIBLE_DEVICES", uuid) != uuid:
        raise PlacementError(
            f"runtime_env sets CUDA_VISIBLE_DEVICES={env_vars['CUDA_VISIBLE_DEVICES']!r}; "
            f"on() needs it to be {uuid}"
        )
    views = node_views()
    having = [v for v in views if uuid in v.uuids]
    if not having:
        raise _not_seen(uuid, views)
    node = sorted(having, key=lambda v: (v.ray_gpus <= 0, v.node_id))[0]
    env["env_vars"] = {**env_vars, **UNMASK, "CUDA_VISIBLE_DEVICES": uuid}
    options: dict[str, Any] = {
        "num_gpus": 0,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        "runtime_env": env,
    }
    if exclusive:
        name = resource_name(uuid)
        if name not in node.declared:
            raise PlacementError(
                f"on({uuid}, exclusive=True): node {node.node_id[:12]} ({node.address}) declares "
                f"no resource named {name}, and Ray cannot hold one GPU by name otherwise (it "
                f"counts GPUs). Declare it where the node starts: ray start "
                f'--resources=\'{{"{name}": 1}}\', or ray.init(resources={{"{name}": 1}}) for '
                "a local cluster; or route without exclusive=True, or keep the GPU in one actor "
                "that owns it"
            )
        options["resources"] = {name: 1}
    return options
