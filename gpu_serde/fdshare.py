"""The descriptor broker: hands file descriptors to other processes of the same user on this host.

One broker per exporting process, started on first use: a daemon thread serving an abstract Unix
socket. A peer asks with a 128-bit token; the broker answers only peers of the same uid
(``SO_PEERCRED``) and passes the descriptor with ``SCM_RIGHTS``. The client checks the broker's uid
too (abstract socket names carry no permissions), and gives up after a timeout (1 s by default)
instead of hanging. Descriptors the broker holds are its own duplicates, closed on :meth:`revoke`,
on :meth:`Broker.close` and at exit.

Connections persist: a client keeps at most :data:`MAX_IDLE` idle connections (the most recently
used brokers) and reuses them, so a request costs one message each way instead of a connect and a
new thread in the broker; the broker serves each connection from a thread of its own and closes
one idle for :data:`IDLE_S`. A reused connection that the broker closed in the meantime (idle, or
the exporter exited) is reconnected once; the broker never closes a connection between reading a
request and answering it (except in :meth:`Broker.close`, after which nothing is counted), so a
request is never counted twice.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from gpu_serde.errors import ExporterGoneError, TokenRefusedError

TOKEN_BYTES = 16
ADDRESS_MAX = 100  # abstract socket names stay well under the 107-byte limit
_FETCH = b"F"
_ACQUIRE = b"A"
_RELEASE = b"R"
_OK = b"K"
_NO = b"N"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

_NOSIGNAL = socket.MSG_NOSIGNAL  # a closed peer is an error, never a SIGPIPE

#: Idle connections a client keeps open for reuse, over all brokers (the most recently used).
MAX_IDLE = 8
#: Seconds a broker keeps a silent connection open.
IDLE_S = 60.0


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class Broker:
    """Serves descriptors to same-user processes that present the right token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[bytes, int] = {}
        # token -> [object, live importers, ever acquired, on_release, grace s, let go at]
        self._holds: dict[bytes, list] = {}
        self._closed = False
        self._conns: dict[socket.socket, threading.Thread] = {}  # connections being served
        self._due = threading.Event()  # an object's last importer released it
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"gpu_serde-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock.bind("\0" + name)
        self._sock.listen(512)
        self.address = "@" + name
        self._thread = threading.Thread(target=self._serve, name="gpu_serde-broker", daemon=True)
        self._thread.start()
        self._letting_go = threading.Thread(
            target=self._release_loop, name="gpu_serde-broker-release", daemon=True
        )
        self._letting_go.start()

    def offer(self, fd: int) -> bytes:
        """Serve a duplicate of ``fd`` (the caller keeps its own) and return the token for it."""
        token = secrets.token_bytes(TOKEN_BYTES)
        dup = os.dup(fd)
        with self._lock:
            if self._closed:
                os.close(dup)
                raise RuntimeError("the descriptor broker is closed")
            self._fds[token] = dup
        return token

    def revoke(self, token: bytes) -> None:
        """Stop serving ``token`` and close the broker's descriptor for it (unknown: no-op)."""
        with self._lock:
            fd = self._fds.pop(token, None)
        if fd is not None:
            os.close(fd)

    def hold(
        self, obj: object, on_release: Callable[[object], None], *, grace: float = 0.0
    ) -> bytes:
        """Keep ``obj`` alive for importers; return its token.

        Once it has been acquired and every acquirer has released it, the broker waits ``grace``
        seconds (a new acquire in that time keeps it), then drops it and calls ``on_release(obj)``
        in the broker's release thread (a slow callback delays no reply). An object never acquired
        is kept until :meth:`close` or exit.
        """
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            if self._closed:
                raise RuntimeError("the descriptor broker is closed")
            self._holds[token] = [obj, 0, False, on_release, grace, None]
        return token

    def peek(self, token: bytes) -> object | None:
        """The object held under ``token``, or None."""
        with self._lock:
            entry = self._holds.get(token)
            return entry[0] if entry else None

    def held(self) -> int:
        """How many objects the broker keeps alive for importers."""
        with self._lock:
            return len(self._holds)

    def _count(self, token: bytes, delta: int) -> bool:
        with self._lock:
            entry = self._holds.get(token)
            if entry is None or (delta < 0 and entry[1] <= 0):
                return False  # unknown, let go already, or released more often than acquired
            entry[1] += delta
            entry[2] = entry[2] or delta > 0
            entry[5] = time.monotonic() + entry[4] if entry[1] == 0 else None
        if entry[5] is not None:
            self._due.set()
        return True

    def _release_loop(self) -> None:
        """The release thread: lets go of objects once their grace has passed."""
        while not self._closed:
            with self._lock:
                due = [e[5] for e in self._holds.values() if e[5] is not None]
            self._due.wait(max(0.0, min(due) - time.monotonic()) if due else None)
            self._due.clear()
            self._sweep()

    def _sweep(self) -> None:
        """Let go of objects whose importers all released them more than ``grace`` s ago."""
        now = time.monotonic()
        with self._lock:
            due = [t for t, e in self._holds.items() if e[5] is not None and e[5] <= now]
            dropped = [self._holds.pop(t) for t in due]
        for entry in dropped:
            obj, on_release = entry[0], entry[3]
            entry.clear()
            with contextlib.suppress(Exception):  # the exporter's callback must not kill the broker
                on_release(obj)
            del obj

    def __len__(self) -> int:
        with self._lock:
            return len(self._fds)

    def close(self, *, inherited: bool = False) -> None:
        """Stop serving and close every descriptor the broker holds, its connections' too.

        ``inherited=True`` (in a forked child) only closes this process's copies: shutting the
        sockets down would stop the parent's broker too, since both share them.
        """
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
            self._holds.clear()
            conns, self._conns = list(self._conns.items()), {}
        self._due.set()  # the release thread ends
        for fd in fds:
            os.close(fd)
        if not inherited:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept
        self._sock.close()
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                if inherited:
                    conn.close()  # no thread serves it here
                else:
                    conn.shutdown(socket.SHUT_RDWR)  # its thread sees the end and closes it
        if not inherited:
            for _, thread in conns:
                if thread is not threading.current_thread():
                    thread.join(1.0)

    def _serve(self) -> None:
        self._sock.settimeout(0.25)  # wake up now and then to notice a close
        while True:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE, ECONNABORTED...: keep serving
                continue
            # a thread per connection: a slow or silent peer holds up no one else
            thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns[conn] = thread  # before the thread runs: a fork or close sees it
            try:
                thread.start()
            except RuntimeError:  # no thread to be had (a process or thread limit): hang up
                with self._lock:
                    self._conns.pop(conn, None)
                conn.close()
                time.sleep(0.05)

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn, contextlib.suppress(OSError):
                _, uid = _peer(conn)
                if uid != os.getuid():
                    return  # other users get nothing, not even an answer
                while self._answer(conn):
                    pass
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one request on ``conn``; False when the connection is done (the peer hung up or
        sent a malformed request). Raises ``TimeoutError`` after :data:`IDLE_S` of silence."""
        conn.settimeout(IDLE_S)
        request = conn.recv(1 + TOKEN_BYTES)
        if not request:
            return False
        if len(request) < 1 + TOKEN_BYTES:
            conn.settimeout(1.0)  # a peer silent mid-request never holds its thread for long
            request += _recv_exact(conn, 1 + TOKEN_BYTES - len(request))
        op, token = request[:1], request[1:]
        if len(request) != 1 + TOKEN_BYTES or op not in (_FETCH, _ACQUIRE, _RELEASE):
            conn.sendall(_NO, _NOSIGNAL)
            return False  # the framing is lost: the peer reconnects
        if op != _FETCH:
            counted = self._count(token, 1 if op == _ACQUIRE else -1)
            conn.sendall(_OK if counted else _NO, _NOSIGNAL)
            return True
        with self._lock:
            fd = self._fds.get(token)
            if fd is not None:
                fd = os.dup(fd)  # survives a concurrent revoke while it is sent
        if fd is None:
            conn.sendall(_NO, _NOSIGNAL)
            return True
        try:
            socket.send_fds(conn, [_OK], [fd], _NOSIGNAL)
        finally:
            os.close(fd)
        return True


_broker: Broker | None = None
_broker_lock = threading.Lock()

# The client's connections: idle ones by broker address, in order of last use (oldest first).
_idle: dict[str, list[socket.socket]] = {}
_open: set[socket.socket] = set()  # every connection this process has open, idle or in use
_pool_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child serves nothing of its parent's and shares none of its connections: close
    the inherited sockets and descriptors (the parent's stay open), forget the held objects; a new
    broker and new connections start on use."""
    global _broker, _broker_lock, _pool_lock
    _pool_lock = threading.Lock()
    conns = list(_open)
    _idle.clear()
    _open.clear()
    for sock in conns:
        with contextlib.suppress(OSError):
            sock.close()
    inherited, _broker, _broker_lock = _broker, None, threading.Lock()
    if inherited is not None:
        inherited._lock, inherited._due = threading.Lock(), threading.Event()  # unheld copies
        inherited._holds.clear()  # the parent keeps these alive, not the child
        with contextlib.suppress(OSError):
            inherited.close(inherited=True)


