"""The notes ring: an importer's notes, in memory its exporter reads when it needs them.

An importer's notes (that it took a hold, that it gave one back) used to be messages on its
connection to the exporter's broker: one ``send`` each, and a thread of the exporter woken to
count it, while the hand-off was under way. The exporter does not need to know at once: the lock
is what it obeys (:mod:`~gpu_serde.memory.broker.holdsfile`); the notes say which process holds
what, whether a payload was received, and when the grace of an object no one holds starts. So
each connection now comes with a **ring** that the importer writes its notes into and the
exporter reads whenever it is about to use what they say: when a request or note arrives on that
connection, when the connection ends, before it lets an object go, before it answers who holds
what, before it hands its holds to a keeper, when its arena has no room, and otherwise every
little while (:data:`~gpu_serde.memory.broker.server.LOOK_S`) while it holds anything. A note then
costs the importer a few stores to shared memory and wakes nothing.

The importer makes the ring (a ``memfd``, sealed against growing and shrinking: a peer that
could shrink it would crash the exporter's reads) and passes it with the connection's first
message (:data:`~gpu_serde.memory.broker.client.RING`, ``SCM_RIGHTS``). Its layout,
little-endian:

- bytes 0 to 7: how many notes the importer has written (only it writes them);
- bytes 8 to 15: how many the exporter has read (only it writes them);
- from :data:`HEADER_BYTES`, :data:`SLOTS` records of :data:`RECORD_BYTES`: the token, the count of
  sends again that an acquirer read in the holds table, the note's kind (the top bit: a release)
  and number (mod 2**31), and a CRC-32 of the three. The exporter takes a record only when its
  number and checksum match: one not yet wholly visible to it (a store not yet seen on another
  CPU) is read at its next look.

A full ring (the exporter has not looked for :data:`SLOTS` notes) sends the note on the
connection instead, as before; the exporter reads the ring before it counts a note sent, so the
order holds. Nothing in the ring is trusted: the exporter checks its size and seals before
mapping it, reads at most :data:`SLOTS` records at a time, counts nothing for a token it did not
issue or a release of a hold not taken over that connection, and a count that cannot be (behind
what it read, or further ahead than the ring holds) ends the connection.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import struct
import zlib

SLOTS = 1024  #: notes a ring holds before an importer sends them on its connection instead
HEADER_BYTES = 64
RECORD_BYTES = 32
SIZE = HEADER_BYTES + SLOTS * RECORD_BYTES
_COUNT = struct.Struct("<Q")
_RECORD = struct.Struct("<16sQII")  # token, sends, kind and number, CRC-32 of the first 28 bytes
_BODY = 28
_RELEASE = 1 << 31  # the kind bit: a release's note (else an acquire's)
_NUMBER = _RELEASE - 1
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_NAME = "gpu_serde-notes"


class RingError(Exception):
    """A peer's ring is not one (wrong size, not sealed, not memory) or its counts cannot be."""


class NotesRing:
    """One side's mapping of a connection's ring: the importer writes notes, the exporter reads
    them. Not thread-safe: each side uses it under its own lock."""

    __slots__ = ("_map", "_next")

    def __init__(self, mapping: mmap.mmap) -> None:
        self._map: mmap.mmap | None = mapping  # None once closed
        self._next = 0  # the importer's: notes written; the exporter's: notes read

    @classmethod
    def create(cls) -> tuple[NotesRing, int]:
        """The importer's: a new, empty, sealed ring, and its descriptor (the caller sends it to
        the exporter, then closes it: the mapping stays)."""
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SIZE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(mapping), fd

    @classmethod
    def received(cls, fd: int) -> NotesRing:
        """The exporter's view of a ring a peer sent (``fd`` is closed: the mapping stays).

        Raises:
            RingError: ``fd`` is not a sealed memory file of :data:`SIZE` bytes.
        """
        try:
            info = os.fstat(fd)
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memory file
            if not stat.S_ISREG(info.st_mode) or info.st_size != SIZE or seals & _SEALS != _SEALS:
                raise RingError("not a sealed notes ring")
            mapping = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise RingError(f"a notes ring that cannot be mapped ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        return cls(mapping)

    def put(self, token: bytes, sends: int, *, release: bool = False) -> bool:
        """The importer's: write an acquire's note (``token``, and the count of sends again it
        read), or a release's (``release=True``, ``sends`` 0); False when the ring is full (the
        exporter has not looked for a while)."""
        m, n = self._map, self._next
        if m is None or n - _COUNT.unpack_from(m, 8)[0] >= SLOTS:
            return False
        number = (n & _NUMBER) | (_RELEASE if release else 0)
        body = _RECORD.pack(token, sends, number, 0)[:_BODY]
        at = HEADER_BYTES + (n % SLOTS) * RECORD_BYTES
        _RECORD.pack_into(m, at, token, sends, number, zlib.crc32(body))
        self._next = n + 1
        _COUNT.pack_into(m, 0, self._next)  # after the record
        return True

    def written(self) -> int:
        """How many notes the importer says it has written (the exporter's idle check; -1 once
        closed)."""
        return -1 if self._map is None else int(_COUNT.unpack_from(self._map, 0)[0])

    def take(self) -> list[tuple[bool, bytes, int]]:
        """The exporter's: the notes written since its last look, as (a release's, token, sends),
        in order.

        Raises:
            RingError: the importer's count is behind what was read, or further ahead than the
                ring holds.
        """
        m = self._map
        if m is None:
            return []
        written = _COUNT.unpack_from(m, 0)[0]
        n = self._next
        if written < n or written - n > SLOTS:
            raise RingError(f"a notes ring says {written} notes written, {n} read")
        notes = []
        while n < written:
            at = HEADER_BYTES + (n % SLOTS) * RECORD_BYTES
            token, sends, number, crc = _RECORD.unpack_from(m, at)
            if number & _NUMBER != n & _NUMBER or crc != zlib.crc32(m[at : at + _BODY]):
                break  # not wholly visible yet: the next look reads it
            notes.append((bool(number & _RELEASE), token, sends))
            n += 1
        if n != self._next:
            self._next = n
            _COUNT.pack_into(m, 8, n)
        return notes

    def close(self) -> None:
        """Unmap this side's view (a second call does nothing)."""
        m, self._map = self._map, None
        if m is not None:
            with contextlib.suppress(BufferError, ValueError):
                m.close()
