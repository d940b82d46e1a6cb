"""The GPUs this process sees, from the CUDA driver's own enumeration (cached, thread-safe).

Enumeration uses ``cuInit``, ``cuDeviceGetCount``, ``cuDeviceGetUuid``, ``cuDeviceGetName`` and
``cuDeviceGetPCIBusId``: no CUDA context is created.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from dataclasses import dataclass, field

from cuda.bindings import driver

from gpu_serde.hostid import describe_host
from gpu_serde.identity import (
    DeviceInfo,
    canonical_uuid,
    cuda_visible_devices,
    describe_cuda_visible_devices,
    mig_prefixes,
)
from gpu_serde.text import safe


@dataclass(frozen=True)
class Inventory:
    """A snapshot of what this process can see.

    Attributes:
        devices: the visible GPUs in ordinal order.
        reason: why ``devices`` is empty (``""`` when it is not).
        cuda_visible_devices: ``CUDA_VISIBLE_DEVICES`` at the snapshot (``None``: unset).
        host: this host's name.
        pid: the id of the process that took the snapshot.
        simulated: True when the driver is gpu_serde's stand-in (:mod:`gpu_serde.testing`).
    """

    devices: tuple[DeviceInfo, ...]
    reason: str
    cuda_visible_devices: str | None
    host: str
    pid: int
    simulated: bool = False
    by_uuid: dict[bytes, int] = field(default_factory=dict, repr=False, compare=False)

    def describe(self) -> str:
        """Multi-line text: ``CUDA_VISIBLE_DEVICES`` and each visible GPU, or why there is none."""
        cvd = describe_cuda_visible_devices(self.cuda_visible_devices)
        now = cuda_visible_devices()
        if now != self.cuda_visible_devices:
            cvd += (
                f" at CUDA initialisation (now {describe_cuda_visible_devices(now)};"
                " CUDA ignores later changes)"
            )
        lines = [f"CUDA_VISIBLE_DEVICES={cvd}"]
        if self.devices:
            sim = " (simulated driver)" if self.simulated else ""
            lines.append(f"this process sees {len(self.devices)} GPU(s){sim}:")
            lines += [
                f"  {d.ordinal}  {d.uuid}  {safe(d.name)}  {safe(d.pci_bus_id) or '-'}"
                for d in self.devices
            ]
            # an empty entry counts (CUDA stops there), but not a trailing comma's: it loses none
            given = (self.cuda_visible_devices or "").rstrip(", \t")
            named = given.split(",") if given.strip() else []
            if len(named) > len(self.devices) and not any(
                e.strip().startswith("MIG-") for e in named
            ):
                lines.append(
                    f"note: CUDA_VISIBLE_DEVICES names {len(named)} entries and CUDA took "
                    f"{len(self.devices)}: it stops at the first entry that names no GPU here "
                    "(an ordinal out of range, an unknown UUID, an empty one) or one named before"
                )
        else:
            lines.append(f"this process sees no GPU: {safe(self.reason)}")
        return "\n".join(lines)


_lock = threading.Lock()
cached: Inventory | None = None  # read directly on hot paths
role = ""  # what this process is, for error messages ("dask worker tcp://...", "ray worker ...")


def set_role(text: str) -> None:
    """Name this process's role in the cluster; error messages show it beside host and pid."""
    global role
    role = text


def _hostname() -> str:
    return describe_host(socket.gethostname())


def _is_simulated() -> bool:
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    return hasattr(lib, "gpu_serde_simulated_driver")


def _bare_uuid_hint(cvd: str) -> str:
    """A hint for the first entry of ``cvd`` that is a UUID without its ``GPU-`` prefix (which
    CUDA reads as no GPU), else ''."""
    first = cvd.split(",")[0].strip()
    if first[:4].upper() in ("GPU-", "MIG-"):
        return ""
    try:
        canonical_uuid(first)  # bare hex, as cuda.core's Device.uuid writes it
    except ValueError:
        return ""
    return f": {first!r} is a UUID without its 'GPU-' prefix; write 'GPU-{first}'"


