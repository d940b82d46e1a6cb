"""This process's host identity: what a memory hand-off compares to tell "the exporter's host".

GPU memory can be mapped only by processes on the host that exported it. A payload carries its
exporter's host identity (16 bytes), and the receiver compares it with its own. By default the
identity is the kernel's ``boot_id`` (``/proc/sys/kernel/random/boot_id``): the same for every
process of one boot of one machine, whatever container or user it runs in.

``GPU_SERDE_HOST_ID=<label>`` in a process's environment gives it another identity, derived from
the label: processes with the same label are one "host", with different labels different hosts,
even on one machine. It is a test seam (the CPU tier puts "remote" Ray nodes and Dask workers on
one machine this way), and a switch for a deployment where processes of one boot must not map
each other's memory. It is read once, when the identity is first needed (not at import: a Dask
Nanny sets its worker's environment after the worker process imported the driver script's
modules). A label is 1 to 64 characters of ``A-Z a-z 0-9 . _ : -``; an empty value counts as
unset.
"""

from __future__ import annotations

import os
import re
import uuid as _uuid

#: The environment variable that gives this process another host identity.
HOST_ENV = "GPU_SERDE_HOST_ID"
_LABEL = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_NAMESPACE = _uuid.UUID("5d1c3c57-5a40-4e0e-9b0a-6b3f3b8e2a11")  # gpu_serde host labels


def _boot_id() -> bytes:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return _uuid.UUID(f.read().strip()).bytes


def label_identity(label: str) -> bytes:
    """The 16-byte host identity of ``GPU_SERDE_HOST_ID=label``.

    Raises:
        ValueError: ``label`` is not 1 to 64 characters of ``A-Z a-z 0-9 . _ : -``.
    """
    if not isinstance(label, str) or not _LABEL.fullmatch(label):
        raise ValueError(
            f"{HOST_ENV}={label!r:.80} is not a host label: use 1 to 64 characters of "
            "A-Z a-z 0-9 . _ : -"
        )
    return _uuid.uuid5(_NAMESPACE, label).bytes


_identity: tuple[bytes, str] | None = None


def _read() -> tuple[bytes, str]:
    global _identity
    if _identity is None:
        label = os.environ.get(HOST_ENV) or None  # empty: unset
        _identity = (_boot_id(), "") if label is None else (label_identity(label), label)
    return _identity


def host_id() -> bytes:
    """This process's host identity (16 bytes): the boot id, or the one ``GPU_SERDE_HOST_ID``
    gives. Read once, on first use.

    Raises:
        ValueError: ``GPU_SERDE_HOST_ID`` is set to something that is not a host label.
    """
    return _read()[0]


def label() -> str:
    """This process's ``GPU_SERDE_HOST_ID`` label, or ``""`` when it has none."""
    return _read()[1]


def describe_host(name: str) -> str:
    """``name`` (a host name) with this process's ``GPU_SERDE_HOST_ID`` label, if one is set."""
    return f"{name} ({HOST_ENV}={label()})" if label() else name
