"""The descriptor broker: how an exporter hands descriptors and holds to importing processes on
its host (:mod:`~gpu_serde.memory.broker.server`), and how an importer asks
(:mod:`~gpu_serde.memory.broker.client`)."""

# its exit hook hands what is still held to a keeper (imported after the server, it runs first)
from gpu_serde.memory.broker import keeper
from gpu_serde.memory.broker.client import (
    acquire,
    disconnect,
    exited,
    fetch,
    holds,
    open_connections,
    release,
)
from gpu_serde.memory.broker.server import ANY, Broker, broker, is_own, started

__all__ = [
    "ANY",
    "Broker",
    "acquire",
    "broker",
    "disconnect",
    "exited",
    "fetch",
    "holds",
    "is_own",
    "keeper",
    "open_connections",
    "release",
    "started",
]
