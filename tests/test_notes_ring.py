"""The notes ring: an importer tells the exporter of its acquires and releases in shared memory,
which the exporter reads when it needs to; they are counted all the same and in order, survive
the importer's death, overflow onto the connection, and a peer's ring that is not one ends only
that peer's connection."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time

import pytest

from gpu_serde.memory.broker import Broker, acquire, disconnect, release, ring, server
from gpu_serde.memory.broker import client as broker_client
from gpu_serde.memory.broker.client import FETCH, NO, RING

BLOCK = bytes(range(16))
RING_REQUEST = RING + bytes(32)
HOLDER = """
import sys
from gpu_serde.memory.broker import acquire
acquire(sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]))
print("held", flush=True)
sys.stdin.read()
"""


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settled_fds() -> int:
    """The open descriptor count once it has not changed for 0.3 s (at most 5 s)."""
    deadline, count, since = time.monotonic() + 5, open_fds(), time.monotonic()
    while time.monotonic() - since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        if open_fds() != count:
            count, since = open_fds(), time.monotonic()
    return count


def test_an_acquire_is_written_in_the_ring_and_counted_when_the_exporter_looks():
    b = Broker()
    try:
        token = b.hold("a block", lambda obj: None, block=BLOCK)
        acquire(b.address, token, BLOCK)
        link = broker_client._links[b.address]
        assert link.ring is not None and link.ring.written() == 1  # nothing sent for it
        assert not link.pending
        assert b.holders() == {os.getpid(): 1}  # read when asked
        assert not b.unclaimed(token)
        assert release(b.address, token)
        assert link.ring.written() == 2  # nor for the release
        assert b.holders() == {}
    finally:
        b.close()
        disconnect()


def test_a_release_in_the_ring_lets_its_object_go_at_the_exporters_next_look(monkeypatch):
    monkeypatch.setattr(server, "LOOK_S", 60.0)  # the release thread would look only in a minute
    monkeypatch.setattr(server, "LOOK_MAX_S", 60.0)
    b = Broker()
    let_go: list[str] = []
    try:
        token = b.hold("a block", let_go.append, block=BLOCK, grace=0)
        other = b.hold("another", let_go.append)
        acquire(b.address, other)  # the connection is made, and its thread waits for a message
        time.sleep(0.2)
        acquire(b.address, token, BLOCK)
        assert release(b.address, token)
        time.sleep(0.3)
        assert let_go == []  # read by no one yet: nothing woke the exporter
        b.look()  # as an arena with no room does
        assert let_go == ["a block"]
    finally:
        b.close()
        disconnect()


def test_the_release_thread_reads_the_rings_while_it_holds_anything():
    b = Broker()
    let_go: list[str] = []
    try:
        token = b.hold("a block", let_go.append, block=BLOCK, grace=0)
        acquire(b.address, token, BLOCK)
        assert release(b.address, token)
        assert wait_for(lambda: let_go == ["a block"], timeout=2 * server.LOOK_MAX_S + 1)
    finally:
        b.close()
        disconnect()


def test_a_full_ring_sends_the_rest_of_its_notes_on_the_connection(monkeypatch):
    monkeypatch.setattr(server, "LOOK_S", 60.0)  # the exporter does not look meanwhile
    monkeypatch.setattr(server, "LOOK_MAX_S", 60.0)
    b = Broker()
    n = ring.SLOTS + 6
    try:
        tokens = [b.hold(i, lambda obj: None) for i in range(n)]
        for token in tokens:
            acquire(b.address, token)
        # the ring filled, and was given up: every later note goes on the connection, in order
        assert broker_client._links[b.address].ring is None
        assert wait_for(lambda: b.holders() == {os.getpid(): n})  # every note counted
        for token in tokens:
            assert release(b.address, token)
        assert wait_for(lambda: b.holders() == {})
    finally:
        b.close()
        disconnect()


def test_an_importer_killed_right_after_acquiring_had_its_payload_claimed():
    """Its acquire was only in the ring, unread: the exporter reads it when the connection ends,
    so the object counts as received and comes back after its grace (it would otherwise wait
    for an importer until the exporter exits)."""
    b = Broker()
    let_go: list[str] = []
    try:
        token = b.hold("a block", let_go.append, block=BLOCK, grace=0.1)
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, b.address, token.hex(), BLOCK.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "held"
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: let_go == ["a block"])
    finally:
        b.close()


def a_ring() -> int:
    """A ring's descriptor, as a client makes it."""
    r, fd = ring.NotesRing.create()
    r.close()
    return fd


