"""Simulated GPUs for CPU-only tests: a stand-in ``libcuda.so.1`` and ``libnvidia-ml.so.1`` built
from C on first use.

The stand-in presents the GPUs you describe and applies ``CUDA_VISIBLE_DEVICES`` the way the real
driver does (unset: all; ``""``: none; ordinals, ``GPU-``/``MIG-`` UUIDs or unique prefixes, any
case; the list stops at the first entry that names no GPU). cuda.core sees real ``Device`` objects
with UUIDs, names, PCI ids and a compute capability of 9.0.

It keeps memory in host memory that other processes can map, enough for cuda.core 1.2's
``set_current()``, streams and events (synchronous by default; IPC events too),
``DeviceMemoryResource`` with and without IPC, ``PinnedMemoryResource`` with IPC,
``VirtualMemoryResource`` with ``posix_fd`` handles, ``cuMemcpy*``, ``cuMemsetD8/16/32*`` and
pointer attributes. Each pool is one memfd (each
VMM allocation too): an exported descriptor maps the same bytes in the importer, and a "device
pointer" is a host address. It keeps the CUDA rules on imports (importers free
first, a destroyed pool's memory is gone) with the driver's error codes; :func:`violations` counts
exporters that freed first. ``GPU_SERDE_SIM_TRACE=1`` prints every failing call.
``GPU_SERDE_SIM_WORK_MS=t`` (read when the stand-in loads) makes each async copy or memset
count as ``t`` ms of work in flight on its stream (its bytes move at once): until then the stream
and the events recorded behind it are not done, so code that does something else for a busy
stream runs that path too. An event opened from another process's IPC handle is busy while the
sender's is (its done time is in a memory file the opener maps): a receiver waits for its
sender's work.

It does **not** simulate kernels (no CuPy or PyTorch work), graphs, the CUDA runtime
(``Device.sync()``, ``Device.pci_bus_id``), peer access (every "GPU" is host memory), managed
memory or timings (meaningless). Each of those calls fails and names itself: a driver function it
does not define returns ``CUDA_ERROR_STUB_LIBRARY`` (cuda.core's ``CUDAError`` then reads
"gpu_serde simulated GPU: cuLibraryLoadData is not simulated; ..."), the CUDA runtime fails with
``cudaErrorStubLibrary``, and the first such call of each kind says so on stderr. docs/testing.md
says what works and what does not, and has an example of testing a pipeline that passes buffers.
``gpu-serde simulate`` gives a shell the same GPUs.

The stand-in NVML presents the same GPUs and, like the real NVML, ignores ``CUDA_VISIBLE_DEVICES``:
it enumerates every GPU of the host in the list's order. It answers what Ray's GPU count, dask-cuda
and distributed's NVML diagnostics ask (counts, handles by index/UUID/PCI id, UUIDs, names, memory,
CPU affinity, MIG mode: disabled, driver versions), so Ray counts the simulated GPUs and
``dask cuda worker`` / ``LocalCUDACluster`` start on them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid as _uuid
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_serde.hostid import HOST_ENV, label_identity
from gpu_serde.identity import canonical_uuid, uuid_bytes
from gpu_serde.listing import lister
from gpu_serde.text import quoted

__dir__ = lister(globals())  # dir() leaves out the imports above

__all__ = [
    "RayAddressWarning",
    "SimulatedDriverError",
    "SimulatedGPU",
    "activate",
    "child_env",
    "driver_dir",
    "make_gpus",
    "ray_node_options",
    "real_driver_present",
    "sent_tensor",
    "spec_cluster_options",
    "violations",
]


SPEC_ENV = "GPU_SERDE_SIM_GPUS"
#: How the folders the stand-in is built into begin (:func:`driver_dir`).
DRIVER_DIR_PREFIX = "simdriver-"
#: Ray's switch that, set to ``0`` before Ray is imported, keeps its nodes on 127.0.0.1.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray_binds_outward() -> bool:
    """Whether Ray, by its own rule for ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (read when Ray is
    imported: set it before), binds nodes to this machine's outward-facing address: when the
    variable is ``1`` or ``true``, or unset on Linux."""
    value = os.environ.get(RAY_LOOPBACK_ENV)
    if value is None:
        return sys.platform not in ("darwin", "win32")
    return value.strip().lower() in ("1", "true")


class RayAddressWarning(UserWarning):
    """A Ray cluster made with :func:`ray_node_options` would bind this machine's outward-facing
    address: set ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before importing Ray to keep it on
    127.0.0.1."""


_HERE = Path(__file__).parent
#: library file name (also its soname) -> its C sources (the first defines the entry points); the
#: driver's sources share the headers of _HEADERS
_LIBRARIES = {
    "libcuda.so.1": [
        _HERE / f"{name}.c"
        for name in ("simdriver", "simctx", "simmem", "simipc", "simcopy", "simvmm", "simstub")
    ],
    "libnvidia-ml.so.1": [_HERE / "simnvml.c"],
}
_HEADERS = [_HERE / f"{name}.h" for name in ("simdriver", "simpool", "simsyms")]


class SimulatedDriverError(RuntimeError):
    """The simulated driver cannot be built or used here (no C compiler, a real driver present)."""


_PCI = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
#: The most simulated GPUs one host may have (as ``gpu-serde simulate`` allows).
MAX_GPUS = 64


@dataclass(frozen=True)
class SimulatedGPU:
    """One simulated GPU: a ``GPU-``/``MIG-`` UUID (32 hex digits, 8-4-4-4-12), a name and a PCI
    bus id (``DDDD:BB:DD.F``), checked when it is made.

    Raises:
        TypeError: a field is not a str.
        ValueError: the UUID or PCI bus id is malformed, or a field has ``|``, ``;`` or a control
            character (they separate entries of ``GPU_SERDE_SIM_GPUS``).
    """

    uuid: str
    name: str = "NVIDIA H200 (simulated)"
    pci_bus_id: str = "0000:00:00.0"

    def __post_init__(self) -> None:
        for field_name in ("uuid", "name", "pci_bus_id"):
            text = getattr(self, field_name)
            if not isinstance(text, str):
                raise TypeError(f"SimulatedGPU({field_name}=...): a str, not {type(text).__name__}")
            if any(c in text for c in "|;") or not text.isprintable():
                raise ValueError(
                    f"SimulatedGPU({field_name}={text!r}): '|', ';' and control characters are "
                    "not allowed in a simulated GPU"
                )
        if self.uuid[:4] not in ("GPU-", "MIG-") or self.uuid != self.uuid.strip():
            raise ValueError(
                f"SimulatedGPU(uuid={self.uuid!r}): a GPU UUID starts with 'GPU-' (or 'MIG-'), "
                "as nvidia-smi -L prints it, with no spaces; make_gpus(n) makes valid ones"
            )
        try:
            canonical_uuid(self.uuid)
        except ValueError as exc:
            raise ValueError(f"SimulatedGPU(uuid=...): {exc}") from None
        if not _PCI.fullmatch(self.pci_bus_id):
            raise ValueError(
                f"SimulatedGPU(pci_bus_id={self.pci_bus_id!r}): expected DDDD:BB:DD.F in hex, "
                "as 0000:19:00.0"
            )

    def spec(self) -> str:
        """This GPU as one entry of ``GPU_SERDE_SIM_GPUS`` (``UUID|NAME|PCI``)."""
        return f"{self.uuid}|{self.name}|{self.pci_bus_id}"


def make_gpus(count: int, *, seed: str = "gpu_serde") -> list[SimulatedGPU]:
    """Return ``count`` simulated GPUs with distinct, deterministic UUIDs and PCI ids (``seed``
    makes another set, for a second simulated host).

    Raises:
        TypeError: ``count`` is not an int, or ``seed`` not a str.
        ValueError: ``count`` is not 1 to :data:`MAX_GPUS`.
    """
    if not isinstance(count, int) or isinstance(count, bool):
        raise TypeError(f"make_gpus(count=...): an int, not {type(count).__name__}")
    if not 1 <= count <= MAX_GPUS:
        raise ValueError(f"make_gpus(count=...): 1 to {MAX_GPUS} GPUs, not {count}")
    if not isinstance(seed, str):
        raise TypeError(f"make_gpus(seed=...): a str, not {type(seed).__name__}")
    gpus = []
    for i in range(count):
        u = _uuid.uuid5(_uuid.NAMESPACE_OID, f"{seed}/{i}")
        bus = f"{i // 15:04x}:{0x19 + 0x10 * (i % 15):02x}:00.0"  # 15 buses per PCI domain
        gpus.append(SimulatedGPU(f"GPU-{u}", pci_bus_id=bus))
    return gpus


def _cache_root() -> Path:
    explicit = os.environ.get("GPU_SERDE_CACHE_DIR")
    if explicit:  # absolute: children that change directory load from the same folder
        return Path(explicit).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpu_serde"


def driver_dir() -> Path:
    """Build the stand-in libraries if needed and return the folder that holds them.

    The folder holds ``libcuda.so.1`` (the driver) and ``libnvidia-ml.so.1`` (NVML). They are
    compiled with ``$CC`` (default ``cc``) into ``$GPU_SERDE_CACHE_DIR`` (default
    ``~/.cache/gpu_serde``), in a folder keyed by the sources' hash; concurrent builders are safe.

    Raises:
        SimulatedDriverError: no C compiler, the folder cannot be made or written, or the
            build failed.
    """
    digest = hashlib.sha256()
    for source in _HEADERS:
        digest.update(source.read_bytes() + b"\0")
    for name, sources in _LIBRARIES.items():
        digest.update(name.encode() + b"\0" + b"".join(p.read_bytes() for p in sources) + b"\0")
    folder = _cache_root() / f"{DRIVER_DIR_PREFIX}{digest.hexdigest()[:16]}"
    for name, sources in _LIBRARIES.items():
        if not (folder / name).exists():
            _build(sources, folder, name)
    return folder


def _build(sources: list[Path], folder: Path, name: str) -> None:
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise SimulatedDriverError(
            f"no C compiler {cc!r} to build gpu_serde's simulated driver: install gcc or set CC"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".build-", suffix=".so")
    except OSError as exc:
        raise SimulatedDriverError(
            f"cannot build gpu_serde's simulated driver in {quoted(str(folder))}: "
            f"{exc.strerror or exc}. Set GPU_SERDE_CACHE_DIR to a folder you can write "
            "(default ~/.cache/gpu_serde)"
        ) from None
    os.close(fd)
    cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", f"-Wl,-soname,{name}", "-o", tmp]
    cmd += [str(p) for p in sources]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        os.unlink(tmp)
        raise SimulatedDriverError(f"building the simulated {name} failed:\n{done.stderr}")
    os.replace(tmp, folder / name)


def _is_ours(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), "gpu_serde_simulated_driver")
    except OSError:
        return False


def real_driver_present(env: Mapping[str, str] | None = None) -> bool:
    """True if a real ``libcuda.so.1`` is loaded here, on ``env``'s ``LD_LIBRARY_PATH`` (default:
    this process's) or known to the system loader."""
    try:
        loaded = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        if not hasattr(loaded, "gpu_serde_simulated_driver"):
            return True
    except OSError:
        pass
    for d in (os.environ if env is None else env).get("LD_LIBRARY_PATH", "").split(":"):
        candidate = os.path.join(d, "libcuda.so.1")
        if d and os.path.exists(candidate) and not _is_ours(candidate):
            return True
    return ctypes.util.find_library("cuda") is not None


