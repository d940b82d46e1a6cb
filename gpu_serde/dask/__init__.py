"""Dask adapter: Devices resolve by UUID on every worker; buffers reach any worker, mapped on
their host and by value beyond it.

From a client:

.. code-block:: python

    import gpu_serde.dask
    gpu_serde.dask.register(client)

Or from the command line: ``dask worker --preload gpu_serde.dask`` and
``dask scheduler --preload gpu_serde.dask`` (this module is the preload: :func:`dask_setup`).

Public names (the rest of the package is how they work: :mod:`~gpu_serde.dask.plugin`, the
plugin and preload; :mod:`~gpu_serde.dask.placement`, ``on()``;
:mod:`~gpu_serde.dask.serializers`, how a buffer travels; :mod:`~gpu_serde.dask.tensors`, how a
torch tensor or CuPy array travels; :mod:`~gpu_serde.dask.hosts`, where a peer is)::

    gpu_serde.dask.register(client)      gpu_serde here and on every worker of the client
    gpu_serde.dask.GPUSerdePlugin        the worker plugin (idempotent, named "gpu_serde")
    gpu_serde.dask.on(device)            client.submit kwargs: run where that GPU is
    gpu_serde.dask.dask_setup            the preload hook
"""

from gpu_serde.dask import tensors as _tensors
from gpu_serde.dask.placement import on
from gpu_serde.dask.plugin import GPUSerdePlugin, dask_setup, register

_tensors.register()  # torch tensors and CuPy arrays, once those are imported

__all__ = ["GPUSerdePlugin", "dask_setup", "on", "register"]
