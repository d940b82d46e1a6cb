"""The holds file: how an importer takes and checks a hold with no round trip to the exporter.

Each broker keeps one memory file (``memfd``) whose bytes are a table of the holds it has issued,
and whose **byte-range locks** (open file description locks, ``F_OFD_SETLK``) are the holds
themselves:

- A hold's token starts with its sequence number (8 bytes, big-endian; the other 8 are random).
  Slot ``seq % SLOTS`` of the table (:data:`SLOT_BYTES` each) holds the token, the block it was
  issued for, and how many times it was sent again, written by the exporter before each payload
  leaves (an importer echoes that count in its note: a note for an earlier payload does not count
  for a later one).
- An importer holds by taking a **read lock** on the byte at offset ``seq``, then reading the slot
  (a token or block that does not match is refused, and the lock given back), then checking that
  the exporter is alive (its write lock on byte :data:`ALIVE`).
- The exporter lets a hold go only by taking a **write lock** on its byte, which it keeps for its
  life: the kernel grants it only while no importer holds a read lock, and refuses every read lock
  after it. An importer that reads a payload after its hold was let go is refused; an exporter
  never lets go of a block a reader holds.
- A lock belongs to the open file description it was taken through. Each importer gets its own
  (the broker opens the file afresh for each one, read-only), so a process releases only its own
  holds, and the kernel releases them all when the process dies, however it dies.

The sequence and the locks live in the kernel; the table only says what each hold was issued for.
Slot 0 is the header, no hold's: it says when the exporter has exited and a keeper serves what it
kept (:mod:`~gpu_serde.memory.broker.keeper`); a hold whose memory went with the exporter has
:data:`GONE` as its count of sends, one a keeper gave up unclaimed :data:`EXPIRED`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct

#: Slots in the table: the most holds a broker can have issued and not yet let go.
SLOTS = 1 << 18
SLOT_BYTES = 40  # token (16), block (16), sends (8)
ALIVE = 0  #: the byte the exporter write-locks for its life (slot 0 is the header, no hold's)
#: The count of sends again that marks a hold whose exporter exited without keeping its memory
#: (a pool's goes with its process): an acquire says so.
GONE = (1 << 64) - 1
#: The count of sends again that marks a hold a keeper gave up after keeping it unclaimed for its
#: time (``GPU_SERDE_KEEP_S``): an importer refused is told so.
EXPIRED = (1 << 64) - 2
_EXITED = b"exited!!"  # the header's first 8 bytes once the exporter exited and a keeper serves
_SEQ_MASK = (1 << 62) - 1
_FLOCK = struct.Struct("hhxxxxqqixxxx")  # struct flock, 64-bit Linux: type, whence, start, len, pid


def seq_of(token: bytes) -> int:
    """The sequence number (the lock's offset) that ``token`` names."""
    return int.from_bytes(token[:8], "big") & _SEQ_MASK


def _lock(fd: int, kind: int, offset: int, command: int = fcntl.F_OFD_SETLK) -> int:
    result = fcntl.fcntl(fd, command, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))
    return int(_FLOCK.unpack(result)[0])


def try_lock(fd: int, kind: int, offset: int) -> bool:
    """Take a ``kind`` lock (``fcntl.F_RDLCK`` or ``fcntl.F_WRLCK``) on byte ``offset`` without
    waiting; False when another open file description's lock conflicts."""
    try:
        _lock(fd, kind, offset)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, offset: int) -> None:
    """Give back this open file description's lock on byte ``offset``."""
    _lock(fd, fcntl.F_UNLCK, offset)


def locked_by_others(fd: int, offset: int) -> bool:
    """True when another open file description holds any lock on byte ``offset``."""
    return _lock(fd, fcntl.F_WRLCK, offset, fcntl.F_OFD_GETLK) != fcntl.F_UNLCK


def write_locked(fd: int, offset: int) -> bool:
    """True when another open file description holds a write lock on byte ``offset``."""
    return _lock(fd, fcntl.F_RDLCK, offset, fcntl.F_OFD_GETLK) != fcntl.F_UNLCK


_NAME = "gpu_serde-holds"  # the memory file's name, as /proc/self/fd shows it
_watching_forks = False


def watch_forks() -> None:
    """From now on a child forked from this process lets go of every descriptor of a holds file
    it inherited (pointed at ``/dev/null``), once the fork hooks of the broker and its client have
    closed those they know:
    also one that was being handed over at the fork, which only its owner's thread knew of. Such
    a copy would keep its parent's locks (the holds, and an exporter's mark of life) after the
    parent died, for an open file description's locks go only with its last descriptor.
    Called before this process first receives or makes a holds file; registered once, after the
    modules' own hooks."""
    global _watching_forks
    if not _watching_forks:
        _watching_forks = True
        os.register_at_fork(after_in_child=_close_inherited)


def _close_inherited() -> None:
    """Point every holds-file descriptor left in this forked child at ``/dev/null``: the open
    file description (and its locks) is let go, and the number stays taken, so that an object
    that still has it (a ``Broker`` made apart from this process's own) never writes to a file
    opened later under the same number."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    null = -1
    try:
        for name in names:
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # the listing's own descriptor, closed by now
            if target.startswith(f"/memfd:{_NAME}"):
                if null < 0:
                    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
                os.dup2(null, int(name), inheritable=False)
    except OSError:
        pass  # (no /dev/null: nothing else to do without a driver call or a reused number)
    finally:
        if null >= 0:
            os.close(null)


class HoldsFile:
    """One side's view of a broker's holds file: its descriptor, an open file description of its
    own (read-write for the exporter, read-only for importers)."""

    __slots__ = ("fd",)  # -1 once closed

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def create(cls) -> HoldsFile:
        """The exporter's: a new, empty file, write-locked at :data:`ALIVE` for its life."""
        watch_forks()
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)  # sparse: only written slots take memory
            _lock(fd, fcntl.F_WRLCK, ALIVE)
            return cls(fd)
        except BaseException:
            os.close(fd)
            raise

    def reopened(self) -> int:
        """A new, read-only open file description of the file, for one importer (its locks are
        its own). The caller sends and closes it."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def write(self, seq: int, token: bytes, block: bytes) -> None:
        """Record in ``seq``'s slot the hold ``token`` and the block it was issued for (sent
        once)."""
        os.pwrite(self.fd, token + block + bytes(8), (seq % SLOTS) * SLOT_BYTES)

    def write_sends(self, seq: int, sends: int) -> None:
        """Record that ``seq``'s hold was sent again: ``sends`` times in all."""
        os.pwrite(self.fd, sends.to_bytes(8, "big"), (seq % SLOTS) * SLOT_BYTES + 32)

    def mark_exited(self) -> None:
        """Record that the exporter exited, its GPU work done (a keeper serves what it kept)."""
        os.pwrite(self.fd, _EXITED, 0)

    def exited(self) -> bool:
        """True once the exporter has exited and a keeper serves what it kept: its GPU work is
        done, and no event of its needs waiting for."""
        return os.pread(self.fd, len(_EXITED), 0) == _EXITED

    def slot(self, seq: int) -> tuple[bytes, bytes, int]:
        """The token, block and count of sends again recorded in ``seq``'s slot."""
        entry = os.pread(self.fd, SLOT_BYTES, (seq % SLOTS) * SLOT_BYTES)
        return entry[:16], entry[16:32], int.from_bytes(entry[32:40], "big")

    def close(self) -> None:
        """Close this side's view; closing the exporter's last copy releases its write locks (its
        holds, and :data:`ALIVE`: importers then see it gone), an importer's its read locks. A
        second call does nothing."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
