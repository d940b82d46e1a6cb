"""Healthcheck: exit 0 when every ``HOST:PORT`` given accepts a TCP connection, else 1."""

from __future__ import annotations

import socket
import sys


def ready(addresses: list[str]) -> bool:
    """True if each ``HOST:PORT`` in ``addresses`` accepts a connection within 2 s."""
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), 2).close()
        except OSError:
            return False
    return True


if __name__ == "__main__":
    sys.exit(0 if ready(sys.argv[1:]) else 1)
