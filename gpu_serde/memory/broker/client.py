"""The descriptor broker's client side: ask another process's broker for a descriptor or a hold.

A process keeps **one connection per exporting broker** and sends every request to that broker
over it, one at a time. That connection is what the exporter ties this process's holds to: the
holds this process acquired are released only over it, and when the process dies (or closes the
connection) the kernel closes it and the exporter drops them all. So a connection that holds
something is never closed here on purpose (a forked child closes only its own copy); one that
holds nothing is closed when more than :data:`MAX_IDLE` such connections are open (the least
recently used first), and the broker closes one that stays silent for its idle time. A reused
idle connection that the broker closed in the meantime is opened again once (the broker never
closes a connection between reading a request and answering it, so a request is never counted
twice); a broken connection that held something is the exporter gone, and its holds with it.

The client checks the broker's uid (abstract socket names carry no permissions) and gives up after
a timeout (1 s by default) instead of hanging. The wire protocol, both sides: a request is
:data:`REQUEST_BYTES` bytes (an operation, a token, and 16 bytes the broker checks: the block an
acquire is for, the identity a fetch expects), an answer one byte (:data:`OK` with a descriptor for
a fetch, :data:`NO`: unknown, let go, or not held over this connection; :data:`MISMATCH`: the token
is real but was issued for another block or descriptor). The server side is
:mod:`gpu_serde.memory.broker.server`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time

from gpu_serde.errors import ExporterGoneError, HandoffError, TokenRefusedError

TOKEN_BYTES = 16
CHECK_BYTES = 16
REQUEST_BYTES = 1 + TOKEN_BYTES + CHECK_BYTES
ADDRESS_MAX = 100  # abstract socket names stay well under the 107-byte limit
FETCH = b"F"
ACQUIRE = b"A"
RELEASE = b"R"
OK = b"K"
NO = b"N"
MISMATCH = b"M"
NO_CHECK = bytes(CHECK_BYTES)
CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

NOSIGNAL = socket.MSG_NOSIGNAL  # a closed peer is an error, never a SIGPIPE

#: Connections that hold nothing which a process keeps open for reuse (the most recently used).
MAX_IDLE = 8


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of Unix socket ``sock`` (pid 0: in
    another PID namespace)."""
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


class _Link:
    """This process's connection to one broker: the socket (None until needed), the lock that
    makes its requests one at a time, how many holds it carries, and the answers still owed to it
    (requests whose caller gave up waiting on a connection that carries holds: it is kept, and
    the next request reads those answers first)."""

    __slots__ = ("holds", "lock", "owed", "sock", "used")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.holds = 0
        self.owed: list[tuple[bytes, bytes]] = []  # (operation, token), oldest first
        self.used = 0.0

    def drop(self) -> None:
        """Close the connection (the broker drops whatever it held over it)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        self.sock, self.holds, self.owed = None, 0, []


_links: dict[str, _Link] = {}
_links_lock = threading.Lock()
_UNCOUNTED = b"u"  # an owed release that gives back an acquire its caller gave up on


def _forget_after_fork() -> None:
    """A forked child shares none of its parent's connections, nor its holds: close the inherited
    sockets (only this process's copies: the parent's connections and holds stay)."""
    global _links_lock
    _links_lock = threading.Lock()
    socks = [link.sock for link in _links.values() if link.sock is not None]
    _links.clear()
    for sock in socks:  # this process's copies only: no shutdown
        with contextlib.suppress(OSError):
            sock.close()


os.register_at_fork(after_in_child=_forget_after_fork)


def _link(address: str) -> _Link:
    with _links_lock:
        link = _links.get(address)
        if link is None:
            link = _links[address] = _Link()
        return link


def _close_idle(keep: int) -> None:
    """Close the least recently used connections that hold nothing, beyond ``keep`` of them, and
    forget the brokers that have neither a connection nor a hold here."""
    with _links_lock:
        idle = sorted(
            (link.used, address)
            for address, link in _links.items()
            if link.holds == 0 and not link.owed and link.sock is not None
        )
        surplus = [address for _, address in idle[: max(0, len(idle) - keep)]]
        for address in [a for a, link in _links.items() if link.sock is None and not link.holds]:
            gone = _links[address]
            if gone.lock.acquire(blocking=False):  # in use right now: kept
                try:
                    if gone.sock is None and not gone.holds:
                        del _links[address]
                finally:
                    gone.lock.release()
    for address in surplus:
        link = _links.get(address)
        if link is None or not link.lock.acquire(blocking=False):
            continue  # in use right now: not idle
        try:
            if link.holds == 0 and not link.owed and link.sock is not None:
                link.drop()
        finally:
            link.lock.release()


def disconnect() -> None:
    """Close this process's connections that hold nothing (new requests connect again)."""
    _close_idle(0)