def _spec(gpus: Iterable[SimulatedGPU]) -> str:
    """``GPU_SERDE_SIM_GPUS`` for ``gpus``: one to :data:`MAX_GPUS` distinct GPUs."""
    if isinstance(gpus, (str, SimulatedGPU)) or not isinstance(gpus, Iterable):
        raise TypeError(
            f"gpus: a list of SimulatedGPU (make_gpus(n) makes one), not {type(gpus).__name__}"
        )
    gpus = list(gpus)
    wrong = [type(g).__name__ for g in gpus if not isinstance(g, SimulatedGPU)]
    if wrong:
        raise TypeError(f"gpus: SimulatedGPU objects (make_gpus(n) makes them), not {wrong[0]}")
    if not 1 <= len(gpus) <= MAX_GPUS:
        raise ValueError(f"gpus: 1 to {MAX_GPUS} simulated GPUs, not {len(gpus)}")
    for key, what in (("uuid", "UUID"), ("pci_bus_id", "PCI bus id")):
        seen = [g.uuid[4:].lower() if key == "uuid" else g.pci_bus_id.lower() for g in gpus]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise ValueError(
                f"gpus: two simulated GPUs have the {what} {twice[0]}; each GPU of a host has its "
                "own (make_gpus(n) makes distinct ones)"
            )
    return ";".join(g.spec() for g in gpus)