def _enumerate() -> Inventory:
    cvd = cuda_visible_devices()
    host, pid = _hostname(), os.getpid()

    def empty(reason: str, loaded: bool = True) -> Inventory:
        return Inventory((), reason, cvd, host, pid, loaded and _is_simulated())

    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # cuda.pathfinder's DynamicLibNotFoundError
        return empty(f"no CUDA driver (libcuda.so.1 not found: {exc})", loaded=False)
    if err == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        if cvd is not None and cvd.strip() == "":
            return empty("CUDA_VISIBLE_DEVICES is empty, so CUDA hides every GPU")
        if cvd is not None:
            return empty(
                f"CUDA_ERROR_NO_DEVICE: CUDA_VISIBLE_DEVICES={cvd!r} selects no GPU on this host "
                f"(CUDA stops at the first entry that names no GPU){_bare_uuid_hint(cvd)}"
            )
        return empty("CUDA_ERROR_NO_DEVICE: the driver finds no GPU on this host")
    if err != driver.CUresult.CUDA_SUCCESS:
        return empty(f"cuInit failed: {err.name}")
    err, count = driver.cuDeviceGetCount()
    if err != driver.CUresult.CUDA_SUCCESS:
        return empty(f"cuDeviceGetCount failed: {err.name}")
    migs = mig_prefixes(cvd)
    devices = []
    by_uuid: dict[bytes, int] = {}
    for ordinal in range(count):
        err, uuid = driver.cuDeviceGetUuid(ordinal)
        if err != driver.CUresult.CUDA_SUCCESS:
            return empty(f"cuDeviceGetUuid({ordinal}) failed: {err.name}")
        raw = bytes(uuid.bytes)
        err, name = driver.cuDeviceGetName(256, ordinal)
        name_s = name.split(b"\0", 1)[0].decode(errors="replace") if err == 0 else ""
        err, pci = driver.cuDeviceGetPCIBusId(32, ordinal)
        pci_s = pci.split(b"\0", 1)[0].decode(errors="replace") if err == 0 else ""
        mig = any(raw.hex().startswith(p) for p in migs if p)
        devices.append(DeviceInfo(ordinal, canonical_uuid(raw, mig=mig), name_s, pci_s))
        by_uuid.setdefault(raw, ordinal)
    return Inventory(tuple(devices), "", cvd, host, pid, _is_simulated(), by_uuid)


_forked_from: int | None = None


def forked_from() -> int | None:
    """The pid of the process this one was forked from after CUDA was initialised there (as
    far as gpu_serde saw: its parent had enumerated its GPUs), else None. Such a process cannot
    use CUDA, so the GPU memory it inherited is its parent's."""
    return _forked_from


def _after_fork_in_child() -> None:
    global cached, _lock, _forked_from
    _lock = threading.Lock()
    parent = cached
    if parent is not None and parent.devices:  # the parent initialised CUDA
        _forked_from = parent.pid
        cached = Inventory(
            (),
            f"this process was forked from pid {parent.pid} after CUDA was initialised there, and "
            "CUDA cannot be used in such a child: start it with the 'spawn' or 'forkserver' method",
            parent.cuda_visible_devices,
            parent.host,
            os.getpid(),
            parent.simulated,
        )


os.register_at_fork(after_in_child=_after_fork_in_child)


def inventory() -> Inventory:
    """Return this process's :class:`Inventory`, enumerating the driver on the first call.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once per process, so the answer is cached for the process's
    life. A child forked after its parent initialised CUDA sees no GPU (CUDA cannot be used
    there) and says why. Never raises for a missing driver or GPU.
    """
    global cached
    inv = cached
    if inv is not None:
        return inv
    with _lock:
        if cached is None:
            cached = _enumerate()
        return cached


def forget_before_cuda() -> None:
    """Drop a cached answer taken before CUDA started here (no driver then): a driver loaded
    since (:func:`gpu_serde.testing.activate`) is enumerated on the next call. Once CUDA has
    started, its answer stands for the process's life."""
    global cached
    with _lock:
        if cached is not None and not cached.devices:
            cached = None


def visible_devices() -> list[DeviceInfo]:
    """Return the GPUs this process can see, in ordinal order (empty when it sees none).

    Each entry is a :class:`DeviceInfo` (ordinal, canonical UUID, name, PCI bus id). The list comes
    from the driver's enumeration in this process, so it reflects ``CUDA_VISIBLE_DEVICES`` as CUDA
    applied it. Never raises and never creates a CUDA context; :func:`inventory` says why a list
    is empty.
    """
    return list(inventory().devices)


def local_ordinal(uuid: bytes) -> int | None:
    """This process's ordinal of the GPU with these 16 raw UUID bytes, or None if not visible.

    Never raises and never creates a CUDA context (the inventory is enumerated once, then cached).
    """
    return (cached or inventory()).by_uuid.get(uuid)


def uuid_of(ordinal: int) -> str:
    """The canonical UUID (``GPU-...``, or ``MIG-...`` for a MIG instance) of this process's GPU
    ``ordinal``: what ``"GPU-" + Device(ordinal).uuid`` gets wrong for MIG.

    Raises:
        ValueError: no visible GPU has that ordinal.
    """
    devices = (cached or inventory()).devices
    if not 0 <= ordinal < len(devices):
        raise ValueError(f"this process sees no GPU {ordinal}: {inventory().describe()}")
    return devices[ordinal].uuid
