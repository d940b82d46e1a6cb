"""The descriptor broker: hands file descriptors to other processes of the same user on this host.

One broker per exporting process, started on first use: a daemon thread serving an abstract Unix
socket. A peer asks with a 128-bit token; the broker answers only peers of the same uid
(``SO_PEERCRED``) and passes the descriptor with ``SCM_RIGHTS``. The client checks the broker's uid
too (abstract socket names carry no permissions), and gives up after a timeout (1 s by default)
instead of hanging. Descriptors the broker holds are its own duplicates, closed on :meth:`revoke`,
on :meth:`Broker.close` and at exit.
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
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"gpu_serde-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock.bind("\0" + name)
        self._sock.listen(512)
        self.address = "@" + name
        self._thread = threading.Thread(target=self._serve, name="gpu_serde-broker", daemon=True)
        self._thread.start()

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
        in the broker's thread. An object never acquired is kept until :meth:`close` or exit.
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
        return True

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
        """Stop serving and close every descriptor the broker holds.

        ``inherited=True`` (in a forked child) only closes this process's copies: shutting the
        socket down would stop the parent's broker too, since both share it.
        """
        with self._lock:
            self._closed = True
            fds, self._fds = list(self._fds.values()), {}
            self._holds.clear()
        for fd in fds:
            os.close(fd)
        if not inherited:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept
        self._sock.close()

    def _serve(self) -> None:
        self._sock.settimeout(0.25)  # wake up to let go of released objects on time
        while True:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._sweep()
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE, ECONNABORTED...: keep serving
                continue
            # one short-lived thread per request: a slow or silent peer holds up no one else
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self._answer(conn)
        self._sweep()  # after the answer: letting go of an object never delays a reply

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)  # a silent peer never holds the broker up for long
        _, uid = _peer(conn)
        if uid != os.getuid():
            return  # other users get nothing, not even an answer
        request = _recv_exact(conn, 1 + TOKEN_BYTES)
        op, token = request[:1], request[1:]
        if len(request) != 1 + TOKEN_BYTES or op not in (_FETCH, _ACQUIRE, _RELEASE):
            conn.sendall(_NO)
            return
        if op != _FETCH:
            conn.sendall(_OK if self._count(token, 1 if op == _ACQUIRE else -1) else _NO)
            return
        with self._lock:
            fd = self._fds.get(token)
            if fd is not None:
                fd = os.dup(fd)  # survives a concurrent revoke while it is sent
        if fd is None:
            conn.sendall(_NO)
            return
        try:
            socket.send_fds(conn, [_OK], [fd])
        finally:
            os.close(fd)


_broker: Broker | None = None
_broker_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child serves nothing of its parent's: close the inherited socket and
    descriptors (the parent's stay open), forget the held objects; a new broker starts on use."""
    global _broker, _broker_lock
    inherited, _broker, _broker_lock = _broker, None, threading.Lock()
    if inherited is not None:
        inherited._lock = threading.Lock()
        inherited._holds.clear()  # the parent keeps these alive, not the child
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


def _request(address: str, op: bytes, token: bytes, timeout: float) -> tuple[bytes, list[int]]:
    if (
        not address.startswith("@")
        or not address.isascii()
        or len(address) > ADDRESS_MAX
        or len(token) != TOKEN_BYTES
    ):
        raise ValueError("a broker address is '@name' (ASCII) and a token 16 bytes")
    deadline = time.monotonic() + timeout
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
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.sendall(op + token)
        msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
        return msg, fds
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
        sock.close()


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
        ExporterGoneError: nothing listens at ``address``, the broker belongs to another user, or it
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
        f"the descriptor broker {address} refused the request: the export was released, the token "
        "is wrong, or this process runs as another user"
    )