def _visible_value(visible: object, what: str = "visible") -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for ``visible``: None (unset), a str as is, one ordinal, or
    UUIDs/ordinals joined with commas."""
    if visible is None or isinstance(visible, str):
        return visible
    if isinstance(visible, int) and not isinstance(visible, bool):
        return str(visible)  # one ordinal
    if not isinstance(visible, Iterable):
        raise TypeError(
            f"{what}: a CUDA_VISIBLE_DEVICES string, or a list of GPU UUIDs and ordinals, not "
            f"{type(visible).__name__}"
        )
    entries = list(visible)
    for v in entries:
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise TypeError(f"{what}: GPU UUIDs (str) and ordinals (int), not {type(v).__name__}")
    return ",".join(str(v) for v in entries)


def child_env(
    gpus: Iterable[SimulatedGPU],
    visible: str | int | Iterable[str | int] | None = None,
    *,
    base: Mapping[str, str] | None = None,
    allow_real_driver: bool = False,
) -> dict[str, str]:
    """Return an environment for a child process that sees ``gpus`` through the stand-in driver and
    NVML (their folder goes first on ``LD_LIBRARY_PATH``).

    Args:
        gpus: every GPU of the simulated host.
        visible: the child's ``CUDA_VISIBLE_DEVICES``: ``None`` leaves it unset (all GPUs), a string
            is used as is, one ordinal (an int) or an iterable of UUIDs/ordinals is joined with
            commas.
        base: the environment to start from (default: this process's).
        allow_real_driver: shadow a real driver on this machine (refused by default).

    Raises:
        SimulatedDriverError: a real driver is present and ``allow_real_driver`` is False, or the
            stand-in cannot be built.
        TypeError: ``base`` is not a dict of str to str.
    """
    if base is not None and (
        not isinstance(base, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in base.items())
    ):
        got = type(base).__name__ if not isinstance(base, Mapping) else "other keys or values"
        raise TypeError(
            "child_env(base=...): an environment, a dict of str to str such as os.environ, not "
            f"{got}"
        )
    if not allow_real_driver and real_driver_present(base):
        raise SimulatedDriverError(
            "a real CUDA driver is present here; gpu_serde will not shadow it with simulated GPUs "
            "(pass allow_real_driver=True to do so anyway)"
        )
    spec, value = _spec(gpus), _visible_value(visible)
    env = dict(os.environ if base is None else base)
    folder = str(driver_dir())
    paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and p != folder]
    env["LD_LIBRARY_PATH"] = ":".join([folder, *paths])
    env[SPEC_ENV] = spec
    if value is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = value
    return env


def activate(
    gpus: Iterable[SimulatedGPU],
    visible: str | int | Iterable[str | int] | None = None,
    *,
    allow_real_driver: bool = False,
) -> None:
    """Use the stand-in driver in this process, before anything initialises CUDA.

    Sets ``GPU_SERDE_SIM_GPUS`` and ``CUDA_VISIBLE_DEVICES`` (and ``LD_LIBRARY_PATH`` for children)
    and loads both libraries globally so cuda.bindings and pynvml find them. Calling it again with
    the same GPUs is harmless; CUDA reads ``CUDA_VISIBLE_DEVICES`` once, so later changes take no
    effect here.

    ``visible`` is this process's ``CUDA_VISIBLE_DEVICES`` (as :func:`child_env` takes it;
    ``None``: all GPUs), except in a process whose parent activated the same GPUs and gave it a
    ``CUDA_VISIBLE_DEVICES`` of its own: with ``visible=None`` that one is kept. A
    ``multiprocessing`` child started with ``spawn`` runs the top of its parent's script again,
    ``activate`` included, and must still see what its parent gave it.

    Raises:
        SimulatedDriverError: a real driver is loaded or present (see :func:`child_env`), or CUDA
            has started here on other simulated GPUs (a process's GPUs are fixed from then on:
            run the others in another process, e.g. with :func:`child_env`).
        TypeError, ValueError: ``gpus`` or ``visible`` is malformed (see :class:`SimulatedGPU`).
    """
    env = child_env(gpus, visible, allow_real_driver=allow_real_driver)
    active = os.environ.get(SPEC_ENV)
    if active and active != env[SPEC_ENV] and _initialized():
        raise SimulatedDriverError(
            f"CUDA has started in this process on {active.count(';') + 1} other simulated "
            f"GPU(s) ({active.split('|', 1)[0]}, ...), and a process's GPUs are fixed from then "
            "on: activate before anything uses CUDA, or run the other GPUs in another process "
            "(child_env(gpus) is its environment)"
        )
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    # kept only when a parent chose it: not one an earlier activate() in this process set
    given = (
        visible is None
        and active == env[SPEC_ENV]
        and cvd is not None
        and _set_here.get("CUDA_VISIBLE_DEVICES", _NOT_SET) != cvd
    )
    for key in ("LD_LIBRARY_PATH", SPEC_ENV):
        os.environ[key] = env[key]
    if given:
        pass  # the parent that activated these GPUs chose this process's
    elif "CUDA_VISIBLE_DEVICES" in env:
        os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    else:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    _set_here["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", _NOT_SET)
    folder = env["LD_LIBRARY_PATH"].split(":")[0]
    for name in _LIBRARIES:
        ctypes.CDLL(os.path.join(folder, name), mode=os.RTLD_GLOBAL)
    if not _initialized():  # an answer taken before (no driver then) would stand for good
        from gpu_serde import inventory

        inventory.forget_before_cuda()


_NOT_SET = "\0unset"  # not a value an environment variable can hold
_set_here: dict[str, str] = {}  # what activate() in this process last set (or _NOT_SET)


def _initialized() -> bool:
    """Whether the simulated driver is loaded here and CUDA has started on it (``cuInit``)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        return bool(lib.gpu_serde_sim_initialized())
    except (OSError, AttributeError):
        return False


