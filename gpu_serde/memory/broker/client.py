"""The descriptor broker's client side: ask another process's broker for a descriptor, and hold
the blocks it exports.

A process keeps **one connection per exporting broker** and sends every request to that broker
over it, one at a time. The broker checks nothing of what the connection says about holds: a hold
is a **lock** in the broker's holds file (:mod:`gpu_serde.memory.broker.holdsfile`), which this
process fetches once per broker (its own open file description of it), so taking a hold
(:func:`acquire`) and giving it back (:func:`release`) need no answer from the exporter: a lock,
a look at the table, and a note sent ahead on the connection (the exporter counts notes to know
which process holds what, for :meth:`~gpu_serde.memory.broker.Broker.holders`; the locks are what
it obeys). The kernel releases the locks when this process dies, however it dies.

The holds file stays open while this process holds anything there; the connection may break
without losing a hold. This process closes a connection (and the holds file with it) only when
it holds nothing there, the least recently used first, beyond :data:`MAX_IDLE` such connections.
The broker closes a connection that was silent for its idle time while no note said it held
anything; it stops reading first, so that a note sent at that moment fails here and is sent again
(a reused connection that the broker closed is opened again once: the broker never closes one
between reading a request and answering it). A new connection first notes again every hold this
process has (the broker forgot them with the old one).

The client checks the broker's uid (abstract socket names carry no permissions) and gives up after
a timeout (1 s by default) instead of hanging. The wire protocol, both sides: a request is
:data:`REQUEST_BYTES` bytes (an operation, a token, and 16 bytes: the identity a fetch expects,
which the broker checks; for an acquire's note, the count of sends again it read in the table);
descriptors arrive close-on-exec. A fetch is answered with one byte (:data:`OK` with a
descriptor, :data:`NO`: unknown or revoked; :data:`MISMATCH`: the token is real but was issued for
another descriptor; from a keeper, :data:`GONE`: the memory went with its exited exporter, and
:data:`EXPIRED`: it was kept unclaimed for its time, then given up), as is
the request for the holds file; the notes of an acquire and a release are not answered. The
server side is :mod:`gpu_serde.memory.broker.server`.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import select
import socket
import struct
import threading
import time

from gpu_serde.errors import ExporterGoneError, HandoffError, TokenRefusedError
from gpu_serde.memory.background import Background
from gpu_serde.memory.broker import holdsfile
from gpu_serde.memory.broker.holdsfile import HoldsFile, watch_forks

TOKEN_BYTES = 16
CHECK_BYTES = 16
REQUEST_BYTES = 1 + TOKEN_BYTES + CHECK_BYTES
ADDRESS_MAX = 100  # abstract socket names stay well under the 107-byte limit
FETCH = b"F"
HOLDS_FILE = b"H"
ACQUIRE = b"A"
RELEASE = b"R"
OK = b"K"
NO = b"N"
MISMATCH = b"M"
GONE = b"G"  # from a keeper: the descriptor's memory went with its exited exporter
EXPIRED = b"E"  # from a keeper: it kept the descriptor for its time, and no one took it
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
        if left <= 0:  # what already arrived counts (this thread may not have run for a while)
            sock.settimeout(0.0)
            try:
                chunk = sock.recv(n - len(data))
            except BlockingIOError:
                raise TimeoutError("request not complete by its deadline") from None
        else:
            sock.settimeout(left)
            chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


class _Link:
    """This process's connection to one broker: the socket (None until needed), the lock that
    makes its requests one at a time, its view of the broker's holds file (None until the first
    hold), and the holds it carries (token -> how many)."""

    __slots__ = ("file", "held", "holds", "lock", "locked", "pending", "sock", "used")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.file: HoldsFile | None = None
        self.held: dict[bytes, int] = {}
        # sequence number -> the token its lock was taken for, and the sends it read then
        self.locked: dict[int, tuple[bytes, int]] = {}
        self.holds = 0
        self.pending = bytearray()  # notes the socket could not take yet, in order
        self.used = 0.0

    def drop(self) -> None:
        """Close the connection and the holds file: every hold this process had at the broker is
        given back (the kernel releases the file's locks, the broker drops the connection's
        count)."""
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
        if self.file is not None:
            self.file.close()
        self.sock, self.file, self.held, self.locked, self.holds = None, None, {}, {}, 0
        self.pending.clear()


_links: dict[str, _Link] = {}
_links_lock = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child shares none of its parent's connections, nor its holds: close the inherited
    sockets and holds files (only this process's copies: the parent's connections and locks
    stay, for an open file description's locks go only with its last descriptor)."""
    global _links_lock, _flush_wanted
    _links_lock, _flush_wanted = threading.Lock(), threading.Event()
    _flusher.forget()
    links = list(_links.values())
    _links.clear()
    for link in links:  # this process's copies only: no shutdown
        if link.sock is not None:
            with contextlib.suppress(OSError):
                link.sock.close()
        if link.file is not None:
            link.file.close()


