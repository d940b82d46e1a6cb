"""The descriptor broker: the right token gets the descriptor, nothing else gets anything, a dead
exporter is reported at once, and nothing leaks."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gpu_serde.errors import ExporterGoneError, TokenRefusedError
from gpu_serde.memory.broker import Broker, acquire, disconnect, fetch, holdsfile, release, server
from gpu_serde.memory.broker import client as broker_client

EXPORTER = """
import os, sys
from gpu_serde.memory.broker import broker
fd = os.memfd_create("exported")
os.write(fd, b"hello from the exporter")
token = broker().offer(fd)
os.close(fd)  # the broker keeps its own duplicate
print(broker().address, token.hex(), flush=True)
sys.stdin.read()  # until the test closes our stdin
"""
SILENT = f"@gpu_serde-test-silent-{os.getpid()}"  # abstract names are host-wide


def open_fds(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def exporter():
    proc = subprocess.Popen(
        [sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    address, token = proc.stdout.readline().split()
    yield proc, address, bytes.fromhex(token)
    proc.stdin.close()
    proc.kill()
    proc.wait(10)


def read_all(fd: int) -> bytes:
    return os.pread(fd, 100, 0)


def test_the_right_token_gets_the_descriptor_from_another_process(exporter):
    _, address, token = exporter
    fd = fetch(address, token)
    try:
        assert read_all(fd) == b"hello from the exporter"
    finally:
        os.close(fd)


def test_a_wrong_token_gets_nothing(exporter):
    _, address, _ = exporter
    disconnect()
    settled_fds()
    before = fds_but_others(address)
    with pytest.raises(TokenRefusedError, match="refused"):
        fetch(address, bytes(16))
    disconnect()  # the connection kept for the next request is the only new descriptor
    assert fds_but_others(address) == before


def kill_and_fetch(proc, address: str, token: bytes) -> float:
    """Kill the exporter, fetch from it (the typed error); seconds the fetch took."""
    proc.kill()
    proc.wait(10)
    started = time.monotonic()
    with pytest.raises(ExporterGoneError, match="gone"):
        fetch(address, token)
    return time.monotonic() - started


def test_a_killed_exporter_is_reported_within_a_second(exporter):
    assert kill_and_fetch(*exporter) < 1.0


def test_a_silent_broker_times_out_instead_of_hanging():
    import socket

    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind("\0" + SILENT[1:])
    squatter.listen(1)  # accepts connections, never answers
    try:
        started = time.monotonic()
        with pytest.raises(ExporterGoneError, match="did not answer"):
            fetch(SILENT, bytes(16), timeout=0.5)
        assert time.monotonic() - started < 1.0
    finally:
        squatter.close()


def as_other_user(fn) -> str:
    """Run ``fn()`` in a forked child switched to uid/gid 65534; return what it returned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.setgid(65534)
            os.setuid(65534)
            result = fn()
        except BaseException as exc:
            result = f"raised {type(exc).__name__}"
        os.write(write, result.encode())
        os._exit(0)
    os.close(write)
    try:
        return os.read(read, 1000).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid")
def test_another_user_gets_nothing(exporter):
    import socket

    _, address, token = exporter

    def through_fetch() -> str:
        try:
            fetch(address, token)
        except (ExporterGoneError, TokenRefusedError) as exc:
            return type(exc).__name__
        return "got a descriptor"

    def raw_request() -> str:  # a client that skips fetch()'s own check of the broker's uid
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect("\0" + address[1:])
        try:
            s.sendall(b"F" + token)
            msg, fds, _, _ = socket.recv_fds(s, 1, 1)
        except OSError:  # the broker hung up first
            return "nothing"
        return "nothing" if (msg, fds) == (b"", []) else f"answer={msg!r} fds={len(fds)}"

    assert as_other_user(through_fetch) == "ExporterGoneError"  # not this user's broker
    assert as_other_user(raw_request) == "nothing"  # the broker hung up without a word


def settled_fds(pid: int | str = "self") -> int:
    """The open descriptor count once it has not changed for 0.3 s (at most 5 s): what earlier
    tests left closing in the background (brokers' connection threads, children's pipes) is not
    counted as this test's."""
    deadline, count, since = time.monotonic() + 5, open_fds(pid), time.monotonic()
    while time.monotonic() - since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        now = open_fds(pid)
        if now != count:
            count, since = now, time.monotonic()
    return count


