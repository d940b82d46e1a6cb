"""The keeper: a small process that serves an exporter's memory on after the exporter exits, so
that a payload sent just before the end (a Ray GPU task's result: Ray ends that worker after the
task) still arrives with its bytes.

**When.** At a normal exit (``atexit``), a process whose broker still has holds on memory that
its descriptor keeps allocated by itself (an ``ArenaMemoryResource`` region, a
``VirtualMemoryResource`` buffer: CUDA frees such memory only once every descriptor of it is
closed) hands them over, if one of them is unclaimed (a payload not yet acquired) or still held
by an importer. A claimed hold that no one holds is let go instead; memory that goes with its
process (a memory pool's) is marked gone in the holds file, so that an importer is told its
exporter exited. A process that is killed hands over nothing: its importers get
:class:`~gpu_serde.ExporterGoneError`.

**How.** The exiting process waits for the GPU's work on the kept memory, marks its holds file
"exited" (importers then wait for no event of it), stops accepting connections, and starts the
keeper with the listening socket, the holds file and the kept descriptors (the same open file
descriptions: the exporter's write locks, its hold on byte ``ALIVE`` among them, stay). The
keeper detaches (a new session, and a parent that has exited: Ray kills an exiting worker's
direct children) and serves the same address with a :class:`~gpu_serde.memory.broker.Broker`.
Importers reconnect to it as to a broker that hung up, and note their holds again.

**Until.** The keeper lets a hold go as the exporter would (no process holds its lock, after
the grace period), and keeps an unclaimed one :data:`KEEP_S` seconds at most. When it holds
nothing, it closes everything and exits: the memory is freed once the importers' own mappings go.
It never touches CUDA: a descriptor is all it holds.

**Its log.** Its stderr is the regular file ``GPU_SERDE_KEEPER_LOG`` names (:data:`LOG_VARIABLE`),
opened by the exporter to append; unset or unusable, nowhere. It says there when it started and
why it ended, a line in one write.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import multiprocessing.util
import os
import selectors
import socket
import stat
import subprocess
import sys
import time
import types
import warnings
from typing import Any

from gpu_serde import settings
from gpu_serde.memory.broker import holdsfile, server
from gpu_serde.text import quoted

#: Seconds a keeper keeps a payload that no importer has claimed, from the exporter's exit
#: (``GPU_SERDE_KEEP_S``; 0: no keeper, what an exiting exporter holds goes with it). Read at
#: exit.
KEEP_S = 120.0
#: Seconds an exiting process waits for its keeper to take over.
START_S = 15.0
#: The environment variable naming a file the keeper appends what it does to (its start, its
#: end, and any error of its own); unset, the keeper says nothing.
LOG_VARIABLE = "GPU_SERDE_KEEPER_LOG"
_POLL_S = 0.5


def keep_s() -> float:
    """:data:`KEEP_S`, or ``GPU_SERDE_KEEP_S`` when it is set.

    Raises:
        ValueError: ``GPU_SERDE_KEEP_S`` is not a number of seconds (0 or more, finite: a
            keeper that never ends is refused).
    """
    raw = os.environ.get("GPU_SERDE_KEEP_S", "")
    if not raw.strip():  # unset or empty
        return KEEP_S
    seconds = settings.parse(raw)
    if seconds is None:
        raise ValueError(
            f"GPU_SERDE_KEEP_S={quoted(raw)} is not a number of seconds (0 or more, finite)"
        )
    return seconds


def _package_root() -> str:
    import gpu_serde

    return os.path.dirname(os.path.dirname(os.path.abspath(gpu_serde.__file__)))


# The keeper's program: detach first (its parent exits at once, so the exporter's Ray worker
# finds no child of its own to kill), then import and serve.
_PROGRAM = (
    "import os, sys\n"
    "if os.fork():\n"
    "    os._exit(0)\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from gpu_serde.memory.broker.keeper import main\n"
    "main(int(sys.argv[2]))\n"
)


def hand_off(b: server.Broker, keep: float) -> int | None:
    """Hand what broker ``b`` must keep serving to a new keeper process (at exit, the release
    thread stopped); its pid, or None when nothing needed keeping.

    Raises:
        OSError, RuntimeError: the keeper could not be started (nothing was handed over then;
            what the broker held goes with this process).
    """
    kept = b.to_keep()
    if kept is None:
        return None
    for make_ready in kept.ready:
        make_ready()  # the GPU's work on the kept memory is done before this process ends
    b.mark_exited()
    b.stop_accepting()
    # the descriptors go at numbers of 3 and up (the same open file descriptions: their locks
    # stay), whatever this process left at 0 to 2; the state goes in a memory file, which no
    # write can block on
    moved: dict[int, int] = {}
    state_fd = -1
    log_fd: int | None = None
    try:
        for fd in kept.fds:
            moved[fd] = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        state = dict(kept.state, keep=keep, fds={str(new): old for old, new in moved.items()})
        state_fd = os.memfd_create("gpu_serde-keeper-state", os.MFD_CLOEXEC)
        os.write(state_fd, json.dumps(state).encode())
        state_fd = _at_least_3(state_fd)
        log_fd = _open_log()
        proc = subprocess.Popen(
            [sys.executable, "-c", _PROGRAM, _package_root(), str(state_fd), __name__, b.address],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            # nothing of this process's: a parent that reads its output until the end must not
            # wait for the keeper's
            stderr=subprocess.DEVNULL if log_fd is None else log_fd,
            pass_fds=[state_fd, *moved.values()],
            start_new_session=True,
            close_fds=True,
        )
    finally:
        for fd in [*moved.values(), state_fd]:
            if fd >= 0:
                os.close(fd)
        if log_fd is not None:
            os.close(log_fd)
    assert proc.stdout is not None
    try:
        with selectors.DefaultSelector() as sel:  # not select(): descriptors past 1024
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline() if sel.select(START_S) else b""
    finally:
        proc.stdout.close()
        proc.wait(START_S)
    if not line.startswith(b"keeping "):
        raise RuntimeError("the keeper process did not start")
    return int(line.split()[1])


#: What a user does about a keeper log that cannot be used.
_LOG_FIX = (
    "the keeper logs nothing: name a regular file on a local disk by an absolute path, in a "
    "folder that exists"
)


def _log_problem(path: str) -> str | None:
    """Why ``path`` (``GPU_SERDE_KEEPER_LOG``) cannot be the keeper's log, or None when it can be
    (as far as a look without opening it tells). Never raises."""
    if not os.path.isabs(path):
        home = "~ is not expanded; " if path.startswith("~") else ""
        with contextlib.suppress(OSError):
            home += f"it would be found from {os.getcwd()!r}, this process's folder"
        return f"{path!r} is not an absolute path ({home.removesuffix('; ')})"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return f"{path!r} is not a regular file"
    except FileNotFoundError:
        if not os.path.isdir(os.path.dirname(path)):
            return f"the folder of {path!r} does not exist"
    except OSError as exc:
        return str(exc)
    return None


def _open_log() -> int | None:
    """A descriptor of the regular file ``GPU_SERDE_KEEPER_LOG`` names, opened to append (created
    with mode 0600 if missing); None when it is unset or cannot be used (said on stderr, as far
    as stderr takes it: the keeper starts all the same). Nothing here can block or raise: a
    FIFO, a socket or a device is refused before it is opened (a reader that never comes, or one
    waiting for the end of the exporter's output, would wait for the keeper's)."""
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        return None
    fd = -1
    try:
        problem = _log_problem(path)
        if problem is not None:
            raise OSError(problem)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
        fd = os.open(path, flags, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the look
            raise OSError(f"{path!r} is not a regular file")
        os.set_blocking(fd, True)
        # at 3 or more: what this process left at 0 to 2 is not the keeper's
        opened = fd if fd >= 3 else fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        if opened == fd:
            fd = -1  # returned, not closed
        return opened
    except OSError as exc:
        _tell(f"gpu_serde: {LOG_VARIABLE}: {exc}; {_LOG_FIX}")
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def _tell(line: str) -> None:
    """Say ``line`` on this exiting process's stderr, if it takes it (a closed pipe does not)."""
    with contextlib.suppress(Exception):
        os.write(2, (line + "\n").encode(errors="backslashreplace"))


