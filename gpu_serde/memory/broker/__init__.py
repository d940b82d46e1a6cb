"""The descriptor broker: how an exporter hands descriptors and holds to importing processes on
its host (:mod:`~gpu_serde.memory.broker.server`), and how an importer asks
(:mod:`~gpu_serde.memory.broker.client`)."""

from gpu_serde.memory.broker.client import (
    acquire,
    disconnect,
    fetch,
    holds,
    open_connections,
    release,
)
from gpu_serde.memory.broker.server import ANY, Broker, broker, is_own

__all__ = [
    "ANY",
    "Broker",
    "acquire",
    "broker",
    "disconnect",
    "fetch",
    "holds",
    "is_own",
    "open_connections",
    "release",
]
