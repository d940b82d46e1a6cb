"""The descriptor broker (was ``fdshare``): hands file descriptors to same-user processes here.

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

import atexit
import contextlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from gpu_serde.broker_client import (
    ACQUIRE,
    FETCH,
    NO,
    NOSIGNAL,
    OK,
    RELEASE,
    TOKEN_BYTES,
    acquire,
    disconnect,
    fetch,
    peer_credentials,
    recv_by,
    release,
)

__all__ = ["Broker", "acquire", "broker", "disconnect", "fetch", "is_own", "release"]

#: Seconds a broker keeps a silent connection open.
IDLE_S = 60.0
#: Seconds a request may take from its first byte to its last (a slow peer holds a broker thread
#: at most this long per request, however it paces its bytes).
REQUEST_S = 1.0


class Broker:
    """Serves descriptors to same-user processes that present the right token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fds: dict[bytes, int] = {}
        # token -> [object, live importers, ever acquired, on_release, grace s, let go at]
        self._holds: dict[bytes, list[Any]] = {}
        self._closed = False
        self._exiting = False  # set at exit: nothing is let go any more
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
        while not self._closed and not self._exiting:
            with self._lock:
                due = [e[5] for e in self._holds.values() if e[5] is not None]
            self._due.wait(max(0.0, min(due) - time.monotonic()) if due else None)
            self._due.clear()
            if not self._exiting:
                self._sweep()

    def stop_letting_go(self, timeout: float = 2.0) -> None:
        """Stop the release thread (a callback in flight finishes first, for up to ``timeout``
        s): at exit no daemon thread may free a CUDA object while the interpreter is torn down
        (it can abort the process). What the broker still holds goes with the process."""
        self._exiting = True
        self._due.set()
        if self._letting_go is not threading.current_thread():
            self._letting_go.join(timeout)

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
                _, uid = peer_credentials(conn)
                if uid != os.getuid():
                    return  # other users get nothing, not even an answer
                while self._answer(conn):
                    pass
        finally:
            with self._lock:
                self._conns.pop(conn, None)

    def _answer(self, conn: socket.socket) -> bool:
        """Answer one request on ``conn``; False when the connection is done (the peer hung up or
        sent a malformed request). Raises ``TimeoutError`` after :data:`IDLE_S` of silence, or
        when a request is not complete :data:`REQUEST_S` after its first byte."""
        conn.settimeout(IDLE_S)
        request = conn.recv(1 + TOKEN_BYTES)
        if not request:
            return False
        if len(request) < 1 + TOKEN_BYTES:  # the rest must come within one deadline
            deadline = time.monotonic() + REQUEST_S
            request = recv_by(conn, request, 1 + TOKEN_BYTES, deadline)
        conn.settimeout(REQUEST_S)  # the answer, too, is bounded: a peer that never reads
        op, token = request[:1], request[1:]
        if len(request) != 1 + TOKEN_BYTES or op not in (FETCH, ACQUIRE, RELEASE):
            conn.sendall(NO, NOSIGNAL)
            return False  # the framing is lost: the peer reconnects
        if op != FETCH:
            counted = self._count(token, 1 if op == ACQUIRE else -1)
            conn.sendall(OK if counted else NO, NOSIGNAL)
            return True
        with self._lock:
            fd = self._fds.get(token)
            if fd is not None:
                fd = os.dup(fd)  # survives a concurrent revoke while it is sent
        if fd is None:
            conn.sendall(NO, NOSIGNAL)
            return True
        try:
            socket.send_fds(conn, [OK], [fd], NOSIGNAL)
        finally:
            os.close(fd)
        return True


_broker: Broker | None = None
_broker_lock = threading.Lock()


_left_by_fork: list[dict[bytes, list[Any]]] = []


def _forget_after_fork() -> None:
    """A forked child serves nothing of its parent's: close the inherited listening socket and
    descriptors (the parent's stay open), forget the held objects; a new broker starts on use."""
    global _broker, _broker_lock
    inherited, _broker, _broker_lock = _broker, None, threading.Lock()
    if inherited is not None:
        inherited._lock, inherited._due = threading.Lock(), threading.Event()  # unheld copies
        # the parent keeps these alive; the child keeps them too, never dropped: freeing calls
        # the driver, which a forked child must not do before it execs
        _left_by_fork.append(inherited._holds)
        inherited._holds = {}
        with contextlib.suppress(OSError):
            inherited.close(inherited=True)


os.register_at_fork(after_in_child=_forget_after_fork)


def _stop_letting_go_at_exit() -> None:
    if _broker is not None:
        _broker.stop_letting_go()


atexit.register(_stop_letting_go_at_exit)


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