def violations() -> int:
    """How many times this process, as an exporter, freed pool memory that a live importer in
    another process still held (CUDA: importers free first). The stand-in also says so on stderr
    each time (``GPU_SERDE_SIM_STRICT=1`` aborts the process instead).

    Raises:
        SimulatedDriverError: the stand-in driver is not loaded in this process.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
        count = lib.gpu_serde_sim_violations
    except (OSError, AttributeError):
        raise SimulatedDriverError("the simulated driver is not loaded in this process") from None
    count.restype = ctypes.c_long
    return int(count())


def sent_tensor(t: Any, gpu: SimulatedGPU, *, host: str = "gpu-worker") -> bytes:
    """The pickle that a CUDA torch tensor laid out like ``t`` makes when a process on host
    ``host`` sends it by value from the GPU ``gpu`` (gpu_serde installed there): ``t`` is a CPU
    tensor or ``nn.Parameter`` here, whose dtype, shape, strides, storage offset,
    ``requires_grad`` and bytes it carries. What your receiving code gets from a GPU worker, for
    testing that code on a machine without one: ``pickle.loads`` of it, where torch has no CUDA
    (or does not see that GPU), is a placeholder that raises ``DeviceNotVisibleError`` when used,
    and ``gpu_serde.tensors.place(x, "cpu")`` gives a tensor with those bytes. The sending
    process it describes is made up: messages about the tensor name ``host``, this process's own
    pid and CUDA device 0 as where it was sent from, whichever GPU ``gpu`` is.

    Raises:
        TypeError: ``t`` is not a dense CPU ``torch.Tensor`` or ``nn.Parameter`` without Python
            attributes of its own, ``gpu`` is not a :class:`SimulatedGPU`, or ``host`` is not
            printable text.
    """
    import pickle

    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        raise TypeError(f"sent_tensor(t=...): a CPU torch.Tensor, not {type(t).__name__}")
    if not isinstance(gpu, SimulatedGPU):
        raise TypeError(f"sent_tensor(gpu=...): a SimulatedGPU, not {type(gpu).__name__}")
    from gpu_serde import wire
    from gpu_serde.format.device import encode_device
    from gpu_serde.tensors import torch as reducers
    from gpu_serde.tensors.common import Carried

    if t.device.type != "cpu" or type(t) not in reducers._KINDS or getattr(t, "__dict__", None):
        raise TypeError(
            "sent_tensor(t=...): a dense CPU torch.Tensor or nn.Parameter without attributes of "
            f"its own, not a {type(t).__name__} on {t.device} (its layout and bytes are what "
            "is sent)"
        )
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise TypeError("sent_tensor(t=...): a dense (strided) tensor")
    if not isinstance(host, str) or not host or not host.isprintable():
        raise TypeError(f"sent_tensor(host=...): a host name (printable text), not {host!r:.40}")
    raw = uuid_bytes(gpu.uuid)
    device = encode_device(raw, gpu.uuid.startswith("MIG-"), 0, os.getpid(), host, gpu.name)
    p = reducers.value_payload(t, device)  # the sender's own reducer's payload
    payload = p._replace(data=Carried(p.data)).wire()
    return pickle.dumps(_Sent(wire.tval, payload))


class _Sent:
    """Pickles as ``rebuild(payload)``: what a sender's reducer puts on the wire."""

    def __init__(self, rebuild: Any, payload: Any) -> None:
        self.rebuild, self.payload = rebuild, payload

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.rebuild, (self.payload,))


