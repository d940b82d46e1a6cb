"""The stable names that gpu_serde pickles carry: one reconstructor per payload kind.

A pickle names these functions (``gpu_serde.wire.dev``), so they are part of the wire format: they
stay here, under these short names (they travel in every payload), across releases; committed old
pickles (``tests/old_pickles``) pin them. Reconstructors are module-level functions, not methods
or closures, because a pickle can only name a global (Ray's ``_private/serialization.py`` says the
same of its object-ref deserializer).

Each is a thin lookup: it runs the body that its type module defined, under the one rebuild guard
of :mod:`gpu_serde.placeholders`, so that none of them ever raises while it is unpickled (except
under ``install(strict=True)``). Any number of arguments is accepted, so that a pickle that calls
one with the wrong arity also gets a placeholder (``PayloadError``) instead of a ``TypeError``.
"""

from __future__ import annotations

from typing import Any

from gpu_serde.placeholders import rebuild


def dev(*payload: Any) -> Any:
    """A ``Device``: the local one with the payload's GPU UUID, or an ``UnresolvedDevice``."""
    return rebuild(dev, payload)


def pool(*payload: Any) -> Any:
    """A ``DeviceMemoryResource`` or ``PinnedMemoryResource``: imported here once, the original
    back in its exporter, or an ``UnresolvedObject``."""
    return rebuild(pool, payload)


def buf(*payload: Any) -> Any:
    """A pool ``Buffer``: the exporter's memory mapped here without a copy, or an
    ``UnresolvedObject``."""
    return rebuild(buf, payload)


def vmo(*payload: Any) -> Any:
    """``VirtualMemoryResourceOptions`` with their peers on this process's ordinals, or an
    ``UnresolvedObject``."""
    return rebuild(vmo, payload)


def vmm(*payload: Any) -> Any:
    """A ``VirtualMemoryResource`` on this process's ordinal of the same GPU, or an
    ``UnresolvedObject``."""
    return rebuild(vmm, payload)


def vbuf(*payload: Any) -> Any:
    """A ``VirtualMemoryResource`` buffer mapped here without a copy, or an ``UnresolvedObject``."""
    return rebuild(vbuf, payload)


def arena(*payload: Any) -> Any:
    """An ``ArenaMemoryResource``: its region mapped here once (an ``ImportedArena``), the
    original back in its exporter, or an ``UnresolvedObject``."""
    return rebuild(arena, payload)


def abuf(*payload: Any) -> Any:
    """An ``ArenaMemoryResource`` buffer: an offset in its region, mapped here once per process,
    or an ``UnresolvedObject``."""
    return rebuild(abuf, payload)


def hbuf(*payload: Any) -> Any:
    """A ``Buffer`` sent by value (a host copy of its bytes): a new buffer here, on the same GPU if
    this process sees it, or an ``UnresolvedObject``."""
    return rebuild(hbuf, payload)


def pbuf(*payload: Any) -> Any:
    """A portable ``Buffer`` (``gpu_serde.portable``): the exporter's memory mapped on its host,
    the host copy uploaded elsewhere, or an ``UnresolvedObject``."""
    return rebuild(pbuf, payload)


def unsent(*payload: Any) -> Any:
    """An object its sender could not send (a Dask serializer cannot raise without losing the
    receiver): an ``UnresolvedObject`` that raises the sender's typed error when used."""
    return rebuild(unsent, payload)


def tval(*payload: Any) -> Any:
    """A torch CUDA tensor or a CuPy array by value (its bytes): a new one on the same GPU, found
    by UUID, or an ``UnresolvedObject`` (``DeviceNotVisibleError`` where that GPU is not
    visible)."""
    return rebuild(tval, payload)


def tshr(*payload: Any) -> Any:
    """A torch tensor or CuPy array shared without a copy (``gpu_serde.share``): the exporter's
    arena block mapped here, or an ``UnresolvedObject``."""
    return rebuild(tshr, payload)


def tipc(*payload: Any) -> Any:
    """A torch CUDA tensor through ``torch.multiprocessing``: torch's own CUDA IPC, opened on
    the same GPU found by UUID, or an ``UnresolvedObject``."""
    return rebuild(tipc, payload)
