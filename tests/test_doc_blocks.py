"""Every Python code block of README.md and docs/*.md runs as written.

The blocks are read from the files (not copied here) and each runs as a saved script in a fresh
interpreter, in a folder of its own, with a timeout: the CPU tier on four simulated GPUs (the
environment carries them, the blocks do not), the ```` ```python gpu ```` blocks in the GPU tier
(``-m gpu``) on the real GPU. A block that needs a cluster starts its own local one. A
```` ```text output ```` fence after a block is what it must print. The marking convention is in
``tests/doc_blocks.py`` and docs/building-docs.md. Ids name the file and the block's number among
its ```python fences: ``docs/memory.md#1``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("markdown_it", reason="the docs extra reads the docs' code blocks")

from doc_blocks import ROOT, all_blocks, doc_files, run_script

from gpu_serde.testing import child_env
from helpers import env_without_driver

BLOCKS = all_blocks()  # a malformed marker fails collection, naming the file and line
TIMEOUT_S = 240


def _marks(b) -> list:
    return [
        *([pytest.mark.gpu] if b.marker == "gpu" else []),
        *([pytest.mark.slow] if b.starts_cluster else []),
    ]


RUNNABLE = [pytest.param(b, id=b.id, marks=_marks(b)) for b in BLOCKS if b.marker != "fragment"]


RUNNABLE_BLOCKS = [b for b in BLOCKS if b.marker == ""]  # run in the CPU tier


#: A block that calls a bare ``Client()`` joins the scheduler at ``$DASK_SCHEDULER_ADDRESS``, as
#: its page says; without one, distributed would start a local cluster whose dashboard listens on
#: every interface (":8787"), which no test may.
BARE_CLIENT = re.compile(r"\bClient\(\)")


@pytest.fixture(scope="module")
def loopback_scheduler(simulated_gpus):
    """A local Dask cluster on loopback, its dashboard too: its scheduler's address."""
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=1, threads_per_worker=1, host="127.0.0.1", dashboard_address="127.0.0.1:0"
    ) as cluster:
        yield cluster.scheduler_address


@pytest.mark.parametrize("block", RUNNABLE)
def test_the_block_runs_as_written(block, request):
    if block.marker == "gpu":
        request.getfixturevalue("real_gpu")  # fails, never skips, without one
        env = env_without_driver()
    else:
        env = child_env(request.getfixturevalue("simulated_gpus"))
    if BARE_CLIENT.search(block.code):
        env["DASK_SCHEDULER_ADDRESS"] = request.getfixturevalue("loopback_scheduler")
    done = run_script(block.code, env, TIMEOUT_S)
    where = f"{block.doc}, python block {block.number} (line {block.line})"
    assert done.returncode == 0, (
        f"{where} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-6000:]}"
    )
    if block.output is not None:
        assert done.stdout.strip() == block.output.strip(), (
            f"{where} printed what its ```text output block does not show"
        )


def test_every_python_block_is_marked_and_fragments_are_few():
    assert BLOCKS, "no ```python block found: is the parser reading the files?"
    fragments = [f"{b.id}: {b.reason}" for b in BLOCKS if b.marker == "fragment"]
    assert len(fragments) <= 4, fragments  # complete scripts, where at all possible
    assert all(b.output is None or b.marker != "fragment" for b in BLOCKS)  # nothing checks it


# A line of Markdown that starts with ">" (after a list marker too) is a quote: "- >= 100x the
# copy" renders as "= 100x the copy". Write "at least", "at most", or put the comparison in code.
QUOTE_BY_ACCIDENT = re.compile(r"^\s*(?:[-*+]\s+|\d+[.)]\s+)?(?:>=?|<=?)(?:\s|\d)")


@pytest.mark.parametrize("doc", doc_files())
def test_no_line_starts_with_a_comparison_that_markdown_reads_as_a_quote(doc):
    lines = []
    in_fence = False
    for n, line in enumerate((Path(ROOT) / doc).read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
        elif not in_fence and QUOTE_BY_ACCIDENT.match(line):
            lines.append(f"{doc}:{n}: {line.strip()}")
    assert lines == []


NO_GPU_NOTE = '**No GPU here?** Every example on this page runs on simulated GPUs: run\n`eval "$(gpu-serde simulate 4)"`'


@pytest.mark.parametrize("doc", sorted({b.doc for b in RUNNABLE_BLOCKS}))
def test_a_page_with_examples_says_first_how_to_run_them_without_a_gpu(doc):
    text = (Path(ROOT) / doc).read_text(encoding="utf-8")
    first = min(b.line for b in RUNNABLE_BLOCKS if b.doc == doc)
    before = "\n".join(text.splitlines()[: first - 1])
    assert NO_GPU_NOTE in before, (
        f"{doc}: the note on simulated GPUs is not before its first example"
    )
    if doc != "README.md":  # the README's examples start after its install section
        assert NO_GPU_NOTE in "\n".join(text.splitlines()[:6]), f"{doc}: not in its first lines"


def test_no_example_makes_its_own_gpus_unless_it_is_about_them():
    own = [b.id for b in RUNNABLE_BLOCKS if "real_driver_present" in b.code]
    assert own == []  # pages say how to run them on simulated GPUs instead (the note above)