def is_driver_dir(path: str) -> bool:
    """True for a folder the stand-in driver is built into (:func:`driver_dir`'s form): what
    ``gpu-serde simulate --off`` takes off ``LD_LIBRARY_PATH``."""
    return bool(path) and os.path.basename(path.rstrip("/")).startswith(DRIVER_DIR_PREFIX)


def _check_children_have_a_driver(what: str) -> None:
    """Refuse to lay out a cluster whose processes (which inherit this one's environment) would
    find no CUDA driver: neither simulated GPUs active here nor a real driver.

    Raises:
        SimulatedDriverError: neither.
    """
    if os.environ.get(SPEC_ENV) and any(
        is_driver_dir(d) and os.path.exists(os.path.join(d, "libcuda.so.1"))
        for d in os.environ.get("LD_LIBRARY_PATH", "").split(":")
    ):
        return  # simulated GPUs, and their driver on the path children load from
    if real_driver_present():
        return
    raise SimulatedDriverError(
        f"{what}: its processes would find no CUDA driver: this machine has none, and no "
        "simulated GPUs are active in this process. Activate them before laying out the "
        "cluster: the simulated_gpus pytest fixture, or gpu_serde.testing.activate(make_gpus(4)) "
        "(docs/testing.md)"
    )


def _worker_env(name: str, cvd: str, hosts: Mapping[str, str] | None) -> dict[str, str]:
    env = {"CUDA_VISIBLE_DEVICES": cvd}
    if hosts and name in hosts:
        env[HOST_ENV] = hosts[name]
    return env


