"""The descriptor broker's client side: ask another process's broker for a descriptor or a hold.

A client keeps at most :data:`MAX_IDLE` idle connections (the most recently used brokers) and
reuses them, so a request costs one message each way instead of a connect and a new thread in the
broker. A reused connection that the broker closed in the meantime (idle, or the exporter exited)
is reconnected once; the broker never closes a connection between reading a request and answering
it, so a request is never counted twice. The client checks the broker's uid (abstract socket names
carry no permissions) and gives up after a timeout (1 s by default) instead of hanging.
The server side is :mod:`gpu_serde.broker`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

from gpu_serde.errors import ExporterGoneError, TokenRefusedError

TOKEN_BYTES = 16
ADDRESS_MAX = 100  # abstract socket names stay well under the 107-byte limit
FETCH = b"F"
ACQUIRE = b"A"
RELEASE = b"R"
OK = b"K"
NO = b"N"
CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

NOSIGNAL = socket.MSG_NOSIGNAL  # a closed peer is an error, never a SIGPIPE

#: Idle connections a client keeps open for reuse, over all brokers (the most recently used).
MAX_IDLE = 8


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of Unix socket ``sock``."""
    pid, uid, _ = CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CRED.size))
    return pid, uid


def recv_by(sock: socket.socket, data: bytes, n: int, deadline: float) -> bytes:
    """Read until ``data`` holds ``n`` bytes, the peer hangs up, or ``deadline`` (monotonic) passes
    (``TimeoutError``): one deadline for the whole request, however the peer paces its bytes."""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request not complete by its deadline")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


# The client's connections: idle ones by broker address, in order of last use (oldest first).
_idle: dict[str, list[socket.socket]] = {}
_open: set[socket.socket] = set()  # every connection this process has open, idle or in use
_pool_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child shares none of its parent's connections: close the inherited sockets (the
    parent's stay open); new connections start on use."""
    global _pool_lock
    _pool_lock = threading.Lock()
    conns = list(_open)
    _idle.clear()
    _open.clear()
    for sock in conns:
        with contextlib.suppress(OSError):
            sock.close()


os.register_at_fork(after_in_child=_forget_after_fork)


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
        pid, uid = peer_credentials(sock)
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
        or not address.isprintable()  # it is shown in messages
        or len(address) > ADDRESS_MAX
        or len(token) != TOKEN_BYTES
    ):
        raise ValueError("a broker address is '@name' (printable ASCII) and a token 16 bytes")
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
                sock.sendall(op + token, NOSIGNAL)
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
    msg, fds = _request(address, ACQUIRE, token, timeout)
    for fd in fds:
        os.close(fd)
    if msg != OK:
        raise TokenRefusedError(
            f"the exporter ({address}) no longer holds this object: every earlier importer "
            "released it; send it again from the exporter"
        )


def release(address: str, token: bytes, *, timeout: float = 1.0, gone: bool = False) -> bool:
    """Tell the exporter one importer let go of the object held under ``token``; True if the
    exporter counted it. Never raises for a vanished exporter (nothing is left to release),
    unless ``gone`` asks for its :class:`~gpu_serde.ExporterGoneError`."""
    try:
        msg, fds = _request(address, RELEASE, token, timeout)
    except ExporterGoneError:
        if gone:
            raise
        return False
    for fd in fds:
        os.close(fd)
    return msg == OK


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
    msg, fds = _request(address, FETCH, token, timeout)
    if msg == OK and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise TokenRefusedError(
        f"the descriptor broker {address} refused the request: the export was released, or the "
        "token is wrong"
    )
