"""TCP connection attempts, to say plainly that nothing listens at a cluster's address (Ray's and
distributed's clients retry for minutes, then time out without saying why)."""

from __future__ import annotations

import socket
import time


def host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a plain ``host:port`` address (a ``tcp://`` prefix allowed), or None
    for anything else (another scheme, no port, a port that is not 1 to 65535)."""
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() != "tcp":
        return None
    host, sep, port = (rest if sep else address).rstrip("/").rpartition(":")
    host = host.strip("[]")
    if not sep or not host or "/" in host or not (port.isascii() and port.isdecimal()):
        return None
    return (host, int(port)) if 1 <= int(port) <= 65535 else None


def failure(address: str, timeout: float) -> OSError | None:
    """What one connection to ``address`` (see :func:`host_port`) failed with within ``timeout``
    (at most 5 s), or None: it was accepted, or it is not a plain address."""
    target = host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=max(0.1, min(timeout, 5))):
            return None
    except OSError as exc:
        return exc


def refused(address: str, timeout: float) -> str | None:
    """Why a connection to ``address`` was refused, or None: it was accepted, it is not a plain
    address, or it failed otherwise (no answer within ``timeout``)."""
    exc = failure(address, timeout)
    return str(exc.strerror or exc) if isinstance(exc, ConnectionRefusedError) else None


def refused_for(address: str, wait: float) -> str | None:
    """Like :func:`refused`, trying again every 0.2 s for up to ``wait`` seconds while the
    connection is refused (a cluster that is still starting): why it was still refused at the
    end, or None as soon as it is accepted (or is not a plain address, or does not answer)."""
    deadline = time.monotonic() + wait
    while True:
        why = refused(address, max(0.1, deadline - time.monotonic()))
        if why is None or time.monotonic() >= deadline:
            return why
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
