"""gpu_serde's settings from the environment: a bad value is a warning that names the variable, and
gpu_serde still imports (a Ray worker's setup hook imports it; a hook that fails ends the worker).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpu_serde import hostid
from gpu_serde.memory.broker import keeper

BAD = ["abc", "-1", "inf", "nan", "1e400", "\x1b[31mred"]
SHOW = (
    "import gpu_serde, gpu_serde.memory.lifetime as l, gpu_serde.tensors.sharing as s\n"
    "print(l.RELEASE_GRACE_S, s.ARENA_BYTES >> 20)\n"
)


def import_with(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SHOW],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_number_in_the_environment_is_said_and_gpu_serde_imports_with_the_default(bad):
    done = import_with(GPU_SERDE_RELEASE_GRACE_S=bad, GPU_SERDE_SHARE_ARENA_MIB=bad)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5.0", "1024"]  # the defaults
    assert "GPU_SERDE_RELEASE_GRACE_S=" in done.stderr
    assert "is not a number of seconds, 0 or more: gpu_serde uses the default, 5" in done.stderr
    assert "GPU_SERDE_SHARE_ARENA_MIB=" in done.stderr
    assert "is not a whole number of MiB" in done.stderr
    assert "\x1b" not in done.stderr  # escaped, never echoed raw


def test_good_and_empty_values_are_taken_without_a_word():
    done = import_with(GPU_SERDE_RELEASE_GRACE_S="0.25", GPU_SERDE_SHARE_ARENA_MIB="64")
    assert (done.returncode, done.stdout.split()) == (0, ["0.25", "64"])
    assert "GPU_SERDE_" not in done.stderr
    done = import_with(GPU_SERDE_RELEASE_GRACE_S="", GPU_SERDE_SHARE_ARENA_MIB=" ")
    assert (done.returncode, done.stdout.split()) == (0, ["5.0", "1024"])
    assert "GPU_SERDE_" not in done.stderr


@pytest.mark.parametrize("bad", ["inf", "1e400", "nan", "-5", "soon"])
def test_a_keeper_that_would_never_end_or_a_bad_keep_s_is_refused(monkeypatch, bad):
    monkeypatch.setenv("GPU_SERDE_KEEP_S", bad)
    with pytest.raises(ValueError, match=r"is not a number of seconds \(0 or more, finite\)"):
        keeper.keep_s()


def test_an_empty_keep_s_is_the_default(monkeypatch):
    monkeypatch.setenv("GPU_SERDE_KEEP_S", "")
    assert keeper.keep_s() == keeper.KEEP_S


def test_an_empty_host_id_is_unset(monkeypatch):
    monkeypatch.setenv("GPU_SERDE_HOST_ID", "")
    monkeypatch.setattr(hostid, "_identity", None)
    assert hostid.label() == ""
    assert hostid.host_id() == hostid._boot_id()