os.register_at_fork(after_in_child=_forget_after_fork)


def _link(address: str) -> _Link:
    with _links_lock:
        link = _links.get(address)
        if link is None:
            link = _links[address] = _Link()
        return link


def _close_idle(keep: int, *, wait: bool = True) -> None:
    """Close the least recently used connections that hold nothing, beyond ``keep`` of them, and
    forget the brokers that have neither a connection nor a hold here (``wait=False``: nothing,
    when another thread has the table of connections)."""
    if not _links_lock.acquire(blocking=wait):
        return
    try:
        idle = sorted(
            (link.used, address)
            for address, link in _links.items()
            if link.holds == 0 and link.sock is not None
        )
        surplus = [address for _, address in idle[: max(0, len(idle) - keep)]]
        for address in [a for a, link in _links.items() if link.sock is None and not link.holds]:
            gone = _links[address]
            if gone.lock.acquire(blocking=False):  # in use right now: kept
                try:
                    if gone.sock is None and not gone.holds:
                        gone.drop()
                        del _links[address]
                finally:
                    gone.lock.release()
    finally:
        _links_lock.release()
    for address in surplus:
        link = _links.get(address)
        if link is None or not link.lock.acquire(blocking=False):
            continue  # in use right now: not idle
        try:
            if link.holds == 0 and link.sock is not None:
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
                    f"({exc.strerror or exc}): the process that sent this exited or was killed, "
                    "and nothing keeps what it sent, or it lives in another network namespace "
                    "(container). After a normal exit, a keeper serves ArenaMemoryResource and "
                    "VirtualMemoryResource memory until its receivers let go, and a payload no "
                    "one claimed for GPU_SERDE_KEEP_S seconds (120; 0: no keeper); a memory "
                    "pool's buffers go with their process, and a killed process keeps nothing. "
                    "Send from an ArenaMemoryResource, receive sooner, or keep the sender alive "
                    "until its receivers have what it sent"
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


_FD_SPACE = socket.CMSG_SPACE(struct.calcsize("i"))