def open_connections() -> int:
    """How many broker connections this process has open (holding or idle)."""
    with _links_lock:
        return sum(link.sock is not None for link in _links.values())


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
    return sock


def _check_request(address: str, token: bytes, check: bytes) -> None:
    if (
        not isinstance(address, str)
        or not address.startswith("@")
        or not address.isascii()
        or not address.isprintable()  # it is shown in messages
        or len(address) > ADDRESS_MAX
        or not isinstance(token, bytes)
        or len(token) != TOKEN_BYTES
        or not isinstance(check, bytes)
        or len(check) != CHECK_BYTES
    ):
        raise ValueError(
            "a broker address is '@name' (printable ASCII), a token and a check 16 bytes each"
        )


class _Unanswered(Exception):
    """No answer by the deadline; ``sent``: the request had left (its answer may still come)."""

    def __init__(self, sent: bool) -> None:
        super().__init__("no answer by the deadline")
        self.sent = sent


def _read_answer(sock: socket.socket, deadline: float) -> tuple[bytes, list[int]]:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
    return msg, fds


def _settle_owed(link: _Link, deadline: float) -> None:
    """Read the answers still owed on ``link`` (holding its lock): an acquire that was counted
    although its caller gave up is given back at once (a release, itself owed an answer); a
    release that was counted takes its hold off.

    Raises:
        TimeoutError: an answer is still not there by ``deadline`` (it stays owed).
        OSError: the connection broke (the broker dropped its holds).
    """
    assert link.sock is not None
    while link.owed:
        op, token = link.owed[0]
        msg, fds = _read_answer(link.sock, deadline)
        for fd in fds:
            os.close(fd)
        if not msg:
            raise ConnectionResetError("the broker hung up")
        link.owed.pop(0)
        if msg == OK and op == ACQUIRE:  # counted for a caller that was told it failed
            link.holds += 1
            link.sock.sendall(RELEASE + token + NO_CHECK, NOSIGNAL)
            link.owed.append((_UNCOUNTED, token))
        elif msg == OK and op in (RELEASE, _UNCOUNTED):
            link.holds = max(0, link.holds - 1)


def _exchange(
    link: _Link, address: str, request: bytes, deadline: float
) -> tuple[bytes, list[int]]:
    """Send ``request`` over ``link`` (holding its lock) and read the answer; reconnect once when
    an idle connection was closed by the broker.

    Raises:
        _Unanswered: no answer by ``deadline``.
        OSError, ExporterGoneError: the connection broke, or none could be made.
    """
    while True:
        reused = link.sock is not None
        if link.sock is None:
            try:
                link.sock = _connect(address, deadline)
            except TimeoutError:
                raise _Unanswered(sent=False) from None
        sock = link.sock
        try:
            if link.owed:
                _settle_owed(link, deadline)
        except TimeoutError:
            raise _Unanswered(sent=False) from None
        sent = False
        try:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(request, NOSIGNAL)
            sent = True
            msg, fds = _read_answer(sock, deadline)
        except TimeoutError:
            raise _Unanswered(sent) from None
        except (BrokenPipeError, ConnectionResetError):
            if not reused or link.holds:
                raise
            msg, fds = b"", []
        if msg or fds or not reused or link.holds:
            return msg, fds
        link.drop()  # the broker closed it while idle (or exited): no request was read


