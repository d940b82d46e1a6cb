"""Ray adapter: Devices keep their GPU across tasks, actors, nodes and the object store.

Use :func:`init` in place of ``ray.init``, or merge :func:`runtime_env` into the job's runtime_env::

    import gpu_serde.ray
    gpu_serde.ray.init()                      # ray.init + worker hook + install() here

Only the job-level runtime_env reaches ``worker_process_setup_hook``; Ray ignores it when given
per task or actor in ``.options(runtime_env=...)``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gpu_serde.inventory import set_role
from gpu_serde.registry import ensure_installed

HOOK = "gpu_serde.ray.setup_worker"
_KEY = "worker_process_setup_hook"
logger = logging.getLogger("gpu_serde.ray")


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook``: install gpu_serde's reducers in this worker.

    Runs once in each worker process before its first task (Ray calls it by the name
    ``"gpu_serde.ray.setup_worker"``, so gpu_serde must be installed on every node). Task return
    values are pickled in the worker, so workers need the reducers as much as the driver does.

    It deliberately does not enumerate GPUs: the hook runs before Ray sets the first task's
    ``CUDA_VISIBLE_DEVICES``, and CUDA reads that variable once, at initialisation. Enumerating
    here would give every worker all of its node's GPUs. The inventory is taken on first use.
    """
    import ray

    ensure_installed("Ray")
    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # the role is only for messages
        node = "?"
    set_role(f"ray worker on node {node[:12]}")
    logger.debug("gpu_serde: installed in ray worker pid %d on node %s", os.getpid(), node)


def runtime_env(env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a copy of ``env`` (a Ray runtime_env dict) with gpu_serde's worker hook added.

    Raises:
        ValueError: ``env`` already names another ``worker_process_setup_hook``; call
            :func:`setup_worker` from that hook instead.
        TypeError: ``env`` is not a dict.
    """
    if env is None:
        env = {}
    elif not isinstance(env, dict):
        raise TypeError(f"runtime_env must be a dict, not {type(env).__name__}")
    merged = dict(env)
    current = merged.get(_KEY)
    if current is not None and current != HOOK and current is not setup_worker:
        raise ValueError(
            f"runtime_env already has {_KEY}={current!r}; gpu_serde will not replace it. "
            "Call gpu_serde.ray.setup_worker() from inside your own hook instead."
        )
    merged[_KEY] = HOOK
    return merged


def init(*args: Any, **kwargs: Any) -> Any:
    """``ray.init`` with gpu_serde's worker hook merged into ``runtime_env``, and :func:`install`
    in this (driver) process. Takes and returns what ``ray.init`` does.

    Raises:
        ValueError: as :func:`runtime_env`.
    """
    import ray

    kwargs["runtime_env"] = runtime_env(kwargs.get("runtime_env"))
    ensure_installed("Ray")
    set_role("ray driver")
    return ray.init(*args, **kwargs)
