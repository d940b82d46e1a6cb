"""Ray: gpu_serde in the driver and in every worker (``init``, the hooks, the job's mark).

Every process that pickles a Device needs gpu_serde installed: the driver and every worker. Pick
one of these (each is tested; see docs/deployment.md)::

    gpu_serde.ray.init(...)                                   # in place of ray.init
    RAY_RUNTIME_ENV_HOOK=gpu_serde.ray.runtime_env_hook      # in the driver's environment
    ray job submit --runtime-env-json \\
      '{"worker_process_setup_hook": "gpu_serde.ray.setup_worker",
        "env_vars": {"RAY_RUNTIME_ENV_HOOK": "gpu_serde.ray.runtime_env_hook"}}' -- python job.py

Only the job-level runtime_env reaches ``worker_process_setup_hook``; Ray ignores it when given
per task or actor in ``.options(runtime_env=...)``.

With Ray 2.55 and later, actors can also hand ``cuda.core.Buffer`` results to each other through
Ray Direct Transport, outside the object store: ``@ray.method(tensor_transport=TRANSPORT)`` on an
actor declared with ``enable_tensor_transport=True`` (:mod:`gpu_serde.ray.transport`).

A driver that installed gpu_serde this way marks its job (the environment variable
:data:`DRIVER_MARK` in its workers); a worker whose job lacks the mark logs a warning that Devices
from that driver arrive by ordinal.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import ray

from gpu_serde.inventory import set_role
from gpu_serde.netcheck import refused_for
from gpu_serde.ray import tensor_transport, transport
from gpu_serde.registry import ensure_installed
from gpu_serde.text import quoted

#: Seconds :func:`init` waits for an ``address`` that refuses connections to accept one.
CONNECT_WAIT_S = 30.0

#: The ``worker_process_setup_hook`` that installs gpu_serde in a Ray worker.
HOOK = "gpu_serde.ray.setup_worker"
#: The ``RAY_RUNTIME_ENV_HOOK`` value that installs gpu_serde in the driver and adds :data:`HOOK`.
ENV_HOOK = "gpu_serde.ray.runtime_env_hook"
#: The environment variable an installed driver sets in its job's workers.
DRIVER_MARK = "GPU_SERDE_RAY_DRIVER"
_KEY = "worker_process_setup_hook"
_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a submitted job
logger = logging.getLogger("gpu_serde.ray")


def setup_worker() -> None:
    """Ray ``worker_process_setup_hook``: install gpu_serde's reducers in this worker.

    Runs once in each worker process before its first task (Ray calls it by the name
    ``"gpu_serde.ray.setup_worker"``, so gpu_serde must be installed on every node). Task return
    values are pickled in the worker, so workers need the reducers as much as the driver does.
    Logs a warning (Ray shows it at the driver) when the job's driver did not install gpu_serde:
    Devices that driver sends arrive by ordinal.

    It deliberately does not enumerate GPUs: the hook runs before Ray sets the first task's
    ``CUDA_VISIBLE_DEVICES``, and CUDA reads that variable once, at initialisation. Enumerating
    here would give every worker all of its node's GPUs. The inventory is taken on first use.
    """
    ensure_installed("Ray")
    transport.register()  # Buffers through Ray Direct Transport (Ray 2.55 and later)
    tensor_transport.register()  # torch tensors too, once torch is imported
    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # the role is only for messages
        node = "?"
    set_role(f"ray worker on node {node[:12]}")
    logger.debug("gpu_serde: installed in ray worker pid %d on node %s", os.getpid(), node)
    warn_if_ray_pickles_tensors()
    if not driver_installed():
        logger.warning(
            "gpu_serde: this job's driver did not install gpu_serde, so Devices it sends reach "
            "workers by ordinal (possibly another GPU). Start the driver with "
            "gpu_serde.ray.init(), or set RAY_RUNTIME_ENV_HOOK=%s in its environment "
            "(for `ray job submit`: in the job's runtime_env env_vars).",
            ENV_HOOK,
        )


#: Ray's switch that makes it pickle torch tensors itself, ahead of every other reducer.
RAY_ZERO_COPY = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"


def warn_if_ray_pickles_tensors() -> bool:
    """Log a warning, and return True, when :data:`RAY_ZERO_COPY` is on in this process: Ray then
    pickles every torch tensor itself, ahead of gpu_serde, and rebuilds a CUDA one on
    ``str(tensor.device)``, an ordinal: possibly another GPU in the receiver."""
    if os.environ.get(RAY_ZERO_COPY, "").strip().lower() not in ("1", "true"):
        return False
    logger.warning(
        "gpu_serde: %s is set, so Ray pickles torch tensors itself, ahead of gpu_serde: a CUDA "
        "tensor sent as a task argument, a return or through ray.put is rebuilt on the "
        "receiver's 'cuda:N' of the sender's N, by ordinal, possibly another GPU. Unset it to "
        "have CUDA tensors carried by GPU UUID, or send them as gpu_serde.share(x) (by UUID, "
        "no copy, one host).",
        RAY_ZERO_COPY,
    )
    return True


def driver_installed() -> bool:
    """In a Ray worker: True if this job's driver installed gpu_serde (through :func:`init` or
    :func:`runtime_env_hook`), which marks the job's workers with :data:`DRIVER_MARK`."""
    return bool(os.environ.get(DRIVER_MARK))


