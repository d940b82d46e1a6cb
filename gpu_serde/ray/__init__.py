"""Ray adapter: Devices keep their GPU across tasks, actors, nodes and the object store; buffers
cross them without a copy on one host.

Public names (the rest of the package is how they work: :mod:`~gpu_serde.ray.setup`, the driver
and worker hooks; :mod:`~gpu_serde.ray.placement`, ``on()``; :mod:`~gpu_serde.ray.transport`, Ray
Direct Transport for buffers; :mod:`~gpu_serde.ray.tensor_transport`, for torch tensors)::

    gpu_serde.ray.init(*args, **kwargs)          ray.init with gpu_serde in the driver and workers
    gpu_serde.ray.runtime_env(env=None)          a runtime_env with the worker hook merged in
    gpu_serde.ray.setup_worker                   the worker_process_setup_hook
    gpu_serde.ray.runtime_env_hook               the RAY_RUNTIME_ENV_HOOK entry
    gpu_serde.ray.on(device)                     .options() kwargs: run where that GPU is
    gpu_serde.ray.TRANSPORT                      the Ray Direct Transport's name (Buffers)
    gpu_serde.ray.TENSOR_TRANSPORT               the one for torch tensors, by GPU UUID
"""

from gpu_serde.ray.placement import on
from gpu_serde.ray.setup import (
    DRIVER_MARK,
    ENV_HOOK,
    HOOK,
    driver_installed,
    init,
    runtime_env,
    runtime_env_hook,
    setup_worker,
)
from gpu_serde.ray.tensor_transport import TENSOR_TRANSPORT
from gpu_serde.ray.transport import TRANSPORT

__all__ = [
    "DRIVER_MARK",
    "ENV_HOOK",
    "HOOK",
    "TENSOR_TRANSPORT",
    "TRANSPORT",
    "driver_installed",
    "init",
    "on",
    "runtime_env",
    "runtime_env_hook",
    "setup_worker",
]
