"""``gpu-serde doctor --ray`` reaches a cluster started with a plain ``ray start --head``, whose
token authentication Ray 2.60 turns on when the head has a token, and says why and what to do
when it cannot connect.

The head runs on 127.0.0.1 with a HOME of its own (its ``~/.ray/auth_token`` made by
``ray get-auth-token --generate``), so the machine's own token is left alone; the doctor runs as a
user on that host would: with the same HOME (it has the token), or with another (it has none).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import ray

from gpu_serde.testing.clusters import Processes, cli, free_port

pytestmark = (
    pytest.mark.slow
)  # CLI-started clusters: the fast loop (scripts/test-fast) leaves them out

if tuple(int(x) for x in ray.__version__.split(".")[:2]) < (2, 60):
    pytest.skip("token authentication arrived in Ray 2.60", allow_module_level=True)


def plain_env(home: str) -> dict[str, str]:
    """This environment as a user's shell: no RAY_AUTH_MODE, HOME ``home``, loopback only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=home, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0")
    return env


@pytest.fixture(scope="module")
def head():
    """A plain ``ray start --head`` on 127.0.0.1, whose HOME has a token: ``(address, home)``."""
    tmp = tempfile.mkdtemp(prefix="gsa-", dir="/tmp")  # short: Ray's socket paths are limited
    home = os.path.join(tmp, "home")
    os.mkdir(home)
    env = plain_env(home)
    subprocess.run(
        [cli("ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True
    )
    procs = Processes(tmp)
    port = free_port()
    log = os.path.join(tmp, "head.log")
    args = ["start", "--head", "--block", "--port", str(port), "--node-ip-address", "127.0.0.1"]
    args += ["--num-cpus", "1", "--num-gpus", "0", "--include-dashboard", "false"]
    args += ["--temp-dir", tmp, "--disable-usage-stats"]
    try:
        p = procs.start([cli("ray"), *args], env, log)
        procs.wait_for(p, log, "Ray runtime started")
        with open(log, errors="replace") as f:
            assert "Token authentication is enabled" in f.read()  # a plain start turned it on
        yield f"127.0.0.1:{port}", home
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def doctor(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpu_serde", "doctor", "--ray", address, "--timeout", "30"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def test_the_doctor_reaches_a_plain_ray_start_head_with_its_token(head):
    address, home = head
    done = doctor(address, plain_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "1 worker(s), 0 process(es) with problems: OK"


def test_without_the_token_the_doctor_says_why_and_what_to_do(head, tmp_path):
    address, _ = head
    done = doctor(address, plain_env(str(tmp_path)))  # a HOME without ~/.ray/auth_token
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpu-serde: doctor: cannot reach the cluster at '{address}': the cluster uses Ray's "
        "token authentication (Ray 2.60's `ray start --head` turns it on when the head has a "
        "token), and this process has no token: run `ray get-auth-token` on the cluster's head "
        "node and put what it prints in ~/.ray/auth_token here (or in RAY_AUTH_TOKEN), then run "
        "the doctor again"
    ]
