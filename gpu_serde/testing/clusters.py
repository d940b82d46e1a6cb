"""Ray and Dask clusters started with the engines' own CLIs on loopback, always torn down.

Ray's nodes use the loopback address 127.0.0.2 (``ray start`` replaces 127.0.0.1 with the host's
outward address, but leaves other loopback addresses alone). Every process a cluster starts is
killed on exit, also on failure: the launchers' process groups, then any process whose command
line names the cluster's private temp folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

try:
    import psutil
except ImportError as exc:  # pragma: no cover - depends on the extras installed
    raise ImportError(
        "gpu_serde.testing.clusters needs psutil: pip install 'psutil>=5.9' "
        "(gpu_serde's [testing] extra)"
    ) from exc

__all__ = ["RAY_IP", "Processes", "cli", "dask_cli_cluster", "free_port", "ray_cli_cluster"]

#: The loopback address Ray's nodes use (``ray start`` keeps it; it would replace 127.0.0.1).
RAY_IP = "127.0.0.2"
BIN = os.path.dirname(sys.executable)


def cli(name: str) -> str:
    """The engine's command: beside this Python, else on PATH."""
    here = os.path.join(BIN, name)
    return here if os.path.exists(here) else (shutil.which(name) or name)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _layout(layout: object, where: str, *, unset: bool) -> dict[str, str | None]:
    """``layout`` (name -> ``CUDA_VISIBLE_DEVICES``: a string, one ordinal, or UUIDs and
    ordinals; ``None`` only where ``unset``) checked before anything starts.

    Raises:
        TypeError: it is not a non-empty dict of str names to such values.
        ValueError: it is empty.
    """
    from gpu_serde.testing import _visible_value

    if not isinstance(layout, Mapping):
        raise TypeError(
            f"{where}: a dict of name -> its CUDA_VISIBLE_DEVICES, not {type(layout).__name__}"
        )
    if not layout:
        raise ValueError(f"{where}: nothing to start (the dict is empty)")
    checked: dict[str, str | None] = {}
    for name, cvd in layout.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}: names are non-empty strings, not {name!r:.60}")
        value = _visible_value(cvd, f"{where}[{name!r}]")
        if value is None and not unset:
            raise TypeError(f'{where}[{name!r}]: a CUDA_VISIBLE_DEVICES ("" for no GPU), not None')
        checked[name] = value
    return checked


def _env(base: Mapping[str, str], cvd: str | None) -> dict[str, str]:
    env = dict(base)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # `ray start` worker nodes refuse it
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    if cvd is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    return env


def _command(p: subprocess.Popen[bytes]) -> str:
    """The start of a process's command line, for messages."""
    args = p.args if isinstance(p.args, (list, tuple)) else [p.args]
    return " ".join(str(a) for a in args[:3])