def wait_for_fds(pid: int | str, expected: int) -> int:
    deadline = time.monotonic() + 2  # a broker's thread closes its side just after the client
    while open_fds(pid) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return open_fds(pid)


def settled_fds_but_others(address: str, expected: int) -> int:
    """:func:`fds_but_others` once it is ``expected`` (at most 2 s): another thread of this
    process (the release thread giving back an earlier test's holds) may be opening or closing
    a link to another broker at the moment of a count."""
    deadline = time.monotonic() + 2
    while fds_but_others(address) != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return fds_but_others(address)


def steady_fds_but_others(address: str) -> int:
    """:func:`fds_but_others` once two counts 20 ms apart agree (at most 2 s)."""
    deadline, last = time.monotonic() + 2, fds_but_others(address)
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = fds_but_others(address)
        if now == last:
            break
        last = now
    return last


def fds_but_others(address: str) -> int:
    """This process's open descriptors but for what earlier tests' processes may open or close
    meanwhile: its own broker's connections, and its links to brokers other than ``address`` (the
    release thread may still be giving back an earlier test's holds)."""
    own = server._broker
    with broker_client._links_lock:
        others = sum(
            (link.sock is not None) + (link.file is not None)
            for at, link in broker_client._links.items()
            if at != address
        )
    return open_fds() - others - (len(own._conns) if own is not None else 0)


def fd_targets() -> list[str]:
    """What this process's open descriptors point to (``/memfd:... (deleted)``,
    ``socket:[...]``, ``pipe:[...]``...)."""
    targets = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone already
            targets.append(os.readlink(f"/proc/self/fd/{name}"))
    return targets


def test_a_thousand_handoffs_leave_no_descriptor_open(exporter):
    proc, address, token = exporter
    disconnect()
    settled_fds()
    mine, theirs = steady_fds_but_others(address), settled_fds(proc.pid)
    first = fetch(address, token)
    exported = os.readlink(f"/proc/self/fd/{first}")  # what a fetched descriptor points to
    os.close(first)
    for _ in range(999):
        os.close(fetch(address, token))
    # no fetched descriptor is left open here, however many the process has otherwise (another
    # test's thread or child may hold one more for a while: counted below, never this kind)
    assert exported.startswith("/memfd:exported") and exported not in fd_targets()
    # one connection, kept for the next request
    assert settled_fds_but_others(address, mine + 1) in (mine + 1, mine + 2)
    assert wait_for_fds(proc.pid, theirs + 1) == theirs + 1  # the broker's side of it
    disconnect()
    assert wait_for_fds(proc.pid, theirs) == theirs  # the broker saw it closed
    assert settled_fds_but_others(address, mine) in (mine, mine + 1)


def test_a_killed_exporter_behind_a_kept_connection_is_reported_within_a_second(exporter):
    proc, address, token = exporter
    disconnect()
    settled_fds()
    before = fds_but_others(address)
    os.close(fetch(address, token))  # leaves a connection open for reuse
    assert kill_and_fetch(proc, address, token) < 1.0
    assert fds_but_others(address) == before  # the dead connection is closed, not kept


def test_an_idle_connection_the_broker_closed_is_reopened_and_a_request_counts_once(monkeypatch):
    monkeypatch.setattr(server, "IDLE_S", 0.2)
    b = Broker()
    fd = os.memfd_create("x")
    try:
        token = b.hold("a buffer", lambda obj: None)
        served = b.offer(fd)
        os.close(fetch(b.address, served))
        kept = broker_client._links[b.address].sock
        time.sleep(0.5)  # the broker closes the silent connection, which holds nothing
        acquire(b.address, token)  # over a new one
        assert broker_client._links[b.address].sock is not kept
        assert release(b.address, token)
        assert not release(b.address, token)  # one acquire counted, no more
    finally:
        os.close(fd)
        b.close()


def test_a_connection_that_holds_is_never_closed_for_idleness(monkeypatch):
    monkeypatch.setattr(server, "IDLE_S", 0.2)
    b = Broker()
    try:
        token = b.hold("a buffer", lambda obj: None)
        acquire(b.address, token)
        kept = broker_client._links[b.address].sock
        time.sleep(0.5)  # silent longer than the idle time: kept, since it carries a hold
        assert release(b.address, token)  # counted over the same connection
        assert broker_client._links[b.address].sock is kept
    finally:
        b.close()


HOLDER = """
import sys
from gpu_serde.memory.broker import acquire
address, token, block = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
acquire(address, token, block)
print("held", flush=True)
sys.stdin.read()  # holds until the test kills it or closes our stdin
"""
RELEASER = """
import sys
from gpu_serde.memory.broker import release
print(release(sys.argv[1], bytes.fromhex(sys.argv[2])), flush=True)
"""
BLOCK = bytes(range(16))


def holder(
    address: str, token: bytes, block: bytes = BLOCK, script: str = HOLDER, **popen
) -> subprocess.Popen:
    """A process running ``script`` (argv: address, token, block), once it printed "held"."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, address, token.hex(), block.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **popen,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_a_release_from_a_process_that_never_acquired_is_refused():
    b = Broker()
    let_go = []
    try:
        token = b.hold("a block", let_go.append, block=BLOCK, grace=0)
        proc = holder(b.address, token)
        forged = subprocess.run(
            [sys.executable, "-c", RELEASER, b.address, token.hex()],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert forged.stdout.strip() == "False"  # not its hold: nothing counted
        assert not release(b.address, token)  # nor this process's, which never acquired
        time.sleep(0.2)
        assert let_go == [] and b.peek(token) == "a block"  # still the holder's
        proc.stdin.close()
        proc.wait(10)
    finally:
        b.close()


def test_a_killed_holder_gives_its_holds_back_within_the_grace_period():
    b = Broker()
    let_go = []
    try:
        token = b.hold("a block", let_go.append, block=BLOCK, grace=0.3)
        proc = holder(b.address, token)
        assert wait_for(lambda: sum(b.holders().values()) == 1)
        assert b.holders() == {proc.pid: 1}
        proc.kill()  # SIGKILL: it never says a word
        proc.wait(10)
        started = time.monotonic()
        assert wait_for(lambda: let_go == ["a block"])
        assert time.monotonic() - started < 0.3 + 1.0  # the grace, plus a small bound
        assert b.held() == 0 and b.holders() == {}
    finally:
        b.close()


SILENT_HOLDER = """
import fcntl, sys
from gpu_serde.memory.broker import client, holdsfile
address, token = sys.argv[1], bytes.fromhex(sys.argv[2])
link = client._taken(address, 1.0)
file = client._holds_file(link, address, 10**9, 1.0)  # the file, as acquire fetches it
assert holdsfile.try_lock(file.fd, fcntl.F_RDLCK, holdsfile.seq_of(token))  # no note sent
print("held", flush=True)
sys.stdin.read()
"""


def test_a_block_locked_by_a_process_whose_note_has_not_arrived_is_never_let_go():
    b = Broker()
    let_go = []
    try:
        token = b.hold("a block", let_go.append, block=BLOCK, grace=0.1)
        silent = holder(b.address, token, script=SILENT_HOLDER)
        acquire(b.address, token, BLOCK)  # this process's hold, noted
        assert release(b.address, token)  # the last noted holder goes: due after the grace
        time.sleep(0.6)
        assert let_go == [] and b.peek(token) == "a block"  # the kernel refused the write lock
        silent.kill()  # its lock goes with it, though it never said a word
        silent.wait(10)
        assert wait_for(lambda: let_go == ["a block"])
        with pytest.raises(TokenRefusedError, match="no longer holds"):
            acquire(b.address, token, BLOCK)  # let go for good: refused by the lock
    finally:
        b.close()


def test_a_forged_token_takes_no_hold_and_leaves_no_lock():
    b = Broker()
    try:
        token = b.hold("a block", lambda obj: None, block=BLOCK)
        forged = [
            token[:8] + bytes(8),  # the real sequence number, another random half
            (int.from_bytes(token[:8], "big") + 7).to_bytes(8, "big") + token[8:],  # not issued
            bytes(16),  # the exporter's own byte
        ]
        for bad in forged:
            with pytest.raises(TokenRefusedError, match="no longer holds"):
                acquire(b.address, bad, BLOCK)
        assert broker_client.holds(b.address) == 0
        acquire(b.address, token, BLOCK)  # the real one holds
        with pytest.raises(TokenRefusedError, match="no longer holds"):
            acquire(b.address, forged[0], BLOCK)  # its number, while this process holds it
        seq = int.from_bytes(token[:8], "big")
        assert not holdsfile.try_lock(b._file.fd, fcntl.F_WRLCK, seq)  # still locked
        assert release(b.address, token)
    finally:
        b.close()


SHELLING_HOLDER = """
import os, sys
from gpu_serde.memory.broker import acquire
acquire(sys.argv[1], bytes.fromhex(sys.argv[2]))
os.system("sleep 30 &")  # a program it runs inherits none of its holds
print("held", flush=True)
sys.stdin.read()
"""

FORKING_HOLDER = """
import os, sys, time
from gpu_serde.memory.broker import acquire, client
acquire(sys.argv[1], bytes.fromhex(sys.argv[2]))
# a descriptor of the holds file that no hook knows of, as one still on its way from the broker
# when another thread forks: the child's copy would keep this process's locks alive
os.dup(client._links[sys.argv[1]].file.fd)
if os.fork() == 0:  # a worker that never execs (a DataLoader's, multiprocessing's fork)
    time.sleep(30)
    os._exit(0)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(
    "script",
    [SHELLING_HOLDER, FORKING_HOLDER],
    ids=["a program it started", "a child it forked with a stray descriptor"],
)
def test_a_killed_holders_hold_comes_back_though_what_it_started_lives_on(script):
    b = Broker()
    let_go = []
    try:
        token = b.hold("a block", let_go.append, grace=0.1)
        proc = holder(b.address, token, script=script, start_new_session=True)
        assert wait_for(lambda: b.holders() == {proc.pid: 1})
        proc.kill()
        proc.wait(10)
        assert wait_for(lambda: let_go == ["a block"])  # the sleep, or the child, still runs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        b.close()


def test_a_broken_connection_loses_no_note_the_next_one_carries_the_holds_again(monkeypatch):
    monkeypatch.setattr(server, "IDLE_S", 0.3)
    b = Broker()
    let_go = []
    try:
        kept = b.hold("kept", let_go.append, grace=0.1)
        acquire(b.address, kept)
        assert wait_for(lambda: b.holders() == {os.getpid(): 1})
        broker_client._hang_up(broker_client._links[b.address])  # as a request that timed out
        assert wait_for(lambda: b.holders() == {})  # the broker dropped that connection's notes
        fd = os.memfd_create("x")
        os.close(fetch(b.address, b.offer(fd)))  # a new connection: it carries the hold again
        os.close(fd)
        assert wait_for(lambda: b.holders() == {os.getpid(): 1})
        time.sleep(0.6)  # longer than the idle time: kept open, it carries a hold
        token = b.hold("new", let_go.append, grace=0.1)
        acquire(b.address, token)
        assert wait_for(lambda: b.holders() == {os.getpid(): 2})
        assert release(b.address, token)
        assert wait_for(lambda: let_go == ["new"])  # claimed, released, let go
        assert release(b.address, kept)
        assert wait_for(lambda: let_go == ["new", "kept"])
    finally:
        b.close()


def test_a_hold_refuses_an_acquire_for_another_block():
    b = Broker()
    try:
        token = b.hold("block A", lambda obj: None, block=BLOCK)
        with pytest.raises(TokenRefusedError, match="another block"):
            acquire(b.address, token, bytes(16))
        with pytest.raises(TokenRefusedError, match="another block"):
            acquire(b.address, token, bytes(reversed(BLOCK)))
        acquire(b.address, token, BLOCK)
        assert wait_for(lambda: b.holders() == {os.getpid(): 1})  # the acquire's note
        assert release(b.address, token)
    finally:
        b.close()


def test_a_descriptor_refuses_a_fetch_that_names_another_identity():
    b = Broker()
    fd = os.memfd_create("x")
    try:
        token = b.offer(fd, BLOCK)
        with pytest.raises(TokenRefusedError, match="another block or descriptor"):
            fetch(b.address, token, bytes(16))
        os.close(fetch(b.address, token, BLOCK))
    finally:
        os.close(fd)
        b.close()


def test_a_slow_release_callback_delays_no_reply():
    b = Broker()
    try:
        slow = b.hold("let go slowly", lambda obj: time.sleep(1.5))
        other = b.hold("another buffer", lambda obj: None)
        acquire(b.address, slow)
        assert release(b.address, slow)  # its callback now runs for 1.5 s
        time.sleep(0.1)
        started = time.monotonic()
        acquire(b.address, other)  # over the same connection
        assert time.monotonic() - started < 0.5
    finally:
        b.close()


def test_a_process_keeps_at_most_max_idle_connections():
    disconnect()
    brokers = [Broker() for _ in range(broker_client.MAX_IDLE + 3)]
    fd = os.memfd_create("x")
    try:
        tokens = [b.offer(fd) for b in brokers]
        before = settled_fds()
        for b, token in zip(brokers, tokens, strict=True):
            os.close(fetch(b.address, token))
        # both ends live in this process: the client's and the broker's (none holds anything)
        assert (
            wait_for_fds("self", before + 2 * broker_client.MAX_IDLE)
            == before + 2 * broker_client.MAX_IDLE
        )
        disconnect()
        assert wait_for_fds("self", before) == before
    finally:
        os.close(fd)
        for b in brokers:
            b.close()


def test_releases_made_at_close_keep_at_most_max_idle_connections_too():
    disconnect()
    holding = broker_client.open_connections()  # other tests' connections that hold something
    brokers = [Broker() for _ in range(broker_client.MAX_IDLE + 3)]
    try:
        for b in brokers:
            token = b.hold("a block", lambda _obj: None, grace=0)
            acquire(b.address, token)
            assert release(b.address, token, wait=False)  # as a buffer closed on an idle stream
        assert broker_client.open_connections() == holding + broker_client.MAX_IDLE
    finally:
        disconnect()
        for b in brokers:
            b.close()


def test_a_release_at_close_on_a_stale_connection_tells_the_broker_by_hanging_up(monkeypatch):
    disconnect()
    holding = broker_client.open_connections()  # other tests' connections that hold something
    monkeypatch.setattr(broker_client, "REUSE_S", 0.0)  # the connection is stale at once
    b = Broker()
    let_go = []
    try:
        token = b.hold("a block", let_go.append, grace=0)
        acquire(b.address, token)
        assert release(b.address, token, wait=False)  # no new connection made for it
        assert broker_client.open_connections() == holding
        assert wait_for(lambda: let_go == ["a block"], timeout=3.0)
        assert b.holders() == {}
    finally:
        b.close()


def test_threads_share_a_broker_and_every_request_is_counted_once():
    from concurrent.futures import ThreadPoolExecutor

    b = Broker()
    let_go = []
    try:
        token = b.hold("a buffer", let_go.append, grace=0)
        acquire(b.address, token)  # keeps it held while the threads come and go

        def use(_: int) -> bool:
            acquire(b.address, token)
            return release(b.address, token)

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(use, range(400)))
        assert b.held() == 1 and let_go == []
        assert release(b.address, token)
        deadline = time.monotonic() + 3
        while not let_go and time.monotonic() < deadline:
            time.sleep(0.05)
        assert let_go == ["a buffer"]
    finally:
        b.close()


def test_revoke_and_close_release_the_brokers_descriptors():
    disconnect()
    b = Broker()
    fd = os.memfd_create("x")
    try:
        before = settled_fds()
        tokens = [b.offer(fd) for _ in range(10)]
        assert open_fds() == before + 10 and len(b) == 10
        b.revoke(tokens[0])
        with pytest.raises(TokenRefusedError):
            fetch(b.address, tokens[0])
        got = fetch(b.address, tokens[1])
        os.close(got)
        b.close()
        with pytest.raises(ExporterGoneError):  # also over the connection kept from before
            fetch(b.address, tokens[1])
        # the listening socket, the holds file and the serving thread's wake-up pipe are closed
        assert wait_for_fds("self", before - 4) == before - 4
    finally:
        os.close(fd)


def test_malformed_requests_are_value_errors():
    with pytest.raises(ValueError):
        fetch("not-an-address", bytes(16))
    with pytest.raises(ValueError):
        fetch("@x", b"short")


def test_a_held_object_is_let_go_after_its_last_importer_releases_it():
    b = Broker()
    let_go = []
    try:
        token = b.hold(["exported buffer"], let_go.append, grace=0.2)
        acquire(b.address, token)
        acquire(b.address, token)  # two importers
        assert release(b.address, token)
        time.sleep(0.5)
        assert let_go == [] and b.held() == 1  # one importer still holds it
        assert release(b.address, token)
        assert let_go == [] and b.held() == 1  # within the grace period a hop may re-acquire
        deadline = time.monotonic() + 3
        while not let_go and time.monotonic() < deadline:
            time.sleep(0.05)
        assert let_go == [["exported buffer"]] and b.held() == 0
        with pytest.raises(TokenRefusedError, match="no longer holds"):
            acquire(b.address, token)
        assert not release(b.address, token)
    finally:
        b.close()


def test_an_object_due_sooner_than_the_release_threads_next_look_is_let_go_on_time():
    b = Broker()
    let_go = []
    try:
        slow = b.hold("slow", let_go.append, grace=30)
        fast = b.hold("fast", let_go.append, grace=0.1)
        acquire(b.address, slow)
        acquire(b.address, fast)
        assert release(b.address, slow)  # the release thread plans its next look in 30 s
        time.sleep(0.2)
        assert release(b.address, fast)  # due in 0.1 s: the release thread is woken for it
        assert wait_for(lambda: let_go == ["fast"], timeout=3.0)
        assert b.peek(slow) == "slow" and b.held() == 1
    finally:
        b.close()


def test_a_killed_holder_gives_back_an_object_due_sooner_than_the_release_threads_next_look():
    b = Broker()
    let_go = []
    try:
        slow = b.hold("slow", let_go.append, grace=30)
        acquire(b.address, slow)
        assert release(b.address, slow)  # the release thread plans its next look in 30 s
        fast = b.hold("fast", let_go.append, block=BLOCK, grace=0.1)
        proc = holder(b.address, fast)
        assert wait_for(lambda: b.holders() == {proc.pid: 1})
        proc.kill()  # its connection closes: due in 0.1 s, and the release thread is woken
        proc.wait(10)
        assert wait_for(lambda: let_go == ["fast"], timeout=3.0)
        assert b.peek(slow) == "slow"
    finally:
        b.close()


def test_a_release_that_must_not_wait_does_nothing_while_another_thread_uses_the_connection():
    b = Broker()
    let_go = []
    try:
        token = b.hold("a block", let_go.append, grace=0)
        acquire(b.address, token)
        got: list[object] = []
        link = broker_client._links[b.address]
        with link.lock:  # another thread's request is on the connection
            t = threading.Thread(target=lambda: got.append(release(b.address, token, wait=False)))
            t.start()
            t.join(5.0)
        assert got == [None]  # nothing done: its caller leaves it to the release thread
        assert broker_client.holds(b.address) == 1 and let_go == []
        assert release(b.address, token)  # that thread's release, later
        assert wait_for(lambda: let_go == ["a block"], timeout=3.0)
    finally:
        b.close()


def test_an_exiting_exporter_lets_nothing_go_from_its_thread_while_python_is_torn_down():
    b = Broker()
    let_go = []
    try:
        token = b.hold(["exported buffer"], let_go.append, grace=0.2)
        acquire(b.address, token)
        assert release(b.address, token)  # due in 0.2 s, from the broker's release thread
        b.stop_letting_go()  # what the exit hook does
        time.sleep(0.5)
        assert let_go == [] and b.held() == 1  # it goes with the process instead
        assert not b._letting_go.is_alive()
    finally:
        b.close()


def test_an_object_never_imported_stays_held_and_release_without_acquire_is_refused():
    b = Broker()
    try:
        token = b.hold(object(), lambda obj: None)
        assert not release(b.address, token)
        time.sleep(0.3)
        assert b.held() == 1
    finally:
        b.close()


def test_a_forked_child_leaves_its_parents_broker_serving():
    fd = os.memfd_create("exported")
    os.write(fd, b"still here")
    token = server.broker().offer(fd)
    os.close(fd)
    pid = os.fork()  # Ray, Dask and multiprocessing fork helpers; the child drops its copy
    if pid == 0:
        os._exit(0 if server._broker is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child forgot the inherited broker
    got = fetch(server.broker().address, token)
    try:
        assert os.pread(got, 10, 0) == b"still here"  # the parent's broker still answers
    finally:
        os.close(got)
        server.broker().revoke(token)


class _FreedInChild:
    """Stands for a held CUDA object: writes to ``fd`` if a process frees it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.write(self.fd, b"freed")


def test_a_forked_child_frees_none_of_the_objects_its_parents_broker_holds():
    """Freeing a held Buffer calls the driver, which a forked child must not do before it execs:
    a lock another parent thread held at the fork never opens there (Ray's start hung on it)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    token = server.broker().hold(_FreedInChild(w), lambda obj: None)
    try:
        pid = os.fork()
        if pid == 0:  # the fork hooks have run; os._exit frees nothing itself
            os._exit(0 if server._broker is None and server._left_by_fork else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with pytest.raises(BlockingIOError):
            os.read(r, 5)  # nothing was freed in the child
        assert server.broker().peek(token) is not None  # the parent still holds it
        address = server.broker().address
        acquire(address, token)
        assert release(address, token)  # the last importer lets go: the parent frees it
        deadline = time.monotonic() + 5
        while server.broker().peek(token) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert os.read(r, 5) == b"freed"
    finally:
        os.close(r)
        os.close(w)


def test_a_forked_child_opens_its_own_connections(exporter):
    _, address, token = exporter
    os.close(fetch(address, token))  # the parent keeps a connection to the exporter
    pid = os.fork()
    if pid == 0:  # never returns into pytest
        try:
            ok = not broker_client._links  # the parent's connection is not the child's to use
            for _ in range(50):
                os.close(fetch(address, token))
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    for _ in range(50):  # at the same time, over the inherited connection
        os.close(fetch(address, token))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_peer_that_trickles_its_request_is_cut_off_at_one_deadline(monkeypatch):
    """A peer sending one byte just under every read timeout must not hold a broker thread for
    the whole request: the request has one deadline (REQUEST_S) from its first byte."""
    import socket

    monkeypatch.setattr(server, "REQUEST_S", 0.3)
    b = Broker()
    try:
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect("\0" + b.address[1:])
        peer.settimeout(5)
        sent = 0
        try:
            for _ in range(17):  # op + 16-byte token, one byte at a time, 0.1 s apart
                peer.send(b"F")
                sent += 1
                time.sleep(0.1)
            answer = peer.recv(1)
        except OSError:  # the broker hung up on us mid-request
            answer = b""
        peer.close()
        assert answer == b""  # never answered: the connection was closed
        assert sent < 17  # ... before the trickled request was complete
    finally:
        b.close()


def test_an_object_sent_again_after_its_last_release_waits_for_the_new_payload():
    b = Broker()
    let_go = []
    try:
        obj = ["a block"]
        token = b.hold(obj, let_go.append, grace=0.2)
        acquire(b.address, token)
        assert b.sent_again(token, obj)  # a second payload, not yet acquired (in an object store)
        assert release(b.address, token)  # the first importer lets go
        time.sleep(0.6)  # longer than the grace: kept for the payload still on its way
        assert let_go == [] and b.peek(token) is obj
        acquire(b.address, token)  # the second payload arrives
        assert release(b.address, token)
        deadline = time.monotonic() + 3
        while not let_go and time.monotonic() < deadline:
            time.sleep(0.05)
        assert let_go == [obj]
        assert not b.sent_again(token, obj)  # let go: a new send takes a new hold
    finally:
        b.close()


SLOW_BROKER = """
import sys, time
from gpu_serde.memory.broker import server
b = server.Broker()
acquire = b._acquire
def slow(conn, token, stamp):
    time.sleep(1.5)  # the exporter is busy (a long C call, a full collection)
    return acquire(conn, token, stamp)
b._acquire = slow
kept = b.hold("in use", lambda obj: print("let go", flush=True), grace=0.1)
print(b.address, kept.hex(), flush=True)
sys.stdin.read()
"""


def test_an_acquire_waits_for_no_answer_from_a_busy_exporter():
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_BROKER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address, kept = proc.stdout.readline().split()
        acquire(address, bytes.fromhex(kept), timeout=0.3)  # the exporter takes 1.5 s to note it
        assert broker_client.holds(address) == 1
        assert release(address, bytes.fromhex(kept))
        for _ in range(3000):  # far more notes than the socket takes while the exporter is busy
            acquire(address, bytes.fromhex(kept), timeout=0.3)
            assert release(address, bytes.fromhex(kept), timeout=0.3)
        assert proc.stdout.readline().strip() == "let go"  # both notes counted, in order
    finally:
        proc.stdin.close()
        proc.wait(10)