def _request(
    address: str, op: bytes, token: bytes, check: bytes, timeout: float
) -> tuple[bytes, list[int]]:
    _check_request(address, token, check)
    while True:
        link = _link(address)
        if not link.lock.acquire(timeout=max(0.0, timeout)):
            raise ExporterGoneError(
                f"the descriptor broker {address} did not answer within {timeout} s (another "
                "request to it is still waiting)"
            )
        with _links_lock:
            current = _links.get(address) is link
        if current:
            break
        link.lock.release()  # forgotten while this thread waited for it: take the new one
    try:
        deadline = time.monotonic() + timeout  # from when this request has the connection
        try:
            msg, fds = _exchange(link, address, op + token + check, deadline)
        except _Unanswered as exc:
            if exc.sent and link.holds and link.sock is not None:
                link.owed.append((op, token))  # kept: it carries holds; read later
            elif link.holds == 0:
                link.drop()  # nothing held over it: start afresh
            raise ExporterGoneError(
                f"the descriptor broker {address} did not answer within {timeout} s"
            ) from None
        except ExporterGoneError:
            link.drop()
            raise
        except OSError as exc:  # reset or broken pipe: the exporter went away mid-request
            link.drop()
            raise ExporterGoneError(
                f"the descriptor broker {address} hung up ({exc.strerror or exc})"
            ) from None
        if not msg:
            for fd in fds:
                os.close(fd)
            link.drop()
            raise ExporterGoneError(
                f"the descriptor broker {address} hung up without answering: it is closing, or "
                "this process runs as another user"
            )
        if msg == OK and op == ACQUIRE:
            link.holds += 1
        elif msg == OK and op == RELEASE:
            link.holds = max(0, link.holds - 1)
        link.used = time.monotonic()
        return msg, fds
    finally:
        link.lock.release()
        if link.holds == 0:
            _close_idle(MAX_IDLE)


def _mismatch(address: str, what: str) -> HandoffError:
    return TokenRefusedError(
        f"the exporter ({address}) refused this {what}: its token was issued for another block "
        "or descriptor than the payload names (a forged or corrupted payload)"
    )


def acquire(address: str, token: bytes, block: bytes = NO_CHECK, *, timeout: float = 1.0) -> None:
    """Tell the exporter that this process now uses the block held under ``token``. The hold is
    this process's: only it can release it (:func:`release`), and the exporter drops it when
    this process's connection to it closes (the process exits or dies).

    Args:
        block: the 16-byte digest of the block the payload names; the exporter checks that the
            hold was issued for it (a hold issued for a block refuses the default, none).

    Raises:
        ExporterGoneError: as :func:`fetch`.
        TokenRefusedError: the exporter no longer holds it (its last importer released it), or
            the token was issued for another block.
        ValueError: ``address``, ``token`` or ``block`` is malformed.
    """
    msg, fds = _request(address, ACQUIRE, token, block, timeout)
    for fd in fds:
        os.close(fd)
    if msg == MISMATCH:
        raise _mismatch(address, "hold")
    if msg != OK:
        raise TokenRefusedError(
            f"the exporter ({address}) no longer holds this object: every earlier importer "
            "released it; send it again from the exporter"
        )


def release(address: str, token: bytes, *, timeout: float = 1.0, gone: bool = False) -> bool:
    """Tell the exporter that this process let go of one hold on the block under ``token``;
    True if the exporter counted it (it counts only holds this process acquired). Never raises
    for a vanished exporter (nothing is left to release), unless ``gone`` asks for its
    :class:`~gpu_serde.ExporterGoneError`."""
    try:
        msg, fds = _request(address, RELEASE, token, NO_CHECK, timeout)
    except ExporterGoneError:
        if gone:
            raise
        return False
    for fd in fds:
        os.close(fd)
    return msg == OK


def fetch(address: str, token: bytes, identity: bytes = NO_CHECK, *, timeout: float = 1.0) -> int:
    """Ask the broker at ``address`` for the descriptor behind ``token``; the caller owns (and
    closes) the returned descriptor.

    Args:
        identity: the 16-byte digest of what the payload says the descriptor is (a pool, a
            region and its size); the broker checks that the token was issued for it (a
            descriptor offered with an identity refuses the default, none).

    Raises:
        ExporterGoneError: nothing listens at ``address``, the broker belongs to another user,
            hung up without answering (it is closing, or this process runs as another user), or
            did not answer within ``timeout`` seconds.
        TokenRefusedError: the broker refused the token (unknown or revoked), or it was issued
            for another descriptor than the payload names.
        ValueError: ``address``, ``token`` or ``identity`` is malformed.
    """
    msg, fds = _request(address, FETCH, token, identity, timeout)
    if msg == OK and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if msg == MISMATCH:
        raise _mismatch(address, "descriptor")
    raise TokenRefusedError(
        f"the descriptor broker {address} refused the request: the export was released, or the "
        "token is wrong"
    )


def holds(address: str) -> int:
    """How many holds this process has at the broker at ``address`` (as this side counts them)."""
    with _links_lock:
        link = _links.get(address)
        return link.holds if link is not None else 0
