"""The Python code blocks of the Markdown docs, read with a Markdown parser, to run as written.

The convention (docs/building-docs.md tells writers): a fence's first word is its language, and
for Python a second word says how the test suite runs it (``tests/test_doc_blocks.py``):

- ```` ```python ````: a complete script, run in the CPU tier on four simulated GPUs;
- ```` ```python gpu ````: needs a real GPU (CuPy, kernels, ...): runs in the GPU tier, ``-m gpu``;
- ```` ```python fragment (why) ````: cannot run as a script (it connects to your cluster, shows
  one call); never run. The reason in brackets is required; the page says it to readers too.

A ```` ```text output ```` fence right after a run block is what that block prints: the test
compares it with the block's stdout.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from loopback import open_beyond_loopback, ours

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: How a ```python fence's second word marks it (empty: run in the CPU tier).
MARKERS = ("", "gpu", "fragment")
#: What a block that starts a cluster of its own calls.
CLUSTER = re.compile(r"\bray\.init\(|\bLocalCluster\(|\bSpecCluster\(|\bCluster\(")
#: Languages that are Python under another name: the test refuses them (they would escape it).
PYTHON_ALIASES = {"py", "python3", "py3", "pycon", "ipython", "ipython3"}


@dataclass(frozen=True)
class Block:
    """One ```python fence of a Markdown file."""

    doc: str  # the file, relative to the repository
    number: int  # 1 for the file's first ```python fence, 2 for its second, ...
    line: int  # the line of its opening fence (1-based)
    marker: str  # "", "gpu" or "fragment"
    reason: str  # a fragment's reason (without its brackets)
    code: str
    output: str | None  # the ```text output fence that follows it, if any

    @property
    def id(self) -> str:
        return f"{self.doc}#{self.number}"

    @property
    def starts_cluster(self) -> bool:
        """True when the block starts a Ray or Dask cluster of its own (the fast loop skips it)."""
        return bool(CLUSTER.search(self.code))


def doc_files() -> list[str]:
    """README.md and every Markdown file of docs/, relative to the repository."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *docs]


def _fences(doc: str) -> list:
    from markdown_it import MarkdownIt

    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return [t for t in MarkdownIt().parse(f.read()) if t.type == "fence"]


def blocks(doc: str) -> list[Block]:
    """The ```python fences of ``doc``, in order, with their markers and shown output.

    Raises:
        ValueError: a Python fence whose marker is unknown, a fragment without its reason, or a
            fence in a Python alias (``py``, ``pycon``, ...) that the test would not see.
    """
    found: list[Block] = []
    fences = _fences(doc)
    for i, t in enumerate(fences):
        info = t.info.strip()
        lang, _, rest = info.partition(" ")
        line = t.map[0] + 1
        if lang in PYTHON_ALIASES or (lang.startswith("{") and "python" in rest):
            raise ValueError(f"{doc}:{line}: write ```python (marked), not ```{info}")
        if lang != "python":
            continue
        marker, _, reason = rest.strip().partition(" ")
        reason = reason.strip()
        if marker not in MARKERS:
            raise ValueError(f"{doc}:{line}: unknown marker {marker!r} (one of {MARKERS[1:]})")
        if marker == "fragment":
            m = re.fullmatch(r"\((.+)\)", reason)
            if not m:
                raise ValueError(f"{doc}:{line}: a fragment says why: ```python fragment (why)")
            reason = m.group(1)
        elif reason:
            raise ValueError(f"{doc}:{line}: unexpected words after the marker: {reason!r}")
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        output = None
        if nxt is not None and nxt.info.strip() == "text output":
            output = nxt.content
        found.append(Block(doc, len(found) + 1, line, marker, reason, t.content, output))
    return found


def all_blocks() -> list[Block]:
    """Every ```python fence of README.md and docs/*.md."""
    return [b for doc in doc_files() for b in blocks(doc)]


def python_blocks(doc: str, containing: str) -> list[str]:
    """The run-as-written ```python blocks of ``doc`` (a path relative to the repository) that
    contain ``containing``, in document order."""
    return [b.code for b in blocks(doc) if b.marker == "" and containing in b.code]


def run_block(code: str, env: dict[str, str], timeout: float = 180) -> str:
    """Run ``code`` as a script in a fresh Python with ``env``; return its stdout (fail on exit)."""
    done = run_script(code, env, timeout)
    assert done.returncode == 0, f"exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def run_script(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python block.py`` in a folder of its own, as a user runs a saved script
    (so a missing ``if __name__ == "__main__":`` guard fails, as it does for them).

    The script gets its own session; whatever it leaves running (a local Ray or Dask cluster) is
    killed with that session's process group when it exits or times out. Ray's files go to the
    folder too (``RAY_TMPDIR``), so that ``ray.init()`` starts a cluster of its own instead of
    joining one that something else started on this machine.
    """
    with tempfile.TemporaryDirectory(prefix="doc-", dir="/tmp") as folder:
        script = os.path.join(folder, "block.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        env = dict(env, RAY_TMPDIR=folder, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, script],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        before = open_beyond_loopback()
        deadline = time.monotonic() + timeout
        beyond: set[tuple[str, str, int, str]] = set()
        try:
            while True:  # the block's sockets, while it runs: all on loopback (tests/loopback.py)
                try:
                    out, err = proc.communicate(timeout=0.25)
                    code_ = proc.returncode
                    break
                except subprocess.TimeoutExpired:
                    beyond |= set(ours(open_beyond_loopback() - before - beyond))
                    if time.monotonic() > deadline:
                        _kill_group(proc.pid)
                        out, err = proc.communicate()
                        err += f"\n[doc_blocks] killed after {timeout} s"
                        code_ = -signal.SIGKILL
                        break
        finally:
            _kill_group(proc.pid)
        if beyond and code_ == 0:
            code_ = 1
            err += "\n[doc_blocks] it listened beyond loopback: " + ", ".join(
                f"{table} {address}:{port}" for table, address, port, _ in sorted(beyond)
            )
        return subprocess.CompletedProcess(proc.args, code_, out, err)


def _kill_group(pgid: int) -> None:
    """Kill the process group this module started (the script and everything it left)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
