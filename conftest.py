"""What every suite of this repository checks (``tests/`` and ``integration/``): nothing the tests
start listens beyond loopback (``tests/loopback.py``)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "loopback", Path(__file__).parent / "tests" / "loopback.py"
)
assert _spec is not None and _spec.loader is not None
loopback = sys.modules.setdefault("loopback", importlib.util.module_from_spec(_spec))
if not hasattr(loopback, "open_beyond_loopback"):
    _spec.loader.exec_module(loopback)

# Every process the tests start carries this mark: the socket check knows them by it.
os.environ.setdefault(loopback.MARK, f"{os.getpid()}-{os.urandom(4).hex()}")
_REPORTED: set = set()
_NOT_OURS: set = set()  # the machine's own sockets, looked up once


@pytest.fixture(autouse=True)
def _only_loopback():
    """Each test ends with nothing of the tests' listening beyond loopback: a Dask dashboard at
    ":0", for one, listens on every interface."""
    yield
    candidates = loopback.open_beyond_loopback() - _REPORTED - _NOT_OURS
    found = loopback.ours(candidates)
    _NOT_OURS.update(candidates - set(found))
    if found:
        _REPORTED.update(found)  # reported once
        lines = [f"{t} {a}:{port} held by {who}" for (t, a, port, _), who in sorted(found.items())]
        pytest.fail("listening beyond loopback:\n" + "\n".join(lines), pytrace=False)
