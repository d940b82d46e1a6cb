"""``gpu-serde doctor``: what each process of a running Ray or Dask cluster sees, and what is wrong.

For each worker (and the Dask scheduler): host, pid, ``CUDA_VISIBLE_DEVICES``, its GPU map
(ordinal, UUID) and whether gpu_serde is set up there. Flags processes without gpu_serde, GPUs
that more than one worker (Dask) or node (Ray) claims, and fewer workers than expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gpu_serde
from gpu_serde.inventory import inventory, uuid_of
from gpu_serde.netcheck import failure, refused_for
from gpu_serde.registry import is_installed
from gpu_serde.routing import ownership_notes
from gpu_serde.text import quoted, safe

#: Seconds a Ray node's probe may take (it may start a worker process first).
PROBE_S = 120.0


class AddressError(ValueError):
    """The address given to the doctor is not one of a cluster (malformed)."""


@dataclass
class WorkerReport:
    """What one process said about itself.

    ``role`` is ``"worker"``, ``"scheduler"`` or ``"client"`` (the doctor's own process).
    """

    name: str
    host: str
    pid: int
    cuda_visible_devices: str | None
    gpus: list[tuple[int, str]]
    reason: str
    installed: bool
    version: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    role: str = "worker"


@dataclass
class Survey:
    """The doctor's findings: every process's report and the cluster-wide problems."""

    engine: str
    address: str
    reports: list[WorkerReport]
    expected: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def workers(self) -> list[WorkerReport]:
        """The reports of worker processes (not the scheduler or the client)."""
        return [r for r in self.reports if r.role == "worker"]

    @property
    def ok(self) -> bool:
        """True when at least one worker answered and nothing was flagged."""
        return (
            bool(self.workers) and not self.problems and not any(r.problems for r in self.reports)
        )

    def to_json(self) -> dict[str, Any]:
        """The survey as plain JSON data (what ``gpu-serde doctor --json`` prints)."""
        return {
            "engine": self.engine,
            "address": self.address,
            "expected": self.expected,
            "ok": self.ok,
            "problems": list(self.problems),
            "processes": [asdict(r) for r in self.reports],
        }


def probe() -> dict[str, Any]:
    """Runs on a worker: this process's view (never initialises CUDA before the engine assigns
    GPUs, since it runs as a task)."""
    inv = inventory()
    return {
        "host": inv.host,
        "pid": os.getpid(),
        "cvd": inv.cuda_visible_devices,
        "gpus": [(d.ordinal, d.uuid) for d in inv.devices],
        "reason": inv.reason,
        "installed": is_installed(),
        "version": gpu_serde.__version__,
    }


def locate(device: Any) -> tuple[int, str]:
    """Runs on a worker: the local ordinal and canonical UUID of a received Device.

    Raises:
        DeviceNotVisibleError: the Device's GPU is not visible in this worker.
    """
    d = gpu_serde.resolve(device)
    return d.device_id, uuid_of(d.device_id)


def _report(name: str, raw: dict[str, Any] | BaseException, role: str = "worker") -> WorkerReport:
    if isinstance(raw, BaseException):
        return WorkerReport(
            name, "?", 0, None, [], "", False, "", [f"probe failed: {raw!r}"], role=role
        )
    r = WorkerReport(
        name,
        raw["host"],
        raw["pid"],
        raw["cvd"],
        [(int(o), str(u)) for o, u in raw["gpus"]],
        raw["reason"],
        raw["installed"],
        raw["version"],
        role=role,
    )
    if not r.installed and role != "client":
        r.problems.append(
            f"gpu_serde is not set up in this {role} (the package may be there; "
            "gpu_serde.install() has not run): Devices leave it by ordinal"
        )
    return r


def _flag_shared(reports: list[WorkerReport], what: str, *, primary_only: bool) -> None:
    """Flag GPUs claimed twice: any GPU of a Ray node, or a Dask worker's device 0 (dask-cuda
    workers see every GPU, rotated, and each computes on its own device 0)."""
    owners: dict[str, list[str]] = defaultdict(list)
    for r in reports:
        for _, uuid in r.gpus[:1] if primary_only else r.gpus:
            owners[uuid].append(r.name)
    for r in reports:
        for _, uuid in r.gpus[:1] if primary_only else r.gpus:
            if len(owners[uuid]) > 1:
                others = ", ".join(n for n in owners[uuid] if n != r.name)
                role = f"device 0 of {what}" if primary_only else "seen by"
                r.problems.append(f"{uuid} is also {role} {others}")


def _this_process() -> WorkerReport:
    """The calling process, as a client of the cluster (reported, never flagged: the doctor's
    own process is not the user's client or driver)."""
    return _report("this process (the doctor's client)", probe(), role="client")


def _count_problem(survey: Survey, what: str) -> None:
    n = len(survey.workers)
    if n == 0:
        survey.problems.append(f"no {what} answered: has any joined yet? (--expect N waits)")
    elif n < survey.expected:
        survey.problems.append(f"only {n} of {survey.expected} expected {what}(s) answered")


def survey_dask(address: str, timeout: float = 30, expect: int = 0) -> Survey:
    """Probe the scheduler and every worker of the Dask scheduler at ``address``, after waiting
    up to ``timeout`` seconds for ``expect`` workers to join.

    Raises:
        OSError: the scheduler cannot be reached within ``timeout``.
        AddressError: ``address`` is not a scheduler's address the doctor can connect to
            (empty, a port that is not 1 to 65535, TLS, ``inproc://``, a Ray address, or one
            distributed cannot parse or has no support for here).
    """
    from distributed import Client  # the dask extra, optional: doctor --ray needs only Ray

    kind = _check_dask_address(address)
    left = _check_refused(address, timeout)
    try:
        connected = Client(address, timeout=left)
    except ValueError as exc:  # "missing port number in address ...", an unknown protocol
        raise AddressError(safe(str(exc))) from None
    except (TypeError, ImportError) as exc:  # ucx:// without UCX support installed here
        fix = (
            ": install its support here (distributed-ucxx), or check through a tcp:// listener "
            "of the scheduler"
            if kind == "ucx"
            else ""
        )
        raise AddressError(
            f"distributed here cannot connect over {quoted(kind)} "
            f"({type(exc).__name__}: {safe(str(exc))}){fix}"
        ) from None
    with connected as client:
        if expect:
            # reported below: fewer workers than expected (on Python 3.10, asyncio's TimeoutError
            # is not the builtin one)
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                client.wait_for_workers(expect, timeout=timeout)
        names = {
            a: w.get("name", a) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
        }
        raw = client.run(probe, on_error="return")
        try:
            scheduler = _report("scheduler", client.run_on_scheduler(probe), role="scheduler")
        except Exception as exc:  # a scheduler that cannot run the probe is itself a finding
            scheduler = _report("scheduler", exc, role="scheduler")
    workers = [_report(f"{names.get(a, a)} ({a})", result) for a, result in sorted(raw.items())]
    _flag_shared(workers, "worker", primary_only=True)
    for r in workers:
        r.notes += ownership_notes(r.gpus, "dask") if r.installed else []
    survey = Survey("dask", address, [scheduler, *workers, _this_process()], expect)
    _count_problem(survey, "worker")
    return survey


def _alive_nodes(ray: Any, expect: int, timeout: float) -> list[dict[str, Any]]:
    """The cluster's alive nodes, once ``expect`` are (or at ``timeout``): the head first, then
    by address and id, so that a report lists them in the same order every time."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        if len(nodes) >= expect or time.monotonic() >= deadline:
            return sorted(nodes, key=_node_order)
        time.sleep(0.5)


def _node_order(node: dict[str, Any]) -> tuple[bool, int, str, str]:
    head = "node:__internal_head__" in node.get("Resources", {})
    address = str(node.get("NodeManagerAddress", ""))
    try:  # 127.0.0.9 before 127.0.0.10; names after addresses
        key = (0, f"{int(ipaddress.ip_address(address)):040d}")
    except ValueError:
        key = (1, address)
    return (not head, *key, str(node.get("NodeID", "")))


#: Ray's token authentication (Ray 2.60): the mode, and where a client reads its token.
AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


def ray_token_source(env: dict[str, str] | None = None) -> str | None:
    """Where a Ray client in this environment reads its authentication token (``RAY_AUTH_TOKEN``,
    the file ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token``), or None when it has none."""
    env = dict(os.environ if env is None else env)
    if env.get(AUTH_TOKEN):
        return AUTH_TOKEN
    path = env.get(AUTH_TOKEN_PATH)
    if path:
        return path if os.path.isfile(path) else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def _use_ray_token() -> str | None:
    """Turn Ray's token authentication on for this process when the user left ``RAY_AUTH_MODE``
    unset and a token is at hand, as ``ray start --head`` does for the cluster; return where the
    token comes from. Ray's ``ray.init(address=...)`` never does this by itself, so without it a
    plain ``ray start --head`` (token authentication on) refuses the doctor. A cluster without
    authentication accepts such a client as well. Ray reads the mode when it is imported: this
    runs before ``import ray``."""
    source = ray_token_source()
    if source and AUTH_MODE not in os.environ and "ray" not in sys.modules:
        os.environ[AUTH_MODE] = "token"
    return source


def _check_ray_address(address: str) -> None:
    """Refuse what is no Ray address at once (Ray itself would wait on it for minutes).

    Raises:
        AddressError: empty, with control characters, ``local`` (a new cluster), a Dask
            scheduler's ``tcp://`` address, the dashboard's ``http://``, or a ``host:port``
            whose port is not 1 to 65535.
    """
    _check_text(address)
    if address.strip().lower() == "local":
        raise AddressError(
            "'local' starts a new Ray cluster in the doctor's own process, not the one to check: "
            "--ray takes the head's host:port (its GCS, port 6379 unless --port said otherwise), "
            "or 'auto' on a node of the cluster"
        )
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() in ("tcp", "tls", "ucx", "inproc", "ws", "wss"):
        raise AddressError(
            f"{scheme}:// is how a Dask scheduler's address begins: use --scheduler for Dask; "
            "--ray takes a Ray head's host:port (its GCS, port 6379 unless --port said otherwise)"
        )
    if sep and scheme.lower() in ("http", "https"):
        raise AddressError(
            f"{scheme}:// is the Ray dashboard's address (its Jobs API), not the cluster's: "
            "--ray takes the head's host:port (its GCS, port 6379 unless --port said "
            "otherwise), as `ray start --head` prints it"
        )
    if sep and scheme.lower() != "ray":
        return  # another scheme (a client builder's module): Ray's own lookup
    _check_port(rest if sep else address)


def _check_text(address: str) -> None:
    """Refuse an empty address, or one with whitespace or control characters in it.

    Raises:
        AddressError: it is so.
    """
    if not address.strip():
        raise AddressError("the address is empty")
    if any(c.isspace() or not c.isprintable() for c in address):
        raise AddressError("an address has no spaces, line breaks or control characters")


def _check_port(host_port: str) -> None:
    """Refuse a ``host:port`` (no scheme) whose port is not 1 to 65535 or that has no host.

    Raises:
        AddressError: it is so.
    """
    text = host_port.rstrip("/")
    if text.startswith("["):  # an IPv6 address: [host] or [host]:port
        inside, bracket, after = text[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise AddressError("an IPv6 address is written [host]:port")
        host, sep, port = inside, after[:1], after[1:]
    else:
        host, sep, port = text.rpartition(":")
    if sep and not (port.isascii() and port.isdecimal() and 1 <= int(port) <= 65535):
        raise AddressError(f"the port must be a number from 1 to 65535, not {quoted(port)}")
    if sep and not host.strip("[]"):
        raise AddressError("no host before the port")


def _check_dask_address(address: str) -> str:
    """Refuse at once what the doctor cannot connect to as a Dask scheduler (distributed would
    time out, or fail with an error about its own classes); return its scheme, lower case
    (``tcp`` where it names none).

    Raises:
        AddressError: an empty address, control characters, a port that is not 1 to 65535, a
            TLS address (the doctor takes no security settings), a Ray address.
    """
    _check_text(address)
    scheme, sep, rest = address.partition("://")
    kind = scheme.lower() if sep else "tcp"
    if kind in ("tls", "wss"):
        raise AddressError(
            f"{scheme}:// needs TLS settings (certificates), which the doctor does not take: "
            "check through a tcp:// listener of the scheduler"
        )
    if kind == "inproc":
        raise AddressError(
            "inproc:// is a scheduler inside one process, which no other process can reach: "
            "check a scheduler that listens on tcp://"
        )
    if kind in ("ray", "http", "https"):
        raise AddressError(
            f"{scheme}:// is not a Dask scheduler's address: --scheduler takes tcp://host:port "
            "(port 8786 by default), --ray a Ray head's host:port"
        )
    if kind in ("tcp", "ucx", "ws"):
        _check_port(rest if sep else address)
    return kind


def _check_refused(address: str, timeout: float) -> float:
    """Wait up to ``timeout`` for a Dask scheduler's ``tcp://host:port`` to accept a connection
    (one still starting), and say so plainly if it refused all along (distributed's client would
    time out without saying why); any other answer, or none, is left to the client. Returns the
    seconds left of ``timeout``.

    Raises:
        ConnectionError: the connection was refused for all of ``timeout``.
    """
    start = time.monotonic()
    why = refused_for(address, timeout)
    if why is not None:
        raise ConnectionError(
            f"nothing answered there within {timeout:g} s ({why}): is the scheduler running? "
            "`dask scheduler` prints its address (tcp://host:port, port 8786 by default)"
        )
    return max(1.0, timeout - (time.monotonic() - start))


def _check_listening(address: str, timeout: float) -> None:
    """Fail at once when nothing listens at a ``host:port`` address (Ray itself would retry for
    two minutes).

    Raises:
        AddressError: as :func:`_check_ray_address`.
        ConnectionError: nothing listens there.
    """
    _check_ray_address(address)
    exc = failure(address, timeout)  # None too for "auto", "ray://...": Ray's own lookup
    if exc is not None:
        raise ConnectionError(
            f"nothing answers there ({exc.strerror or exc}): is the cluster running? "
            "`ray start --head` prints its address (host:port of the GCS, port 6379 unless "
            "--port says otherwise)"
        )


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Send this process's file descriptor 2 (where Ray's C++ core logs) to ``path`` for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _why_ray_refused(exc: BaseException, said: str, source: str | None) -> str:
    """Why connecting to a Ray cluster failed (``said``: what Ray logged), and what to do."""
    get = (
        "run `ray get-auth-token` on the cluster's head node and put what it prints in "
        "~/.ray/auth_token here (or in RAY_AUTH_TOKEN), then run the doctor again"
    )
    mode = os.environ.get(AUTH_MODE, "")
    if "InvalidAuthToken" in said or "Unauthenticated" in said:
        if mode.lower() == "disabled":
            return (
                "the cluster uses Ray's token authentication, and RAY_AUTH_MODE=disabled here "
                "sends no token: unset RAY_AUTH_MODE (the doctor then uses the token it finds), "
                "or set it to token"
            )
        if source is None:
            return (
                "the cluster uses Ray's token authentication (Ray 2.60's `ray start --head` turns "
                f"it on when the head has a token), and this process has no token: {get}"
            )
        return f"the cluster refused the Ray token from {source}: it is not the cluster's: {get}"
    if type(exc).__name__ == "AuthenticationError":
        return f"Ray's token authentication is on here ({AUTH_MODE}=token) but no token: {get}"
    lines = [x.strip() for x in said.splitlines() if " E " in x or " W " in x]
    last = f"; Ray said: {lines[-1].split('] ', 1)[-1]}" if lines else ""
    return f"Ray could not connect: {exc}{last}"


def _connect_ray(address: str, extra: dict[str, Any], timeout: float, source: str | None) -> None:
    """``gpu_serde.ray.init`` to the cluster at ``address``, quietly; a failure says why
    (``source``: where this process's Ray token comes from, :func:`ray_token_source`).

    Raises:
        ConnectionError: nothing listens there, or Ray refused (token authentication: what to
            do), or could not connect (what Ray said).
        AddressError: ``address`` is no Ray address (:func:`_check_ray_address`).
    """
    _check_listening(address, timeout)
    import gpu_serde.ray  # Ray, an optional extra, only now: after the token mode is set

    with tempfile.TemporaryDirectory(prefix="gpu-serde-doctor-") as tmp:
        log = os.path.join(tmp, "ray.log")
        failure: BaseException | None = None
        with _stderr_to(log):
            try:
                gpu_serde.ray.init(address=address, log_to_driver=False, **extra)
            except Exception as exc:  # what Ray raises varies: ConnectionError, AuthenticationError
                failure = exc
        if failure is not None:
            said = Path(log).read_text(errors="replace")
            raise ConnectionError(_why_ray_refused(failure, said, source)) from failure


def survey_ray(
    address: str, node_ip_address: str | None = None, timeout: float = 120, expect: int = 0
) -> Survey:
    """Probe one worker on every alive node of the Ray cluster at ``address`` (head included),
    after waiting up to ``timeout`` seconds for ``expect`` nodes (each probe then gets
    :data:`PROBE_S` seconds), in a job started with
    gpu_serde's hook; a node where the hook did not run is flagged. ``node_ip_address`` is this
    machine's address as the cluster knows it (Ray's ``_node_ip_address``), where Ray cannot
    tell by itself (a cluster on a loopback address other than 127.0.0.1).

    Ray's token authentication: with ``RAY_AUTH_MODE`` unset and a token at hand
    (:func:`ray_token_source`), the doctor connects with it, as ``ray start --head`` does.

    Raises:
        ConnectionError: no Ray cluster answers at ``address``, or it refused this process (the
            message says why and what to do).
        AddressError: ``address`` is no Ray address (a Dask scheduler's ``tcp://``, a port that
            is not 1 to 65535).
    """
    me = _this_process()
    source = _use_ray_token()  # before Ray is imported: it reads the mode then
    import ray  # an optional extra, and only once the token mode is set
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connected = ray.is_initialized()  # called from a driver: survey its own cluster
    if not connected:
        extra = {"_node_ip_address": node_ip_address} if node_ip_address else {}
        try:
            _connect_ray(address, extra, timeout, source)
        except ConnectionError:
            if not me.installed:
                gpu_serde.uninstall()  # gpu_serde.ray.init installed it before Ray refused
            raise

    try:
        task = ray.remote(max_retries=0)(probe)
        refs = {}
        for node in _alive_nodes(ray, expect, timeout):
            gpus = int(node.get("Resources", {}).get("GPU", 0))
            where = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            name = f"node {node['NodeID'][:12]} ({node.get('NodeManagerAddress')}, {gpus} GPU)"
            ref = task.options(num_gpus=gpus, num_cpus=0, scheduling_strategy=where).remote()
            refs[name] = (ref, gpus)
        reports = []
        owning = []
        for name, (ref, gpus) in refs.items():
            try:
                r = _report(name, ray.get(ref, timeout=PROBE_S))
            except Exception as exc:  # a node that cannot run the probe is itself a finding
                r = _report(name, exc)
            reports.append(r)
            if gpus:
                owning.append(r)
                if r.cuda_visible_devices is not None:
                    r.notes.append(
                        "CUDA_VISIBLE_DEVICES is the probe task's (it was given all the "
                        "node's GPUs): unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is "
                        "set there, Ray sets it for each task, in an order that may change from "
                        "task to task"
                    )
            elif r.gpus:
                r.notes.append(
                    f"Ray gives this node no GPU, yet its tasks see {len(r.gpus)} "
                    "(num_gpus=0 tasks are not masked)"
                )
    finally:
        if not connected:
            ray.shutdown()
            if not me.installed:
                gpu_serde.uninstall()
    for r in reports:
        if not r.installed and r.host != "?":
            r.problems[:] = [
                "gpu_serde's worker hook did not run here (is gpu_serde installed on this node?)"
            ]
    _flag_shared(owning, "node", primary_only=False)
    for r in owning:
        r.notes += ownership_notes(r.gpus, "ray")
    survey = Survey("ray", address, [*reports, me], expect)
    _count_problem(survey, "node")
    return survey


def render(survey: Survey) -> str:
    """The doctor's text: one block per process, problems marked ``!``, a summary line. What the
    workers reported (names, hosts, reasons, notes) is escaped: one line per fact."""
    lines = []
    for r in survey.reports:
        cvd = "unset" if r.cuda_visible_devices is None else quoted(r.cuda_visible_devices)
        if r.role == "client":  # the caller: the doctor's own process, or a driver that asked
            state = f"gpu_serde {safe(r.version)}" + (
                ", set up (sends Devices by UUID)"
                if r.installed
                else " (not set up: this process sends no Device; only its peers must)"
            )
        else:
            installed = f"gpu_serde {safe(r.version)} set up"
            state = installed if r.installed else "gpu_serde NOT set up"
        lines.append(
            f"{safe(r.name)}: host {safe(r.host)}, pid {safe(r.pid)}, "
            f"CUDA_VISIBLE_DEVICES={cvd}, {state}"
        )
        lines += [f"    {safe(o)}  {safe(u)}" for o, u in r.gpus] or [
            f"    no GPU: {safe(r.reason)}"
        ]
        lines += [f"  - {safe(n)}" for n in r.notes]
        lines += [f"  ! {safe(p)}" for p in r.problems]
    lines += [f"! {safe(p)}" for p in survey.problems]
    bad = sum(bool(r.problems) for r in survey.reports)
    verdict = "OK" if survey.ok else "PROBLEMS"
    lines.append(f"{len(survey.workers)} worker(s), {bad} process(es) with problems: {verdict}")
    return "\n".join(lines)