def _recv_answer(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One answer byte and the descriptor it may carry, received close-on-exec (a program this
    process runs must not inherit a holds file: its locks would outlive this process)."""
    msg, ancillary, _, _ = sock.recvmsg(1, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
    return msg, fds


def _open(link: _Link, address: str, deadline: float) -> None:
    """Connect ``link`` (its lock held), and note again over the new connection every hold this
    process has (the broker dropped its count with the old one; the locks never went)."""
    link.sock = _connect(address, deadline)
    link.used = time.monotonic()
    notes = b"".join(
        (ACQUIRE + token + sends.to_bytes(8, "big") + bytes(CHECK_BYTES - 8)) * link.held[token]
        for token, sends in link.locked.values()
    )
    if notes:
        try:
            _send_ahead(link, notes)  # nothing is pending on a new connection
        except OSError:
            _hang_up(link)
            raise


def _exchange(
    link: _Link, address: str, request: bytes, deadline: float
) -> tuple[bytes, list[int]]:
    """Send ``request`` over ``link`` (holding its lock) and read the answer; try once more on a
    new connection when one closes unanswered (the broker closed it while idle, or its process
    exited and a keeper serves the address now: a fetch and the holds file's request can be
    asked again).

    Raises:
        TimeoutError: no answer by ``deadline``.
        OSError, ExporterGoneError: the connection broke, or none could be made.
    """
    for attempt in (1, 2):
        _retire_if_idle(link)
        if link.sock is None:
            _open(link, address, deadline)
        sock = link.sock
        assert sock is not None
        try:
            _flush(link, max(0.01, deadline - time.monotonic()))  # the notes first, in order
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(request, NOSIGNAL)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            msg, fds = _recv_answer(sock)
        except (BrokenPipeError, ConnectionResetError):
            if attempt == 2:
                raise
            msg, fds = b"", []
        if msg or fds or attempt == 2:
            return msg, fds
        _hang_up(link)  # closed unanswered: no request was read
    raise AssertionError("unreachable")


#: Seconds after which a connection that holds nothing is not used again but replaced: well below
#: the broker's idle time (60 s), so that nothing is sent on one the broker may be closing.
REUSE_S = 20.0


def _retire_if_idle(link: _Link) -> None:
    """Hang up ``link``'s connection (its lock held) if it holds nothing and has been silent for
    :data:`REUSE_S`: the broker may close it at any moment, and a note it had read just before
    would be counted and then forgotten with the connection."""
    if link.sock is not None and not link.holds and time.monotonic() - link.used > REUSE_S:
        _hang_up(link)


def _hang_up(link: _Link) -> None:
    """Close ``link``'s connection, not its holds file: the locks taken through it stay (they are
    the holds), and are given back one by one, or with the file when nothing is held."""
    if link.sock is not None:
        with contextlib.suppress(OSError):
            link.sock.close()
        link.sock = None
    link.pending.clear()  # superseded: a new connection notes the holds as they stand


def _taken(address: str, timeout: float) -> _Link:
    """``address``'s link, its lock taken (the caller releases it)."""
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
            return link
        link.lock.release()  # forgotten while this thread waited for it: take the new one


def _request(
    link: _Link,
    address: str,
    op: bytes,
    token: bytes,
    check: bytes,
    deadline: float,
    timeout: float,
) -> tuple[bytes, list[int]]:
    """One request and its answer over ``link`` (its lock held)."""
    try:
        msg, fds = _exchange(link, address, op + token + check, deadline)
    except TimeoutError:
        _hang_up(link)  # an answer may still come: the framing is lost, start afresh
        raise ExporterGoneError(
            f"the descriptor broker {address} did not answer within {timeout} s"
        ) from None
    except ExporterGoneError:
        _hang_up(link)
        raise
    except OSError as exc:  # reset or broken pipe: the exporter went away mid-request
        _hang_up(link)
        raise ExporterGoneError(
            f"the descriptor broker {address} hung up ({exc.strerror or exc})"
        ) from None
    if not msg:
        for fd in fds:
            os.close(fd)
        _hang_up(link)
        raise ExporterGoneError(
            f"the descriptor broker {address} hung up without answering: it is closing, or "
            "this process runs as another user"
        )
    link.used = time.monotonic()
    return msg, fds


def _send_ahead(link: _Link, data: bytes) -> None:
    """Send ``data`` without waiting (``link``'s lock held): what the socket cannot take now (the
    exporter is slow to read) waits in ``link.pending``, sent in order by the flusher thread.

    Raises:
        OSError: the connection broke.
    """
    sock = link.sock
    assert sock is not None
    if link.pending:
        link.pending += data
        if len(link.pending) > PENDING_MAX:
            raise BlockingIOError("the exporter reads no notes")  # the caller hangs up
        _wake_flusher()  # it runs already, but for a process whose flusher could not start
        return
    if sock.gettimeout() != 0.0:
        sock.settimeout(0.0)  # non-blocking: stays so between notes
    try:
        sent = sock.send(data, NOSIGNAL)
    except BlockingIOError:
        sent = 0
    if sent < len(data):
        link.pending += data[sent:]
        _wake_flusher()


def _flush(link: _Link, timeout: float) -> None:
    """Send what waits in ``link.pending`` (its lock held), waiting up to ``timeout`` s.

    Raises:
        OSError: the connection broke or stayed full (the caller hangs up).
    """
    if link.pending and link.sock is not None:
        link.sock.settimeout(timeout)
        try:
            link.sock.sendall(bytes(link.pending), NOSIGNAL)
        finally:
            link.pending.clear()  # sent, or the caller hangs up


_flush_wanted = threading.Event()
#: Seconds the flusher waits for an exporter to read more of a connection's pending notes.
FLUSH_S = 5.0
#: Bytes of pending notes past which a connection is replaced (the new one notes the holds as
#: they stand, in one batch, whatever went before).
PENDING_MAX = 256 * 1024


def _flush_pending() -> None:
    """The flusher thread: sends every link's pending notes as its exporter reads them, all links
    at once (one slow exporter delays no other), waiting without their locks. It ends at exit
    (notes no longer matter: the process's end gives its holds back)."""
    stalled: dict[int, float] = {}  # id(link) -> when it last made progress
    while True:
        _flush_wanted.wait()
        _flush_wanted.clear()
        while True:
            with _links_lock:
                links = [link for link in _links.values() if link.pending]
            if not links or _exiting:
                stalled.clear()
                break
            waiting = []
            for link in links:
                try:
                    sock = _drain_once(link, stalled)
                except Exception:  # the flusher outlives any one link's fault: hung up
                    if link.lock.acquire(timeout=1.0):  # (its next connection notes its holds)
                        try:
                            _hang_up(link)
                        finally:
                            link.lock.release()
                    continue
                if sock is not None:
                    waiting.append(sock)
            if waiting:  # until one can take more (poll: select refuses descriptors >= 1024)
                poller = select.poll()
                for sock in waiting:
                    with contextlib.suppress(OSError, ValueError):  # closed meanwhile
                        poller.register(sock, select.POLLOUT)
                with contextlib.suppress(OSError):
                    poller.poll(50)
        if _exiting:
            return


_flusher = Background("gpu_serde-notes", _flush_pending)


def _drain_once(link: _Link, stalled: dict[int, float]) -> socket.socket | None:
    """One non-blocking send of ``link``'s pending notes; the socket when some are left. A link
    that made no progress for :data:`FLUSH_S`, or whose backlog passed :data:`PENDING_MAX`, is hung
    up (its next connection notes the holds as they stand)."""
    if not link.lock.acquire(timeout=0.05):
        return None  # in use: a request flushes it itself, or the next round does
    try:
        sock, now = link.sock, time.monotonic()
        if not link.pending or sock is None:
            stalled.pop(id(link), None)
            return None
        try:
            if sock.gettimeout() != 0.0:
                sock.settimeout(0.0)
            with memoryview(link.pending) as view:
                sent = sock.send(view, NOSIGNAL)
            del link.pending[:sent]
            stalled[id(link)] = now
        except BlockingIOError:
            if now - stalled.setdefault(id(link), now) > FLUSH_S:
                _hang_up(link)
        except OSError:
            _hang_up(link)
        return sock if link.pending else None
    finally:
        link.lock.release()


_exiting = False


def _stop_flusher_at_exit() -> None:
    global _exiting
    _exiting = True
    flusher = _flusher.close()
    if flusher is not None:
        _flush_wanted.set()
        flusher.join(1.0)


atexit.register(_stop_flusher_at_exit)


def _wake_flusher() -> None:
    _flusher.start()
    _flush_wanted.set()


def _note(
    link: _Link,
    address: str,
    op: bytes,
    token: bytes,
    check: bytes,
    timeout: float,
    *,
    connect: bool = True,
) -> bool:
    """Send a note (an acquire or a release: no answer) over ``link`` (its lock held); False when
    it could not be sent. A connection that broke is replaced once, and the new one carries this
    process's holds as they stand (an acquire's note is sent before the hold is recorded, a
    release's after: the new connection's notes then say it already). Losing a note loses no
    hold: the locks are what the exporter obeys, and an acquire's note lost only keeps the block
    longer. A release with no connection to send it on needs none: the broker dropped the closed
    connection's counts, this one's too; a new one is made only to note again the holds left
    (never with ``connect=False``: the next request's connection notes them)."""
    _retire_if_idle(link)
    for _ in range(2):
        fresh = link.sock is None
        if fresh and op == RELEASE and (not connect or not link.holds):
            return True
        try:
            if fresh:
                _open(link, address, time.monotonic() + timeout)
                if op == RELEASE:
                    return True
            _send_ahead(link, op + token + check)
        except (OSError, ExporterGoneError):  # TimeoutError too: the framing may be lost
            _hang_up(link)
            if fresh:
                return False
            continue
        link.used = time.monotonic()
        return True
    return False


def _holds_file(link: _Link, address: str, deadline: float, timeout: float) -> HoldsFile:
    """The broker's holds file, as this process sees it: fetched over ``link`` the first time."""
    if link.file is not None:
        return link.file
    watch_forks()  # a fork while the descriptor is on its way leaves the child no copy of it
    msg, fds = _request(link, address, HOLDS_FILE, bytes(TOKEN_BYTES), NO_CHECK, deadline, timeout)
    if msg != OK or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        _hang_up(link)
        raise ExporterGoneError(
            f"the descriptor broker {address} did not hand over its holds file: not a broker "
            "of this version of gpu_serde"
        )
    try:
        link.file = HoldsFile(fds[0])
    except BaseException:
        os.close(fds[0])
        _hang_up(link)
        raise
    return link.file


def _mismatch(address: str, what: str) -> HandoffError:
    return TokenRefusedError(
        f"the exporter ({address}) refused this {what}: its token was issued for another block "
        "or descriptor than the payload names (a forged or corrupted payload)"
    )


def _went_with_it(address: str) -> ExporterGoneError:
    return ExporterGoneError(
        f"the exporting process behind the descriptor broker {address} has exited, and this "
        "memory went with it: a memory pool's is freed with its process (an "
        "ArenaMemoryResource's or a VirtualMemoryResource's is kept for its receivers; "
        "allocate what a short-lived process sends there)"
    )


def _expired(address: str) -> ExporterGoneError:
    return ExporterGoneError(
        f"the exporting process behind the descriptor broker {address} has exited; its keeper "
        "kept this memory for receivers for GPU_SERDE_KEEP_S seconds (120 by default), and none "
        "took it in that time: receive it sooner, or raise GPU_SERDE_KEEP_S in the exporter"
    )


def _let_go(address: str) -> TokenRefusedError:
    return TokenRefusedError(
        f"the exporter ({address}) no longer holds this object: every earlier importer "
        "released it; send it again from the exporter"
    )


def acquire(address: str, token: bytes, block: bytes = NO_CHECK, *, timeout: float = 1.0) -> None:
    """Hold the block that the exporter at ``address`` issued ``token`` for, in this process. The
    hold is this process's: only it can release it (:func:`release`), and it goes when the
    process exits or dies. No answer is awaited: the hold is a lock in the broker's holds file
    (fetched, with a round trip, the first time), and the exporter is told with a note.

    Args:
        block: the 16-byte digest of the block the payload names; the hold must have been issued
            for it (a hold issued for a block refuses the default, none).

    Raises:
        ExporterGoneError: as :func:`fetch`; or the exporter exited.
        TokenRefusedError: the exporter no longer holds it (its last importer released it), the
            token is unknown, or it was issued for another block.
        ValueError: ``address``, ``token`` or ``block`` is malformed.
    """
    _check_request(address, token, block)
    link = _taken(address, timeout)
    try:
        deadline = time.monotonic() + timeout
        file = _holds_file(link, address, deadline, timeout)
        seq = holdsfile.seq_of(token)
        # a lock is one per byte, not a count: taken once per sequence number, whatever token
        # names it (a forged token that shares a held one's number must not unlock it)
        first = seq not in link.locked
        try:
            refused = seq == holdsfile.ALIVE or (
                first and not holdsfile.try_lock(file.fd, fcntl.F_RDLCK, seq)
            )
        except OSError as exc:  # ENOLCK...: the kernel's lock table is full
            raise HandoffError(
                f"this process could not take a hold on memory exported by {address}: the "
                f"kernel refused a lock in its holds file ({exc.strerror or exc})"
            ) from None
        if refused:
            if seq != holdsfile.ALIVE and file.slot(seq)[::2] == (token, holdsfile.EXPIRED):
                raise _expired(address)
            raise _let_go(address)  # let go: the exporter write-locked it
        try:
            issued, held_block, sends = file.slot(seq)
            if issued != token:
                raise _let_go(address)  # never issued (the slot is another hold's, or empty)
            if held_block != NO_CHECK and held_block != block:
                raise _mismatch(address, "hold")
            if sends == holdsfile.GONE:
                raise _went_with_it(address)
            if not holdsfile.write_locked(file.fd, holdsfile.ALIVE):
                link.drop()
                raise ExporterGoneError(
                    f"the exporting process behind the descriptor broker {address} has exited "
                    "or was killed, and this memory went with it: a killed process keeps "
                    "nothing, and a memory pool's buffers go with their process (after a "
                    "normal exit, a keeper serves ArenaMemoryResource and VirtualMemoryResource "
                    "memory until its receivers let go). Keep the sender alive until its "
                    "receivers have what it sent, or send from an ArenaMemoryResource"
                )
        except BaseException:
            if first and link.file is file:
                holdsfile.unlock(file.fd, seq)
            raise
        echo = sends.to_bytes(8, "big") + bytes(CHECK_BYTES - 8)  # which payload it was
        _note(link, address, ACQUIRE, token, echo, timeout)
        link.locked[seq] = (token, sends)
        link.held[token] = link.held.get(token, 0) + 1
        link.holds += 1
    finally:
        link.lock.release()
        if link.holds == 0:
            _close_idle(MAX_IDLE)


