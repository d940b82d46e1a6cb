"""The descriptor broker: hands file descriptors to same-user processes here, and owns the holds
that keep exported memory alive for them.

One broker per exporting process, started on first use: a daemon thread serving an abstract Unix
socket, and a thread per connection. A peer asks with a 128-bit token; the broker answers only
peers of the same uid (``SO_PEERCRED``) and passes a descriptor with ``SCM_RIGHTS``. The client
checks the broker's uid too (abstract socket names carry no permissions), and gives up after a
timeout instead of hanging. Descriptors the broker serves are its own duplicates, closed on
:meth:`Broker.revoke`, on :meth:`Broker.close` and at exit. The protocol is described in
:mod:`gpu_serde.memory.broker.client`.

**Holds are locks, and belong to their process.** The exporter keeps a sent object alive under a
token (:meth:`Broker.hold`) that names the block it was issued for, in its holds file
(:mod:`~gpu_serde.memory.broker.holdsfile`). An importer holds it by read-locking its byte there,
through an open file description of its own, and tells the broker with a note that needs no
answer; it releases by unlocking, and a note. The broker counts the notes per connection (which
process holds what: :meth:`Broker.holders`), and lets an object go only when no note says it is
held and it can write-lock its byte: the kernel refuses that while any process holds the read
lock, and releases a process's locks when it dies, however it dies. A release counts only against
holds noted over the same connection, and unlocks only the releasing process's own lock, so a
process that never acquired (a Dask scheduler that saw the payload) cannot release anything. When
a connection closes (the importer exited, was killed, or closed it), its notes are dropped at
once. An object whose holds are all gone is let go :data:`grace <Broker.hold>` seconds later,
unless it is acquired again in the meantime. A connection is closed for idleness only while no
note says it holds anything (its process replaces one that holds nothing before the broker's idle
time comes near).

**When this process exits normally**, what it still holds on memory that a descriptor keeps
allocated (arena regions, VMM buffers: offered with ``keep``) is handed to a keeper process that
serves the same address on (:meth:`Broker.to_keep`, :mod:`~gpu_serde.memory.broker.keeper`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import math
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpu_serde.memory.broker import holdsfile
from gpu_serde.memory.broker.client import (
    ACQUIRE,
    CHECK_BYTES,
    EXPIRED,
    FETCH,
    GONE,
    HOLDS_FILE,
    MISMATCH,
    NO,
    NOSIGNAL,
    OK,
    RELEASE,
    REQUEST_BYTES,
    TOKEN_BYTES,
    peer_credentials,
    recv_by,
)

#: Seconds a broker keeps a silent connection that holds nothing open.
IDLE_S = 60.0
#: Seconds a request may take from its first byte to its last (a slow peer holds a broker thread
#: at most this long per request, however it paces its bytes).
REQUEST_S = 1.0
ANY = bytes(CHECK_BYTES)  #: offered or held without a check: any payload may name it
BATCH_BYTES = REQUEST_BYTES * 1985  # read at once from a connection: whole requests, 64 KiB
#: Seconds before the broker tries again to let go of an object whose lock a process still held
#: when its grace ran out (its acquire's note was on its way).
RETRY_S = 0.05


@dataclass
class _Hold:
    """One object kept alive for importers: what it was issued for, who holds it, and when it
    is due to be let go."""

    obj: Any
    seq: int  # its byte in the holds file
    block: bytes
    on_release: Callable[[Any], None]
    grace: float
    holders: dict[int, int] = field(default_factory=dict)  # connection id -> holds over it
    due: float | None = None  # monotonic time to let go (its holders all gone), else None
    unclaimed: bool = True  # sent since its last acquire: kept until the next one
    sends: int = 0  # times sent again: a note echoing fewer was for an earlier payload
    retry: float = 0.0  # seconds before the next try to let go, while a lock is still held
    needs: bytes | None = None  # the offer (descriptor token) a keeper must serve for it
    since: float = field(default_factory=time.monotonic)  # when it was last sent, or kept
    free_since: float | None = None  # in a keeper: when its lock was first seen free
    expired: bool = False  # in a keeper: kept KEEP_S unclaimed, then given up


@dataclass(frozen=True)
class Kept:
    """What a keeper process needs to serve a broker's memory after its process exits
    (:meth:`Broker.to_keep`): the descriptors to pass it (the listening socket, the holds file,
    the kept offers'), and the state, plain data."""

    fds: list[int]
    state: dict[str, Any]
    ready: list[Callable[[], None]]  # what makes the kept memory ready to outlive this process


class Broker:
    """Serves descriptors to same-user processes that present the right token, and keeps
    exported objects alive while importing processes hold them."""

    def __init__(
        self,
        *,
        sock: socket.socket | None = None,
        file: holdsfile.HoldsFile | None = None,
        kept: tuple[dict[str, Any], dict[int, int]] | None = None,
    ) -> None:
        """A new broker, or (in a keeper process) one that goes on serving the listening socket
        ``sock`` and the holds file ``file`` of an exiting process, with the holds and offers of
        ``kept``: its :meth:`to_keep` state, and its descriptor numbers -> this process's."""
        self._lock = threading.Lock()
        self._fds: dict[bytes, tuple[int, bytes]] = {}  # token -> (descriptor, identity)
        # token -> what makes the offer's memory ready to outlive this process: offers a keeper
        # may serve after it exits (memory that its descriptor keeps allocated)
        self._keepable: dict[bytes, Callable[[], None]] = {}
        self._gone: set[bytes] = set()  # in a keeper: offers whose memory went with the exporter
        self._expired: set[bytes] = set()  # in a keeper: offers let go with a hold given up
        self._holds: dict[bytes, _Hold] = {}
        self._held_over: dict[int, dict[bytes, int]] = {}  # connection id -> token -> holds
        self._peers: dict[int, int] = {}  # connection id -> the peer's pid (0: unknown)
        self._closed = False
        self._file = file if file is not None else holdsfile.HoldsFile.create()
        self._seq = holdsfile.ALIVE
        self._slots: set[int] = {holdsfile.ALIVE}  # table slots in use: the holds', the header
        self._exiting = False  # set at exit: nothing is let go any more
        self._accepting = True  # False once handed to a keeper
        self._conns: dict[socket.socket, threading.Thread] = {}  # connections being served
        self._due = threading.Event()  # an object is due sooner than the release thread planned
        self._wake_at = math.inf  # when the release thread plans to look next (with the lock)
        self._wake_r, self._wake_w = os.pipe()  # wakes the serving thread (a close, a hand-off)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(f"\0gpu_serde-{os.getpid()}-{secrets.token_hex(8)}")
            sock.listen(512)
        self._sock = sock
        name = sock.getsockname()  # abstract: b"\0" and the name
        self.address = "@" + (name.decode() if isinstance(name, bytes) else name)[1:]
        self._handed_off = False  # to a keeper: nothing new is held or offered here
        # a keeper: the holders' notes went with the exporter's connections, so a hold's lock
        # says when it was last held (it is let go ``grace`` s after it is first seen free)
        self._adopted = kept is not None
        if kept is not None:
            self._adopt(*kept)  # before a connection is served
        self._thread = threading.Thread(target=self._serve, name="gpu_serde-broker", daemon=True)
        self._thread.start()
        self._letting_go = threading.Thread(
            target=self._release_loop, name="gpu_serde-broker-release", daemon=True
        )
        self._letting_go.start()

    # ---- descriptors ----
    def offer(
        self, fd: int, identity: bytes = ANY, *, keep: Callable[[], None] | None = None
    ) -> bytes:
        """Serve a duplicate of ``fd`` (the caller keeps its own) and return the token for it.

        ``identity`` (16 bytes) names what the descriptor is (a pool, a region and its size): a
        fetch that expects anything else is refused. ``keep`` marks a descriptor that keeps its
        memory allocated by itself (a VMM allocation's): when this process exits while holds on
        that memory are unclaimed or held, a keeper process serves it on (:meth:`to_keep`);
        ``keep()`` then runs first, and makes the memory ready to outlive this process (it
        waits for the GPU's work on it).
        """
        token = secrets.token_bytes(TOKEN_BYTES)
        dup = os.dup(fd)
        with self._lock:
            if self._closed or self._handed_off:
                os.close(dup)
                raise RuntimeError("the descriptor broker is closed")
            self._fds[token] = (dup, identity)
            if keep is not None:
                self._keepable[token] = keep
        return token

    def revoke(self, token: bytes) -> None:
        """Stop serving ``token`` and close the broker's descriptor for it (unknown: no-op)."""
        with self._lock:
            entry = self._fds.pop(token, None)
            self._keepable.pop(token, None)
        if entry is not None:
            os.close(entry[0])

    def __len__(self) -> int:
        with self._lock:
            return len(self._fds)

    # ---- holds ----
    def hold(
        self,
        obj: object,
        on_release: Callable[[Any], None],
        *,
        block: bytes = ANY,
        grace: float = 0.0,
        needs: bytes | None = None,
    ) -> bytes:
        """Keep ``obj`` alive for importers; return its token.

        ``block`` (16 bytes) names the block the hold is issued for: an acquire for any other
        block is refused. Once every process that acquired it has released it (or its connection
        closed), the broker waits ``grace`` seconds (a new acquire in that time keeps it), then
        drops it and calls ``on_release(obj)`` in the broker's release thread (a slow callback
        delays no reply). An object never acquired (or sent again, :meth:`sent_again`, and not
        acquired since) is kept until :meth:`close` or exit. ``needs`` names the offer (its
        token) that an importer fetches to map the memory: when it was offered with ``keep``,
        a keeper serves the hold on after this process exits (:meth:`to_keep`).
        """
        with self._lock:
            if self._closed or self._handed_off:
                raise RuntimeError("the descriptor broker is closed")
            seq = self._next_seq()
            token = seq.to_bytes(8, "big") + secrets.token_bytes(TOKEN_BYTES - 8)
            self._file.write(seq, token, block)
            self._slots.add(seq % holdsfile.SLOTS)
            self._holds[token] = _Hold(obj, seq, block, on_release, grace, needs=needs)
        return token

    def _next_seq(self) -> int:
        """The next hold's sequence number, whose table slot is free (with the lock)."""
        for _ in range(holdsfile.SLOTS):
            self._seq += 1
            if self._seq % holdsfile.SLOTS not in self._slots:
                return self._seq
        raise RuntimeError(
            f"this process holds {holdsfile.SLOTS:,} sent objects for importers, the most a "
            "broker can: let importers free what they received"
        )

    def sent_again(self, token: bytes, obj: object) -> bool:
        """``obj``, held under ``token``, was sent again: keep it until it is acquired again, as a
        hold that was never acquired (a payload may wait in Ray's object store, or in a Dask
        graph, longer than the grace period). One flag, not a count: a payload pickled and never
        delivered (a scheduler's copy for a worker that died) must not pin the memory for good, so
        of several payloads in flight at once, the first acquire ends the wait, and the others
        are covered by the grace period. False when ``token`` no longer holds ``obj`` (send it
        under a new hold)."""
        with self._lock:
            entry = self._holds.get(token)
            if entry is None or entry.obj is not obj or self._handed_off:
                return False
            entry.unclaimed, entry.due, entry.since = True, None, time.monotonic()
            entry.sends += 1
            self._file.write_sends(entry.seq, entry.sends)  # before the new payload leaves
            return True

    def peek(self, token: bytes, block: bytes | None = None) -> object | None:
        """The object held under ``token`` (and issued for ``block``, when given), or None."""
        with self._lock:
            entry = self._holds.get(token)
            if entry is None or (block is not None and entry.block not in (ANY, block)):
                return None
            obj: object = entry.obj
            return obj

    def unclaimed(self, token: bytes) -> bool:
        """True while the object under ``token`` was sent (or sent again) and no process has
        taken its hold since: it is kept until one does, or until this process exits."""
        with self._lock:
            entry = self._holds.get(token)
            return entry is not None and entry.unclaimed

    def held(self) -> int:
        """How many objects the broker keeps alive for importers."""
        with self._lock:
            return len(self._holds)

    def holders(self) -> dict[int, int]:
        """The live holds by the importing process's pid (0: a process in another PID
        namespace): what each process has acquired and not yet released."""
        out: dict[int, int] = {}
        with self._lock:
            for conn, tokens in self._held_over.items():
                pid = self._peers.get(conn, 0)
                out[pid] = out.get(pid, 0) + sum(tokens.values())
        return out

    def _acquire(self, conn: int, token: bytes, sends: bytes) -> bytes:
        """An importer's note that it holds ``token``: count it. ``sends`` (8 bytes) echoes the
        count of sends again the importer read in the table after taking its lock: a note for an
        earlier payload (it may arrive after the object was sent again) leaves the new one
        unclaimed."""
        with self._lock:
            entry = self._holds.get(token)
            if entry is None:
                return NO  # unknown, or let go already (the importer's lock was refused)
            entry.holders[conn] = entry.holders.get(conn, 0) + 1
            entry.due, entry.retry = None, 0.0
            if int.from_bytes(sends[:8], "big") >= entry.sends:
                entry.unclaimed = False
            tokens = self._held_over.setdefault(conn, {})
            tokens[token] = tokens.get(token, 0) + 1
        return OK

    def _release(self, conn: int, token: bytes) -> bytes:
        with self._lock:
            tokens = self._held_over.get(conn)
            if not tokens or not tokens.get(token):
                return NO  # not held over this connection: another process's, or none
            sooner = self._let_one_go(conn, token, tokens, 1)
        if sooner:  # else the release thread wakes in time anyway: one wake-up less per release
            self._due.set()
        return OK

    def _let_one_go(self, conn: int, token: bytes, tokens: dict[bytes, int], n: int) -> bool:
        """Take ``n`` holds of ``token`` off connection ``conn`` (with the lock). True when that
        makes the object due before the release thread's next look (it must be woken)."""
        left = tokens[token] - n
        if left > 0:
            tokens[token] = left
        else:
            del tokens[token]
            if not tokens:
                self._held_over.pop(conn, None)
        entry = self._holds.get(token)
        if entry is None:
            return False
        count = entry.holders.get(conn, 0) - n
        if count > 0:
            entry.holders[conn] = count
        else:
            entry.holders.pop(conn, None)
        if not entry.holders and not entry.unclaimed:
            entry.due = time.monotonic() + entry.grace
            return entry.due < self._wake_at
        return False

    def _connection_gone(self, conn: int) -> None:
        """Drop every hold taken over connection ``conn`` (its process exited, died, or closed
        it)."""
        with self._lock:
            self._peers.pop(conn, None)
            tokens = self._held_over.get(conn)
            if not tokens:
                return
            sooner = False
            for token, n in list(tokens.items()):
                sooner = self._let_one_go(conn, token, tokens, n) or sooner
        if sooner:
            self._due.set()

    def _holds_over(self, conn: int) -> bool:
        with self._lock:
            return bool(self._held_over.get(conn))

    def _release_loop(self) -> None:
        """The release thread: lets go of objects once their grace has passed. It is woken only
        for an object due before the look it planned (a release at the default grace is due
        after the objects released before it: no wake-up)."""
        while not self._closed and not self._exiting:
            with self._lock:
                due = min((e.due for e in self._holds.values() if e.due is not None), default=None)
                self._wake_at = math.inf if due is None else due
            self._due.wait(None if due is None else max(0.0, due - time.monotonic()))
            self._due.clear()  # what was set after this is in the table: the next look sees it
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
        """Let go of objects whose holders all went more than ``grace`` s ago, and which no
        process holds a lock on (one whose acquire's note is still on its way is kept)."""
        now = time.monotonic()
        dropped = []
        with self._lock:
            for token, entry in list(self._holds.items()):
                if entry.due is None or entry.due > now:
                    continue
                if self._adopted and not self._free_for_grace(entry, now):
                    continue
                if not holdsfile.try_lock(self._file.fd, fcntl.F_WRLCK, entry.seq):
                    # held: its note will come, or the lock will go (backing off to 1 s)
                    entry.retry = min(1.0, max(RETRY_S, 2 * entry.retry))
                    entry.due = now + entry.retry
                    entry.free_since = None
                    continue
                dropped.append(self._holds.pop(token))  # the write lock stays: refused for good
                self._slots.discard(entry.seq % holdsfile.SLOTS)
                if entry.expired:  # an importer refused is told why
                    self._file.write_sends(entry.seq, holdsfile.EXPIRED)
                    if entry.needs is not None:
                        self._expired.add(entry.needs)
        for entry in dropped:
            obj, on_release = entry.obj, entry.on_release
            entry.obj = None
            with contextlib.suppress(Exception):  # the exporter's callback must not kill the broker
                on_release(obj)
            del obj

    # ---- a keeper serves on after this process exits ----
    def to_keep(self) -> Kept | None:
        """At exit (the release thread stopped): let go of what no importer needs any more, and
        say what a keeper process must serve on; None when nothing is left to keep.

        A hold is kept when its memory was offered with ``keep`` and a payload of it is not yet
        claimed, or an importer holds it (its lock). A claimed hold that no process holds is let
        go now (its byte write-locked; no callback runs: this process is ending). Every other
        hold (memory that goes with this process, a pool's) is marked gone in the holds file:
        an importer's acquire then says that its exporter exited.
        """
        with self._lock:
            if self._closed:
                return None
            kept: list[tuple[bytes, _Hold]] = []
            for token, entry in list(self._holds.items()):
                keepable = entry.needs is not None and entry.needs in self._keepable
                if keepable and (entry.unclaimed or entry.holders):
                    kept.append((token, entry))
                elif holdsfile.try_lock(self._file.fd, fcntl.F_WRLCK, entry.seq):
                    del self._holds[token]
                    self._slots.discard(entry.seq % holdsfile.SLOTS)
                elif keepable:
                    kept.append((token, entry))  # a process holds its lock: its note is late
                else:
                    self._file.write_sends(entry.seq, holdsfile.GONE)
            if not kept:
                return None
            needed = {entry.needs for _, entry in kept}
            offers = {t: self._fds[t] for t in needed if t is not None and t in self._fds}
            state = {
                "sock": self._sock.fileno(),
                "file": self._file.fd,
                "seq": self._seq,
                "offers": [[t.hex(), fd, identity.hex()] for t, (fd, identity) in offers.items()],
                "gone": [t.hex() for t in self._fds if t not in offers],  # go with this process
                "holds": [
                    [
                        t.hex(),
                        e.block.hex(),
                        e.sends,
                        e.unclaimed,
                        e.grace,
                        (e.needs or b"").hex(),
                    ]
                    for t, e in kept
                ],
            }
            fds = [self._sock.fileno(), self._file.fd, *(fd for fd, _ in offers.values())]
            ready = list({_same(f): f for t, f in self._keepable.items() if t in offers}.values())
            self._handed_off = True  # nothing new is held or offered: it would not be kept
        return Kept(fds, state, ready)

    def stop_accepting(self) -> None:
        """Accept no more connections here (a keeper accepts them from now on); the serving
        thread ends. Connections already made are served until this process ends."""
        self._accepting = False
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def mark_exited(self) -> None:
        """Say in the holds file that this process has exited and its GPU work is done (an
        importer then waits for no event of this process)."""
        self._file.mark_exited()

    def _adopt(self, state: dict[str, Any], fds: dict[int, int]) -> None:
        """In a keeper: take over the holds and offers of ``state`` (from :meth:`to_keep`);
        ``fds`` maps the exiting process's descriptor numbers to this process's."""
        now = time.monotonic()
        with self._lock:
            self._seq = int(state["seq"])
            self._gone = {bytes.fromhex(t) for t in state["gone"]}
            for token, fd, identity in state["offers"]:
                self._fds[bytes.fromhex(token)] = (fds[int(fd)], bytes.fromhex(identity))
            for token, block, sends, unclaimed, grace, needs in state["holds"]:
                t = bytes.fromhex(token)
                entry = _Hold(None, holdsfile.seq_of(t), bytes.fromhex(block), self._let_go, grace)
                entry.sends, entry.unclaimed, entry.since = int(sends), bool(unclaimed), now
                entry.needs = bytes.fromhex(needs) or None
                entry.due = None if unclaimed else now  # claimed: free once its lock is
                self._holds[t] = entry
                self._slots.add(entry.seq % holdsfile.SLOTS)

    def _free_for_grace(self, entry: _Hold, now: float) -> bool:
        """For a hold whose holders the keeper cannot know (with the lock): True once no process
        has held its lock for its grace period, as far as the keeper has looked; else when to
        look again is set."""
        if holdsfile.locked_by_others(self._file.fd, entry.seq):
            entry.free_since = None
            entry.retry = min(1.0, max(RETRY_S, 2 * entry.retry))
            entry.due = now + entry.retry
            return False
        if entry.expired and not entry.holders:
            return True  # never claimed: no hop's next importer to wait for
        if entry.free_since is None:
            entry.free_since = now
        if now - entry.free_since < entry.grace:
            entry.due = entry.free_since + entry.grace
            return False
        return True

    def _let_go(self, _obj: Any) -> None:
        """A keeper's ``on_release``: close the descriptors no hold left needs (their memory
        goes once the importers' mappings go)."""
        with self._lock:
            needed = {entry.needs for entry in self._holds.values()}
            unneeded = [t for t in self._fds if t not in needed]
        for token in unneeded:
            self.revoke(token)

    def alive(self) -> bool:
        """True while the broker serves and its release thread runs."""
        return not self._closed and self._letting_go.is_alive()

    def expire_unclaimed(self, after: float) -> None:
        """Treat as claimed (and so let go once no process holds its lock) every hold sent
        ``after`` seconds ago or more and never acquired since: a keeper keeps no payload for
        ever. An importer refused one later is told that it expired."""
        now = time.monotonic()
        with self._lock:
            for entry in self._holds.values():
                if entry.unclaimed and now - entry.since >= after:
                    entry.unclaimed, entry.expired = False, True
                    if not entry.holders:
                        entry.due = now
        self._due.set()

    def close(self, *, inherited: bool = False) -> None:
        """Stop serving and close every descriptor the broker holds, its connections' too.

        ``inherited=True`` (in a forked child) only closes this process's copies: shutting the
        sockets down would stop the parent's broker too, since both share them.
        """
        with self._lock:
            self._closed = True
            fds, self._fds = [fd for fd, _ in self._fds.values()], {}
            self._holds.clear()
            self._held_over.clear()
            conns, self._conns = list(self._conns.items()), {}
        self._due.set()  # the release thread ends
        if not inherited:  # (a forked child's pipe is its parent's too)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")  # the serving thread ends
        for fd in fds:
            os.close(fd)
        self._file.close()  # the exporter's locks go (when it is the last copy): importers see it
        if not inherited:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the serving thread's accept
        self._sock.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                if inherited:
                    conn.close()  # no thread serves it here
                else:
                    conn.shutdown(socket.SHUT_RDWR)  # its thread sees the end and closes it
        if not inherited:
            for _, thread in conns:  # (one not started yet finds its connection shut down)
                if thread is not threading.current_thread() and thread.ident is not None:
                    thread.join(1.0)

    # ---- serving ----
    def _serve(self) -> None:
        self._sock.settimeout(0.25)  # wake up now and then to notice a close
        poller = select.poll()  # not select(): descriptors past 1024 are common in workers
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            with contextlib.suppress(OSError):
                for fd, _ in poller.poll(250):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 64)
            if self._closed or not self._accepting:
                return
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)  # EMFILE, ECONNABORTED...: keep serving
                continue
            if not self._accepting:  # handed to a keeper meanwhile: it serves, not this one
                conn.close()
                return
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
        key = id(conn)
        try:
            with conn, contextlib.suppress(OSError):
                pid, uid = peer_credentials(conn)
                if uid != os.getuid():
                    return  # other users get nothing, not even an answer
                with self._lock:
                    self._peers[key] = pid
                while self._answer(conn, key):
                    pass
        finally:
            self._connection_gone(key)  # before the id can be reused by a new socket
            with self._lock:
                self._conns.pop(conn, None)

    def _answer(self, conn: socket.socket, key: int) -> bool:
        """Handle the requests that have arrived on ``conn``, in order: notes come in batches,
        and a batch costs one wake-up of this thread (an exporter busy in Python has few to
        give). False when the connection is done (the peer hung up, sent a malformed request, or
        was silent for :data:`IDLE_S` while nothing was noted as held over it). Raises
        ``TimeoutError`` when a request is not complete :data:`REQUEST_S` after its first byte."""
        conn.settimeout(None if self._holds_over(key) else IDLE_S)
        try:
            data = conn.recv(BATCH_BYTES)
        except TimeoutError:
            self._close_idle(conn, key)
            return False
        if not data:
            return False
        whole = len(data) - len(data) % REQUEST_BYTES
        if whole < len(data):  # the rest of the last request must come within one deadline
            deadline = time.monotonic() + REQUEST_S
            data = data[:whole] + recv_by(conn, data[whole:], REQUEST_BYTES, deadline)
        for at in range(0, len(data), REQUEST_BYTES):
            if not self._dispatch(conn, key, data[at : at + REQUEST_BYTES]):
                return False
        return True

    def _close_idle(self, conn: socket.socket, key: int) -> None:
        """End a silent connection without losing a note: stop its reading first (the peer's
        next send fails, and it connects again), then handle what it had sent already."""
        conn.shutdown(socket.SHUT_RD)
        conn.settimeout(REQUEST_S)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
        for at in range(0, len(data) - REQUEST_BYTES + 1, REQUEST_BYTES):
            if not self._dispatch(conn, key, data[at : at + REQUEST_BYTES]):
                return

    def _dispatch(self, conn: socket.socket, key: int, request: bytes) -> bool:
        """Handle one request (answer it, or count a note); False when the framing is lost."""
        conn.settimeout(REQUEST_S)  # the answer, too, is bounded: a peer that never reads
        op, token, check = request[:1], request[1:17], request[17:]
        if len(request) != REQUEST_BYTES or op not in (FETCH, ACQUIRE, RELEASE, HOLDS_FILE):
            conn.sendall(NO, NOSIGNAL)
            return False  # the framing is lost: the peer reconnects
        if op == ACQUIRE:  # notes: not answered
            self._acquire(key, token, check)
            return True
        if op == RELEASE:
            self._release(key, token)
            return True
        if op == HOLDS_FILE:
            with self._lock:  # not while the broker closes (the number may be reused)
                own = None if self._closed else self._file.reopened()
            if own is None:
                return False
            try:  # the importer's own open file description: its locks
                socket.send_fds(conn, [OK], [own], NOSIGNAL)
            finally:
                os.close(own)
            return True
        with self._lock:
            entry = self._fds.get(token)
            answer = OK
            if entry is None:
                answer = GONE if token in self._gone else EXPIRED if token in self._expired else NO
            if entry is not None and entry[1] != ANY and entry[1] != check:
                answer = MISMATCH
            fd = os.dup(entry[0]) if answer == OK and entry is not None else None
        if fd is None:  # survives a concurrent revoke while it is sent
            conn.sendall(answer, NOSIGNAL)
            return True
        try:
            socket.send_fds(conn, [OK], [fd], NOSIGNAL)
        finally:
            os.close(fd)
        return True


def _same(f: Callable[[], None]) -> object:
    """What makes two ``keep`` callables the same work (one partial per buffer, one GPU)."""
    if isinstance(f, functools.partial):
        return (f.func, f.args)
    return f


_broker: Broker | None = None
_broker_lock = threading.Lock()
_left_by_fork: list[dict[bytes, Any]] = []


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


#: Called (no arguments) when this process's broker starts: the keeper's exit hooks.
on_start: list[Callable[[], None]] = []


def broker() -> Broker:
    """This process's broker, started on first use."""
    global _broker
    if _broker is None:
        with _broker_lock:
            if _broker is None:
                _broker = Broker()
                for hook in on_start:
                    hook()
    return _broker


def started() -> Broker | None:
    """This process's broker if it has started, else None (nothing is started)."""
    return _broker


def is_own(address: str) -> bool:
    """True when ``address`` is this process's broker (a started one)."""
    b = _broker
    return b is not None and b.address == address