def runtime_env(env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return a copy of ``env`` (a Ray runtime_env dict) with gpu_serde's worker hook added.

    It installs nothing in this process: use it to build a job's runtime_env (for example for
    ``JobSubmissionClient.submit_job``); the driver still needs :func:`init` or
    :func:`runtime_env_hook`.

    Raises:
        ValueError: ``env`` already names another ``worker_process_setup_hook``; call
            :func:`setup_worker` from that hook instead.
        TypeError: ``env`` is not a dict (or None).
    """
    if env is None:
        env = {}
    elif not isinstance(env, dict):
        raise TypeError(f"runtime_env must be a dict or None, not {type(env).__name__}")
    merged = dict(env)
    current = merged.get(_KEY)
    if current is not None and not _is_ours(current):
        raise ValueError(
            f"runtime_env already has {_KEY}={current!r}; gpu_serde will not replace it. "
            "Call gpu_serde.ray.setup_worker() from inside your own hook instead."
        )
    merged[_KEY] = HOOK
    return merged


def _is_ours(hook: Any) -> bool:
    return hook == HOOK or hook is setup_worker


def _marked(env: dict[str, Any]) -> dict[str, Any]:
    env_vars = env.get("env_vars") or {}
    if not isinstance(env_vars, dict):
        raise TypeError(f"runtime_env['env_vars'] must be a dict, not {type(env_vars).__name__}")
    return {**env, "env_vars": {**env_vars, DRIVER_MARK: "1"}}


def _install_driver() -> None:
    ensure_installed("Ray")
    set_role("ray driver")
    transport.register()
    tensor_transport.register()
    warn_if_ray_pickles_tensors()


def runtime_env_hook(env: dict[str, Any] | None) -> dict[str, Any]:
    """A ``RAY_RUNTIME_ENV_HOOK`` entry: ``RAY_RUNTIME_ENV_HOOK=gpu_serde.ray.runtime_env_hook``.

    Ray calls it in the driver, inside ``ray.init``, with the job's runtime_env (a dict or None).
    It installs gpu_serde in the driver and returns the runtime_env with the worker hook and the
    driver mark added. Set in a submitted job's ``env_vars``, it reaches the job's driver too, so
    a plain ``ray.init()`` in the script is enough.

    Raises:
        ValueError, TypeError: as :func:`runtime_env`.
    """
    merged = runtime_env(env)
    _install_driver()
    return _marked(merged)


def _job_runtime_env() -> dict[str, Any] | None:
    """The runtime_env of the submitted job this driver runs in (Ray's job supervisor passes it
    in an environment variable), or None outside a submitted job."""
    raw = os.environ.get(_JOB_CONFIG)
    if not raw:
        return None
    try:
        env = json.loads(raw).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return env if isinstance(env, dict) else None


def init(*args: Any, **kwargs: Any) -> Any:
    """``ray.init`` with gpu_serde's worker hook merged into ``runtime_env``, and gpu_serde
    installed in this (driver) process. Takes and returns what ``ray.init`` does.

    In a job started by ``ray job submit`` whose runtime_env already carries the worker hook,
    the hook is not given again (Ray refuses a key that both the job and ``ray.init`` set).

    An ``address`` (``host:port``) that refuses the connection for 30 seconds
    (``gpu_serde.ray.setup.CONNECT_WAIT_S``; a head still starting gets that long) is a
    ``ConnectionError`` (``ray.init`` would retry for minutes).

    Raises:
        ValueError: as :func:`runtime_env`, or the submitted job's runtime_env names another
            ``worker_process_setup_hook``.
        TypeError: ``runtime_env`` is not a dict (or None).
        ConnectionError: nothing listened at ``address`` within that time.
    """
    address = kwargs.get("address", args[0] if args else None)
    why = refused_for(address, CONNECT_WAIT_S) if isinstance(address, str) else None
    if why is not None:
        raise ConnectionError(
            f"gpu_serde.ray.init(address={quoted(address)}): nothing answered there within "
            f"{CONNECT_WAIT_S:g} s ({why}): is the cluster running? `ray start --head` prints "
            "its address (host:port of the GCS, port 6379 unless --port says otherwise); leave "
            "address out to start a local one"
        )
    env = runtime_env(kwargs.get("runtime_env"))
    job = _job_runtime_env()
    if job is not None and job.get(_KEY) is not None:
        if not _is_ours(job[_KEY]):
            raise ValueError(
                f"the submitted job's runtime_env has {_KEY}={job[_KEY]!r}; gpu_serde will not "
                "replace it. Call gpu_serde.ray.setup_worker() from inside that hook instead."
            )
        del env[_KEY]  # the job gives it already
    job_vars = (job or {}).get("env_vars") or {}
    if DRIVER_MARK not in job_vars:
        env = _marked(env)
    _install_driver()
    kwargs["runtime_env"] = env or None
    return ray.init(*args, **kwargs)