def release(
    address: str, token: bytes, *, timeout: float = 1.0, gone: bool = False, wait: bool = True
) -> bool | None:
    """Give back one of this process's holds on the block under ``token``: the last one unlocks
    it, and the exporter is told with a note. True if this process held it (a process can
    release only its own holds). Never raises for a vanished exporter (nothing is left to
    release), unless ``gone`` asks for its :class:`~gpu_serde.ExporterGoneError` when the note
    could be neither sent nor queued. ``wait=False`` (a caller that may run inside this
    module's own locked sections: a collection) takes no lock it would wait for, makes no new
    connection and wakes no thread: None, and nothing done, when the connection is in use, gone,
    or has notes waiting for the flusher."""
    if wait:
        with _links_lock:
            link = _links.get(address)
    else:
        link = _links.get(address)  # one dict read: atomic
    if link is None or token not in link.held:
        return False
    if not link.lock.acquire(blocking=wait):
        return None
    if not wait and (link.sock is None or link.pending):
        link.lock.release()
        return None
    try:
        n = link.held.get(token, 0)
        if not n or link.file is None:
            return False
        if n == 1:
            del link.held[token]
            del link.locked[holdsfile.seq_of(token)]
            holdsfile.unlock(link.file.fd, holdsfile.seq_of(token))
        else:
            link.held[token] = n - 1
        link.holds -= 1
        told = _note(link, address, RELEASE, token, NO_CHECK, timeout, connect=wait)
        if not told and gone:
            raise ExporterGoneError(f"the descriptor broker {address} could not be told")
        return True
    finally:
        link.lock.release()
        if link.holds == 0:
            _close_idle(MAX_IDLE, wait=wait)


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
    _check_request(address, token, identity)
    link = _taken(address, timeout)
    try:
        msg, fds = _request(
            link, address, FETCH, token, identity, time.monotonic() + timeout, timeout
        )
    finally:
        link.lock.release()
        if link.holds == 0:
            _close_idle(MAX_IDLE)
    if msg == OK and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    if msg == MISMATCH:
        raise _mismatch(address, "descriptor")
    if msg == GONE:
        raise _went_with_it(address)
    if msg == EXPIRED:
        raise _expired(address)
    raise TokenRefusedError(
        f"the descriptor broker {address} refused the request: the export was released, or the "
        "token is wrong"
    )


def exited(address: str, *, holding: bool = False, timeout: float = 1.0) -> bool:
    """True when the exporter behind the broker at ``address`` has exited and a keeper serves
    what it kept (its GPU work is done: no event of it needs waiting for). Fetches the broker's
    holds file the first time (one round trip). ``holding=True`` says that the caller holds a
    hold there (its holds file stays open meanwhile): then the file is read without waiting for
    the connection's lock, which the release thread may hold.

    Raises:
        ExporterGoneError: as :func:`acquire`.
    """
    if holding:
        link = _links.get(address)
        file = link.file if link is not None else None
        if file is not None and file.fd >= 0:
            return file.exited()
    link = _taken(address, timeout)
    try:
        file = _holds_file(link, address, time.monotonic() + timeout, timeout)
        return file.exited()
    finally:
        link.lock.release()


def holds(address: str) -> int:
    """How many holds this process has at the broker at ``address``."""
    with _links_lock:
        link = _links.get(address)
        return link.holds if link is not None else 0
