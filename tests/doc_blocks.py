"""The Python code blocks of a Markdown document, read with a Markdown parser, to run as written."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(doc: str, containing: str) -> list[str]:
    """The ```python blocks of ``doc`` (a path relative to the repository) that contain
    ``containing``, in document order."""
    from markdown_it import MarkdownIt

    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        tokens = MarkdownIt().parse(f.read())
    return [
        t.content
        for t in tokens
        if t.type == "fence" and t.info.strip() == "python" and containing in t.content
    ]


def run_block(code: str, env: dict[str, str], timeout: float = 180) -> str:
    """Run ``code`` as a script in a fresh Python with ``env``; return its stdout (fail on exit)."""
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout
