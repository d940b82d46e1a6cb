"""The tests' own network rule, checked: nothing they start listens beyond loopback.

Every socket a test's processes listen on (TCP) or bind (UDP) must be on ``127.0.0.0/8`` or
``::1``. The kernel's tables (``/proc/net/{tcp,tcp6,udp,udp6}``) list them for this network
namespace; a socket is the tests' when a process that holds it carries :data:`MARK` in its
environment (every process a test starts inherits it, also a daemon that left its parent), so
that the machine's own services are never blamed. Sockets are seen while they are open: at the
end of each test (the repository's conftest.py) and, for a doc block, every quarter second while
it runs. ``scripts/test`` runs the tests in a network namespace whose one interface is loopback,
where nothing can listen beyond it (Ray's CLI nodes listen on every interface of a node address
other than 127.0.0.1): there the check has nothing to find.
"""

from __future__ import annotations

import ipaddress
import os

#: The environment variable that marks the test session's processes (its value: the session's).
MARK = "GPU_SERDE_TEST_SESSION"
_TABLES = ("tcp", "tcp6", "udp", "udp6")
_LISTEN, _UNCONNECTED = "0A", "07"  # TCP_LISTEN; a UDP socket that is bound, not connected


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])  # the kernel prints one little-endian word
    words = [raw[i : i + 4][::-1] for i in range(0, 16, 4)]
    address = ipaddress.IPv6Address(b"".join(words))
    return address.ipv4_mapped or address


def only_loopback_here() -> bool:
    """True in a network namespace whose one interface is loopback (``scripts/test`` runs the
    tests in one): a socket on every interface is on loopback there."""
    try:
        with open("/proc/self/net/dev") as f:
            names = {row.split(":")[0].strip() for row in f.read().splitlines()[2:]}
    except OSError:
        return False
    return names == {"lo"}


def open_beyond_loopback() -> set[tuple[str, str, int, str]]:
    """``(table, address, port, inode)`` of every listening TCP or bound UDP socket in this
    network namespace whose address is not loopback (a wildcard address included, but in a
    namespace with no interface but loopback)."""
    if only_loopback_here():
        return set()
    found = set()
    for table in _TABLES:
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != (_LISTEN if table.startswith("tcp") else _UNCONNECTED):
                continue
            hex_address, hex_port = local.split(":")
            address = _address(hex_address)
            if not address.is_loopback:
                found.add((table, str(address), int(hex_port, 16), inode))
    return found


def ours(found: set[tuple[str, str, int, str]]) -> dict[tuple[str, str, int, str], str]:
    """Those of ``found`` that a process of this test session holds: each with "pid command"."""
    held = owners({inode for *_, inode in found})
    return {entry: held[entry[3]] for entry in found if entry[3] in held}


def owners(inodes: set[str]) -> dict[str, str]:
    """inode -> "pid command" of the processes of this test session (:data:`MARK`) that hold
    those sockets."""
    mark = f"{MARK}={os.environ.get(MARK, '')}".encode()
    out: dict[str, str] = {}
    if not inodes or not os.environ.get(MARK):
        return out
    me = str(os.getpid())  # (its /proc environ is the one it started with, before the mark)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if pid != me and mark not in f.read().split(b"\0"):
                    continue
            fds = os.listdir(f"/proc/{pid}/fd")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                out[target[8:-1]] = f"{pid} {command}"
    return out