class Processes:
    """Processes started for one cluster, each in its own process group."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[str] = []

    def report_early_exits(self) -> None:
        """Print the log of every process that already ended: why a node never joined."""
        for p, log in zip(self.procs, self.logs, strict=True):
            if p.poll() is not None:
                with open(log, errors="replace") as f:
                    tail = f.read()[-2000:]
                print(
                    f"--- {_command(p)} exited {p.returncode}; {log}:\n{tail}",
                    file=sys.stderr,
                )

    def wait_for(
        self, p: subprocess.Popen[bytes], log: str, text: str, timeout: float = 90
    ) -> None:
        """Wait until ``text`` appears in ``log`` (the process is up); fail if it ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(log, errors="replace") as f:
                if text in f.read():
                    return
            if p.poll() is not None:
                break
            time.sleep(0.2)
        self.report_early_exits()
        raise RuntimeError(f"{_command(p)} did not come up; see {log}")

    def start(self, cmd: list[str], env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
        """Start ``cmd`` with ``env`` in a process group of its own, its output appended to the
        file ``log``, and return it; :meth:`stop` ends it."""
        out = open(log, "ab")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        self.procs.append(p)
        self.logs.append(log)
        return p

    def stop(self) -> None:
        """End every process started here, and any other whose command line names this
        cluster's marker (its private temp folder): SIGTERM to each process group, up to 15 s,
        then SIGKILL. Prints the logs of those that had already ended."""
        self.report_early_exits()
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        stray = [
            proc
            for proc in psutil.process_iter(["cmdline"])
            if proc.pid != os.getpid() and self.marker in " ".join(proc.info["cmdline"] or ())
        ]
        for proc in stray:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(stray, timeout=10)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def _dashboard_args(port: int | None) -> list[str]:
    if port is None:
        return ["--include-dashboard", "false"]
    return [
        "--include-dashboard",
        "true",
        "--dashboard-host",
        RAY_IP,
        "--dashboard-port",
        str(port),
    ]


@contextlib.contextmanager
def ray_cli_cluster(
    nodes: Mapping[str, str | None],
    env: Mapping[str, str] | None = None,
    *,
    dashboard_port: int | None = None,
) -> Iterator[str]:
    """``ray start --head`` plus one ``ray start`` worker node per entry of ``nodes`` (name ->
    ``CUDA_VISIBLE_DEVICES``; ``--num-gpus`` is its entry count, a custom resource ``node_<name>``
    marks it; ``None`` leaves the variable unset and lets Ray count the GPUs itself). Yields the
    GCS address.

    With ``dashboard_port``, the head also runs the dashboard (and so the job server, for
    ``ray job submit --address http://127.0.0.2:<port>``); it needs ``ray[default]``.

    Raises:
        TypeError, ValueError: ``nodes`` is not a non-empty dict of names to
            ``CUDA_VISIBLE_DEVICES`` (a string, an ordinal, UUIDs and ordinals, or None).
    """
    nodes = _layout(nodes, "ray_cli_cluster(nodes=...)", unset=True)
    base = dict(os.environ if env is None else env)
    tmp = tempfile.mkdtemp(prefix="gsr-", dir="/tmp")  # short: Ray's socket paths are limited
    procs = Processes(tmp)
    port = free_port()
    address = f"{RAY_IP}:{port}"
    common = ["--block", "--disable-usage-stats", "--node-ip-address", RAY_IP, "--temp-dir", tmp]
    common += ["--object-store-memory", str(80 * 1024 * 1024)]
    try:
        head = procs.start(
            [
                cli("ray"),
                "start",
                "--head",
                "--port",
                str(port),
                "--num-cpus",
                "1",
                "--num-gpus",
                "0",
                *_dashboard_args(dashboard_port),
                *common,
            ],
            _env(base, None),
            f"{tmp}/head.log",
        )
        procs.wait_for(head, f"{tmp}/head.log", "Ray runtime started")
        for name, cvd in nodes.items():
            # None: CUDA_VISIBLE_DEVICES unset and Ray counts the GPUs itself (through NVML)
            count = (
                [] if cvd is None else ["--num-gpus", str(len([e for e in cvd.split(",") if e]))]
            )
            node = procs.start(
                [
                    cli("ray"),
                    "start",
                    "--address",
                    address,
                    "--num-cpus",
                    "2",
                    *count,
                    "--resources",
                    json.dumps({f"node_{name}": 100}),
                    *common,
                ],
                _env(base, cvd),
                f"{tmp}/{name}.log",
            )
            # one at a time: concurrent `ray start`s on one host wait on each other
            procs.wait_for(node, f"{tmp}/{name}.log", "Ray runtime started")
        yield address
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def dask_cli_cluster(
    workers: Mapping[str, str],
    env: Mapping[str, str] | None = None,
    scheduler_env: Mapping[str, str] | None = None,
    *,
    preload: bool = True,
    worker_env: Mapping[str, Mapping[str, str]] | None = None,
) -> Iterator[str]:
    """``dask scheduler --preload gpu_serde.dask`` and one ``dask worker --preload gpu_serde.dask``
    per entry of ``workers`` (name -> ``CUDA_VISIBLE_DEVICES``). Yields the scheduler address.

    ``preload=False`` leaves ``--preload`` out (for set-ups that preload through Dask's config);
    ``worker_env`` adds variables to the named workers' environments.

    Raises:
        TypeError, ValueError: ``workers`` is not a non-empty dict of names to
            ``CUDA_VISIBLE_DEVICES`` (a string, an ordinal, or UUIDs and ordinals), or
            ``worker_env`` is not a dict of some of those names to environments.
    """
    chosen = _layout(workers, "dask_cli_cluster(workers=...)", unset=False)
    if worker_env is not None and (
        not isinstance(worker_env, Mapping)
        or not all(isinstance(v, Mapping) for v in worker_env.values())
    ):
        raise TypeError("dask_cli_cluster(worker_env=...): a dict of worker name -> variables")
    unknown = [n for n in (worker_env or {}) if n not in chosen]
    if unknown:
        raise ValueError(
            f"dask_cli_cluster(worker_env=...): {unknown[0]!r:.60} is not a worker "
            f"({', '.join(map(repr, chosen))})"
        )
    base = dict(os.environ if env is None else env)
    tmp = tempfile.mkdtemp(prefix="gsd-", dir="/tmp")
    procs = Processes(tmp)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    # --no-dashboard still serves /health and /metrics, on every interface unless told otherwise
    common = [
        *(["--preload", "gpu_serde.dask"] if preload else []),
        "--no-dashboard",
        "--dashboard-address",
        "127.0.0.1:0",
    ]
    extra = worker_env or {}
    try:
        procs.start(
            [
                cli("dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *common,
                "--scheduler-file",
                f"{tmp}/scheduler.json",
            ],
            _env(dict(scheduler_env or base), None),
            f"{tmp}/scheduler.log",
        )
        for name, cvd in chosen.items():
            procs.start(
                [
                    cli("dask"),
                    "worker",
                    address,
                    "--name",
                    name,
                    "--nthreads",
                    "1",
                    "--host",
                    "127.0.0.1",
                    *common,
                    "--local-directory",
                    tmp,
                ],
                _env({**base, **extra.get(name, {})}, cvd),
                f"{tmp}/{name}.log",
            )
        yield address
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
