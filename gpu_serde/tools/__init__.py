"""Tools: the ``gpu-serde`` command line (:mod:`~gpu_serde.tools.cli`), ``doctor`` (every
worker's GPU map) and ``demo`` (a local cluster shown working)."""