def _say(what: str) -> None:
    """One line of the keeper's log (its stderr: ``GPU_SERDE_KEEPER_LOG``, else nowhere), written
    at once (keepers that share a log do not mix their lines); a log that cannot be written (a
    full disk) loses the line, never the keeper."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    _tell(f"{stamp} gpu_serde keeper {os.getpid()}: {what}")


def _at_least_3(fd: int) -> int:
    """``fd``, moved to a number of 3 or more (it is closed)."""
    if fd >= 3:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


_handed: server.Broker | None = None  # the broker this process handed off at its exit


def _hand_off_at_exit() -> None:
    """The exit hook (``atexit``, and multiprocessing's exit finalizers, which run in a child of
    every start method before it ends with ``os._exit``): once per broker."""
    global _handed
    b = server._broker
    if b is None or b is _handed:
        return
    _handed = b
    try:
        keep = keep_s()
        if keep <= 0:
            return
        b.stop_letting_go()
        pid = hand_off(b, keep)
        if pid is not None and _at_a_terminal():
            # someone who ran a script by hand sees why a process of gpu_serde's lives on (a
            # worker's log, not a terminal, is left alone: keepers are routine there)
            _tell(
                f"gpu_serde: keeper process {pid} serves the GPU memory this process sent until "
                f"its receivers let go, and what no process has received yet for {keep:g} s "
                f"(GPU_SERDE_KEEP_S; 0: no keeper; its log: {LOG_VARIABLE})"
            )
    except Exception as exc:  # said, never raised: the process is ending
        _tell(
            f"gpu_serde: the memory this process sent could not be handed to a keeper ({exc}); "
            "receivers that have not yet taken it get ExporterGoneError"
        )


def _at_a_terminal() -> bool:
    """True when this process's stderr is a terminal and no keeper log is asked for."""
    return os.isatty(2) and not os.environ.get(LOG_VARIABLE)