os.register_at_fork(after_in_child=_forget_after_fork)


def broker() -> Broker:
    """This process's broker, started on first use."""
    global _broker
    if _broker is None:
        with _broker_lock:
            if _broker is None:
                _broker = Broker()
    return _broker


def is_own(address: str) -> bool:
    """True when ``address`` is this process's broker (a started one)."""
    b = _broker
    return b is not None and b.address == address


def _take(address: str) -> socket.socket | None:
    with _pool_lock:
        idle = _idle.get(address)
        if not idle:
            return None
        sock = idle.pop()
        if not idle:
            del _idle[address]
        return sock


def _close(sock: socket.socket) -> None:
    with _pool_lock:
        _open.discard(sock)
    sock.close()


def _keep(address: str, sock: socket.socket) -> None:
    """Put ``sock`` back for reuse; close the least recently used beyond :data:`MAX_IDLE`."""
    surplus = []
    with _pool_lock:
        if sock not in _open:  # forgotten after a fork while in use: not ours to keep
            surplus.append(sock)
        else:
            _idle[address] = [*_idle.pop(address, []), sock]  # to the end: used last
            extra = sum(map(len, _idle.values())) - MAX_IDLE
            while extra > 0:
                oldest = next(iter(_idle))
                surplus.append(_idle[oldest].pop(0))
                if not _idle[oldest]:
                    del _idle[oldest]
                extra -= 1
            _open.difference_update(surplus)
    for s in surplus:
        s.close()


