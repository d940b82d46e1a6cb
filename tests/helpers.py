"""Run snippets in child processes and read back what they saw."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence

CHILD_PRELUDE = """
import base64, json, os, pickle, sys
import gpu_serde
data = base64.b64decode(sys.argv[1]) if len(sys.argv) > 1 else b""
def report(**kw):
    print("RESULT " + json.dumps(kw))
"""


#: this folder: a child that imports these helpers has it on its PYTHONPATH
TESTS = os.path.dirname(os.path.abspath(__file__))


def run_child(
    code: str,
    env: dict[str, str],
    data: bytes = b"",
    timeout: float = 60,
    args: Sequence[str] = (),
) -> dict:
    """Run ``code`` in a fresh Python with ``env`` (``data`` as ``data``, ``args`` after it in
    ``sys.argv``); return what it passed to ``report(...)``."""
    script = CHILD_PRELUDE + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script, base64.b64encode(data).decode(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(
        f"child exited {done.returncode} without a result\nstdout:\n{done.stdout}\n"
        f"stderr:\n{done.stderr}"
    )


def env_without_driver() -> dict[str, str]:
    """This environment without the simulated driver (and so, on a CPU machine, without any)."""
    env = dict(os.environ)
    env.pop("GPU_SERDE_SIM_GPUS", None)
    env["LD_LIBRARY_PATH"] = ":".join(
        p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p and "simdriver-" not in p
    )
    return env


def report_device(queue, device) -> None:
    """multiprocessing target: put what the child received on ``queue``."""
    import gpu_serde

    try:
        d = gpu_serde.resolve(device)
        queue.put(("ok", d.device_id, d.uuid))
    except gpu_serde.DeviceNotVisibleError as exc:
        queue.put(("not visible", exc.uuid, str(exc)))


def echo_from_queue(inbox, outbox) -> None:
    """multiprocessing target: read a Device from ``inbox``, report it on ``outbox``."""
    report_device(outbox, inbox.get(timeout=60))