def _callers_level() -> int:
    """The ``stacklevel`` (for a warning raised by this function's caller) of the first frame
    outside gpu_serde: the user's line that first sent memory, not gpu_serde's own."""
    package = os.path.join(_package_root(), "gpu_serde") + os.sep
    frame: types.FrameType | None = sys._getframe(2)  # (1: the caller, which warns)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _on_broker_start() -> None:
    """When this process's broker starts: check ``GPU_SERDE_KEEP_S`` and
    ``GPU_SERDE_KEEPER_LOG`` now (warnings, not failures: sending must not fail), and hook the
    hand-off into multiprocessing's exit (a multiprocessing child ends with ``os._exit``, which
    runs no ``atexit``)."""
    try:
        keep_s()
    except ValueError as exc:
        warnings.warn(
            f"{exc}: no keeper will serve what this process sends", stacklevel=_callers_level()
        )
    log = os.environ.get(LOG_VARIABLE)
    problem = _log_problem(log) if log else None
    if problem is not None:
        warnings.warn(f"{LOG_VARIABLE}: {problem}; {_LOG_FIX}", stacklevel=_callers_level())
    multiprocessing.util.Finalize(None, _hand_off_at_exit, exitpriority=0)


atexit.register(_hand_off_at_exit)  # after the broker's: runs before it
server.on_start.append(_on_broker_start)


def main(state_fd: int) -> None:
    """The keeper process: read the state (JSON, in the memory file ``state_fd``), serve it, and
    exit once nothing is held (or its release thread died: nothing could be let go any more)."""
    with os.fdopen(state_fd, "rb") as f:
        f.seek(0)
        state: dict[str, Any] = json.loads(f.read())
    fds = {int(old): int(new) for new, old in state["fds"].items()}
    sock = socket.socket(fileno=fds[int(state["sock"])])
    file = holdsfile.HoldsFile(fds[int(state["file"])])
    b = server.Broker(sock=sock, file=file, kept=(state, fds))
    with open(os.devnull, "wb") as null:
        sys.stdout.write(f"keeping {os.getpid()}\n")
        sys.stdout.flush()
        os.dup2(null.fileno(), 1)
    keep = float(state["keep"])
    _say(
        f"serving {b.address} for the exporter that exited; objects held or unclaimed: "
        f"{b.held()} (an unclaimed one is kept {keep:g} s)"
    )
    while b.held() and b.alive():
        time.sleep(_POLL_S)
        b.expire_unclaimed(keep)
    _say("nothing is held any more: exiting" if b.alive() else "its release thread ended: exiting")
    b.close()