def spec_cluster_options(
    layout: Mapping[str, str],
    *,
    nthreads: int = 1,
    host: str = "127.0.0.1",
    hosts: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``distributed.SpecCluster``: one ``Nanny`` worker per entry of
    ``layout`` (worker name -> its ``CUDA_VISIBLE_DEVICES``), and a scheduler, all on ``host``
    (loopback by default), the dashboard on a free port of ``host``. Workers that see the GPUs
    in different orders are what gpu_serde is tested with.

    ``hosts`` (worker name -> a host label) puts workers on other "hosts" on this one machine:
    each named worker gets ``GPU_SERDE_HOST_ID=<label>`` (:mod:`gpu_serde.hostid`), so GPU memory
    reaches it as it would reach another machine (by value, not mapped).

    Raises:
        ImportError: distributed is not installed (gpu_serde's ``dask`` extra).
        SimulatedDriverError: this machine has no CUDA driver and no simulated GPUs are active
            in this process (the workers would find none).
        TypeError, ValueError: ``layout`` is not a non-empty dict of worker names to
            ``CUDA_VISIBLE_DEVICES`` (a string, an ordinal, or a list of UUIDs and ordinals),
            an entry names a GPU the worker would not see (``""`` is a worker with none),
            ``nthreads`` is not a positive int, ``host`` is not a str, or ``hosts`` names a
            worker the layout does not have or gives a label that is not a host label.
    """
    from distributed import Nanny, Scheduler  # only for those who start a Dask cluster

    if not isinstance(layout, Mapping):
        raise TypeError(
            "spec_cluster_options(layout=...): a dict of worker name -> its CUDA_VISIBLE_DEVICES, "
            f"not {type(layout).__name__}"
        )
    if not layout:
        raise ValueError("spec_cluster_options(layout=...): no workers (the dict is empty)")
    if not isinstance(nthreads, int) or isinstance(nthreads, bool):
        raise TypeError(
            f"spec_cluster_options(nthreads=...): an int, not {type(nthreads).__name__}"
        )
    if not isinstance(host, str) or not host:
        raise TypeError(
            "spec_cluster_options(host=...): the address to bind, a str such as '127.0.0.1', "
            f"not {type(host).__name__ if not isinstance(host, str) else 'an empty one'}"
        )
    if nthreads < 1:
        raise ValueError(f"spec_cluster_options(nthreads=...): 1 or more, not {nthreads}")
    visible: dict[str, str] = {}
    for name, cvd in layout.items():
        value = _visible_value(cvd, f"spec_cluster_options(layout[{name!r}])")
        if value is None:
            raise TypeError(
                f"spec_cluster_options(layout[{name!r}]): the worker's CUDA_VISIBLE_DEVICES "
                '("" for no GPU), not None'
            )
        visible[name] = value
    if hosts is not None and not isinstance(hosts, Mapping):
        raise TypeError(
            "spec_cluster_options(hosts=...): a dict of worker name -> host label, not "
            f"{type(hosts).__name__}"
        )
    for name, label in (hosts or {}).items():
        if name not in layout:
            raise ValueError(
                f"spec_cluster_options(hosts=...): {name!r} is not a worker of the layout "
                f"({', '.join(map(repr, layout))})"
            )
        _host_label(label, f"spec_cluster_options(hosts[{name!r}])")
    _check_children_have_a_driver("spec_cluster_options")
    for name, value in visible.items():
        _check_selects(value, f"spec_cluster_options(layout[{name!r}])", "the layout")
    workers = {
        name: {
            "cls": Nanny,
            "options": {"nthreads": nthreads, "host": host, "env": _worker_env(name, cvd, hosts)},
        }
        for name, cvd in visible.items()
    }
    # the dashboard on the scheduler's host too (distributed binds ":0" on every interface)
    dashboard = f"[{host}]:0" if ":" in host else f"{host}:0"
    scheduler = {"cls": Scheduler, "options": {"host": host, "dashboard_address": dashboard}}
    return {"workers": workers, "scheduler": scheduler}


def _host_label(label: object, where: str) -> None:
    """Check ``label`` as a ``GPU_SERDE_HOST_ID`` value given to ``where``.

    Raises:
        ValueError: it is not a host label.
    """
    try:
        label_identity(label)  # type: ignore[arg-type]  # it checks the type too
    except ValueError:
        raise ValueError(
            f"{where}: {quoted(label)} is not a host label (GPU_SERDE_HOST_ID): use 1 to 64 "
            "characters of A-Z a-z 0-9 . _ : -"
        ) from None


def ray_node_options(
    visible: str | int | Iterable[str | int], *, host: str | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``ray.cluster_utils.Cluster().add_node(...)``: a node whose processes
    see the GPUs ``visible`` (its ``CUDA_VISIBLE_DEVICES``: a string, one ordinal, or
    UUIDs/ordinals to join with commas) and whose ``GPU`` resource counts them, so that
    ``num_gpus`` tasks run there.

    Ray binds a node to this machine's outward-facing address unless
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` was set before Ray was imported (then to 127.0.0.1):
    simulated GPUs are this machine's alone, so this warns (:class:`RayAddressWarning`) when it
    is not set. Set it at the top of your ``conftest.py``.

    ``add_node(env_vars={"CUDA_VISIBLE_DEVICES": ...})`` alone gives the node no ``GPU`` resource:
    Ray counts a node's GPUs in the process that adds it, not from ``env_vars``. ``host`` gives
    the node's processes another host identity (``GPU_SERDE_HOST_ID``, :mod:`gpu_serde.hostid`).
    Merge your own options in: ``add_node(num_cpus=2, **ray_node_options(...))``.

    Raises:
        TypeError: ``visible`` is neither a string, an ordinal, nor a list of UUIDs and
            ordinals.
        ValueError: ``host`` is not a host label, or ``visible`` names a GPU the node's
            processes would not see (an ordinal out of range, a UUID of no GPU here: CUDA
            stops at the first such entry), so that its GPU resource would count GPUs it does
            not have (``""`` is a node with none).
        SimulatedDriverError: this machine has no CUDA driver and no simulated GPUs are active
            in this process (the node's processes would find none).
    """
    value = _visible_value(visible, "ray_node_options(visible=...)")
    if host is not None:
        _host_label(host, "ray_node_options(host=...)")
    if value is None:
        raise TypeError("ray_node_options(visible=...): the node's CUDA_VISIBLE_DEVICES, not None")
    _check_children_have_a_driver("ray_node_options")
    if _ray_binds_outward():
        warnings.warn(
            RayAddressWarning(
                f"{RAY_LOOPBACK_ENV} is not 0 here: a Ray cluster started in this process binds "
                "this machine's outward-facing address, not 127.0.0.1. Set "
                f"os.environ['{RAY_LOOPBACK_ENV}'] = '0' before importing Ray (at the top of "
                "conftest.py) to keep it on loopback (docs/testing.md)"
            ),
            stacklevel=2,
        )
    seen = _check_selects(value, "ray_node_options(visible=...)", "its GPU resource")
    env = {"CUDA_VISIBLE_DEVICES": value}
    if host is not None:
        env[HOST_ENV] = host
    return {"num_gpus": seen, "env_vars": env}


def _check_selects(value: str, where: str, counted: str) -> int:
    """How many GPUs ``CUDA_VISIBLE_DEVICES=value`` shows this machine's processes: every entry
    it names, or refused.

    Raises:
        ValueError: it shows fewer (an ordinal out of range, a UUID of no GPU here: CUDA stops at
            the first such entry); ``counted`` says what would have counted them.
        SimulatedDriverError: a child could not count.
    """
    entries = [e for e in value.split(",") if e.strip()]
    seen = _gpus_seen_with(value) if entries else 0
    if seen != len(entries):
        raise ValueError(
            f"{where}: CUDA_VISIBLE_DEVICES={quoted(value)} makes this machine's processes see "
            f"{seen} GPU(s), not the {len(entries)} it names (CUDA stops at the first entry that "
            "is not an ordinal or a UUID of one of this machine's GPUs, and "
            f"{counted} would count {len(entries)}): list ordinals below "
            f'{_gpus_seen_with(None)} or UUIDs of this machine\'s GPUs ("" for none)'
        )
    return seen


_COUNT_GPUS = (
    "import ctypes\n"
    "lib = ctypes.CDLL('libcuda.so.1')\n"
    "n = ctypes.c_int(0)\n"
    "rc = lib.cuInit(0) or lib.cuDeviceGetCount(ctypes.byref(n))\n"
    "print(n.value if rc == 0 else 0)\n"
)


def _gpus_seen_with(value: str | None) -> int:
    """How many GPUs a process started from this one sees with ``CUDA_VISIBLE_DEVICES=value``
    (``None``: unset): asked of a child, which loads the driver children load (simulated GPUs
    when they are active here)."""
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if value is not None:
        env["CUDA_VISIBLE_DEVICES"] = value
    try:
        got = subprocess.run(
            [sys.executable, "-c", _COUNT_GPUS],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        raise SimulatedDriverError(
            "a child process did not count its GPUs within 120 s (the driver hung)"
        ) from None
    if got.returncode != 0:
        raise SimulatedDriverError(
            f"a child process could not count its GPUs (exit {got.returncode}): "
            f"{quoted(got.stderr.strip()[-300:])}"
        )
    return int(got.stdout.strip() or 0)