def disconnect() -> None:
    """Close this process's idle connections to brokers (new requests connect again)."""
    with _pool_lock:
        socks = [s for idle in _idle.values() for s in idle]
        _idle.clear()
        _open.difference_update(socks)
    for s in socks:
        s.close()


def _connect(address: str, deadline: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock.connect("\0" + address[1:])
                break
            except BlockingIOError:  # the broker's backlog is full: it is busy, not gone
                if time.monotonic() >= deadline:
                    raise TimeoutError from None
                time.sleep(0.01)
            except TimeoutError:
                raise
            except OSError as exc:
                raise ExporterGoneError(
                    f"the exporting process's descriptor broker {address} is gone "
                    f"({exc.strerror or exc}): the exporter exited, or lives in another network "
                    "namespace (container)"
                ) from None
        pid, uid = _peer(sock)
        if uid != os.getuid():
            raise ExporterGoneError(
                f"{address} is served by uid {uid} (pid {pid}), not by this user: "
                "not gpu_serde's broker"
            )
    except BaseException:
        sock.close()
        raise
    with _pool_lock:
        _open.add(sock)
    return sock


def _request(address: str, op: bytes, token: bytes, timeout: float) -> tuple[bytes, list[int]]:
    if (
        not address.startswith("@")
        or not address.isascii()
        or len(address) > ADDRESS_MAX
        or len(token) != TOKEN_BYTES
    ):
        raise ValueError("a broker address is '@name' (ASCII) and a token 16 bytes")
    deadline = time.monotonic() + timeout
    sock = _take(address)
    answered = False
    try:
        while True:
            reused = sock is not None
            if sock is None:
                sock = _connect(address, deadline)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock.sendall(op + token, _NOSIGNAL)
                msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
            except (BrokenPipeError, ConnectionResetError):
                if not reused:
                    raise
                msg, fds = b"", []
            if msg or fds or not reused:
                break
            _close(sock)  # the broker closed it while idle (or exited): no request was read
            sock = None
        if not msg:
            for fd in fds:
                os.close(fd)
            raise ExporterGoneError(
                f"the descriptor broker {address} hung up without answering: it is closing, or "
                "this process runs as another user"
            )
        answered = True
    except TimeoutError:
        raise ExporterGoneError(
            f"the descriptor broker {address} did not answer within {timeout} s"
        ) from None
    except ExporterGoneError:
        raise
    except OSError as exc:  # reset or broken pipe: the exporter went away mid-request
        raise ExporterGoneError(
            f"the descriptor broker {address} hung up ({exc.strerror or exc})"
        ) from None
    finally:
        if sock is not None and not answered:
            _close(sock)  # a request without an answer leaves the connection in an unknown state
    if answered:
        _keep(address, sock)
    return msg, fds


def acquire(address: str, token: bytes, *, timeout: float = 1.0) -> None:
    """Tell the exporter an importer now uses the object held under ``token``.

    Raises:
        ExporterGoneError: as :func:`fetch`.
        TokenRefusedError: the exporter no longer holds it (its last importer released it).
    """
    msg, fds = _request(address, _ACQUIRE, token, timeout)
    for fd in fds:
        os.close(fd)
    if msg != _OK:
        raise TokenRefusedError(
            f"the exporter ({address}) no longer holds this object: every earlier importer "
            "released it; send it again from the exporter"
        )


def release(address: str, token: bytes, *, timeout: float = 1.0) -> bool:
    """Tell the exporter one importer let go of the object held under ``token``; True if the
    exporter counted it. Never raises for a vanished exporter (nothing is left to release)."""
    try:
        msg, fds = _request(address, _RELEASE, token, timeout)
    except ExporterGoneError:
        return False
    for fd in fds:
        os.close(fd)
    return msg == _OK


def fetch(address: str, token: bytes, *, timeout: float = 1.0) -> int:
    """Ask the broker at ``address`` for the descriptor behind ``token``; the caller owns (and
    closes) the returned descriptor.

    Raises:
        ExporterGoneError: nothing listens at ``address``, the broker belongs to another user,
            hung up without answering (it is closing, or this process runs as another user), or
            did not answer within ``timeout`` seconds.
        TokenRefusedError: the broker refused the token (unknown or revoked).
        ValueError: ``address`` or ``token`` is malformed.
    """
    msg, fds = _request(address, _FETCH, token, timeout)
    if msg == _OK and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise TokenRefusedError(
        f"the descriptor broker {address} refused the request: the export was released, or the "
        "token is wrong"
    )