def memfd(size: int, seals: int = 0) -> int:
    fd = os.memfd_create("not a ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def sealed() -> int:
    return fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def connect(b: Broker) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.connect("\0" + b.address[1:])
    peer.settimeout(5)
    return peer


def served(peer: socket.socket) -> bool:
    """True while the broker still answers on ``peer`` (a fetch of an unknown token)."""
    try:
        peer.sendall(FETCH + bytes(32))
        return peer.recv(1) == NO
    except OSError:
        return False


def ended(peer: socket.socket) -> bool:
    """True when the broker closes ``peer`` (after what answers it gave)."""
    try:
        while peer.recv(64):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def send_with(peer: socket.socket, data: bytes, make: list) -> None:
    fds = [f() for f in make]
    try:
        socket.send_fds(peer, [data], fds)
    finally:
        for fd in fds:
            os.close(fd)


def a_pipe() -> int:
    r, w = os.pipe()
    os.close(w)
    return r


NOT_RINGS = {
    "no descriptor": (RING_REQUEST, []),
    "a pipe": (RING_REQUEST, [a_pipe]),
    "a memory file that can still shrink": (RING_REQUEST, [lambda: memfd(ring.SIZE)]),
    "a sealed memory file of another size": (RING_REQUEST, [lambda: memfd(4096, sealed())]),
    "two descriptors": (RING_REQUEST, [a_ring, a_ring]),
    "a descriptor with a fetch": (FETCH + bytes(32), [a_ring]),
    "a ring with a request not whole": (RING_REQUEST[:20], [a_ring]),
}


@pytest.mark.parametrize("case", NOT_RINGS)
def test_a_ring_that_is_not_one_ends_only_its_connection_and_leaks_nothing(case):
    data, make = NOT_RINGS[case]
    b = Broker()
    try:
        other = connect(b)
        assert served(other)
        before = settled_fds()
        peer = connect(b)
        if make:
            send_with(peer, data, make)
        else:
            peer.sendall(data)
        assert ended(peer)
        peer.close()
        assert wait_for(lambda: open_fds() == before)  # the broker kept none of it
        assert served(other)  # the broker serves everyone else as before
        other.close()
    finally:
        b.close()


def test_a_second_ring_on_one_connection_ends_it():
    b = Broker()
    try:
        peer = connect(b)
        send_with(peer, RING_REQUEST, [a_ring])
        assert served(peer)
        send_with(peer, RING_REQUEST, [a_ring])
        assert ended(peer)
        peer.close()
    finally:
        b.close()


def peer_with_ring(b: Broker) -> tuple[socket.socket, ring.NotesRing]:
    """A raw connection whose ring this test writes into as it likes."""
    r, fd = ring.NotesRing.create()
    peer = connect(b)
    try:
        socket.send_fds(peer, [RING_REQUEST], [fd])
    finally:
        os.close(fd)
    assert served(peer)
    return peer, r


def test_a_ring_whose_count_cannot_be_ends_its_connection_when_the_exporter_looks():
    b = Broker()
    try:
        peer, r = peer_with_ring(b)
        r._map[0:8] = (ring.SLOTS + 1).to_bytes(8, "little")  # more than the ring holds
        assert b.holders() == {}  # the look: nothing counted from it
        assert ended(peer)
        peer.close()
        r.close()
        assert b.holders() == {}
    finally:
        b.close()


def test_forged_and_torn_notes_count_nothing():
    b = Broker()
    try:
        token = b.hold("a block", lambda obj: None, block=BLOCK)
        peer, r = peer_with_ring(b)
        assert r.put(bytes(16), 0)  # a token never issued
        assert b.holders() == {}
        assert r.put(token, 0)
        at = ring.HEADER_BYTES + 1 * ring.RECORD_BYTES
        whole = bytes(r._map[at : at + ring.RECORD_BYTES])
        r._map[at + 28 : at + 32] = bytes(4)  # its checksum not yet visible to the exporter
        assert b.holders() == {}  # read at the next look, not counted half-written
        r._map[at : at + ring.RECORD_BYTES] = whole
        assert b.holders() == {os.getpid(): 1}
        assert served(peer)  # the connection goes on
        peer.close()
        assert wait_for(lambda: b.holders() == {})  # its hold goes with it
        r.close()
    finally:
        b.close()
