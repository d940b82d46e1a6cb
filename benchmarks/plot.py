"""The performance page's plots and tables, from the benchmarks' saved results.

    python benchmarks/plot.py [FILE_OR_FOLDER ...] [--check]

Reads every data file given (default: ``benchmarks/results/*.json``, the format that the
benchmarks' ``--json PATH`` writes; benchmarks/results/README.md), then writes

- ``docs/_static/perf-handoff.svg``: a GPU buffer's hand-off time against its size, log-log, per
  engine: gpu_serde (pool that keeps its memory, new memory), cuda.core's multiprocessing path, a
  copy through host memory, and what Ray and Dask do with a torch CUDA tensor by default;
- ``docs/_static/perf-task-overhead.svg``: a task's round trip with a Device argument against the
  same task with an int;
- the tables between the ``<!-- plot.py: NAME -->`` and ``<!-- plot.py: NAME end -->`` lines of
  docs/performance.md: the headline ratios and the data files behind them.

Where several files hold the same series, the newest (by ``date``; files without one count as
oldest) draws the line and the others are shown as faint points. A new run therefore slots in by
adding its file and running this script again. ``--check`` writes the plots to a temporary
folder and fails when the page's tables are not what the data give (CI runs it).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import _results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
STATIC = os.path.join(ROOT, "docs", "_static")
PAGE = os.path.join(ROOT, "docs", "performance.md")
FORMAT = "gpu_serde-benchmark-results/1"
SIZES = [(1 << 20, "1 MiB"), (64 << 20, "64 MiB"), (1 << 30, "1 GiB"), (4 << 30, "4 GiB")]
GIB = 1 << 30
#: The host name a cluster's nodes typically have: a 32-character fully qualified name.
REALISTIC_HOST = "gpu-node-017.cluster.example.com"


@dataclass
class Run:
    """One data file: one run of one command (or a transcription of one)."""

    path: str
    doc: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return os.path.relpath(self.path, ROOT)

    @property
    def date(self) -> str:
        return self.doc.get("date") or ""

    @property
    def real_gpu(self) -> bool:
        return not self.doc.get("machine", {}).get("simulated", True)

    @property
    def order(self) -> tuple[str, str]:
        """Newest last: by date (none: oldest), then by file name."""
        return (self.date, os.path.basename(self.path))

    def machine(self) -> str:
        m = self.doc.get("machine", {})
        gpu = m.get("gpu") or "no GPU"
        if m.get("simulated"):
            gpu = f"{m.get('gpu_count', '?')} simulated GPUs"
        driver = f", driver {m['driver']}" if m.get("driver") else ""
        cuda = f", CUDA {m['cuda_driver_api']}" if m.get("cuda_driver_api") else ""
        cpus = f", {m['cpus']} CPUs" if m.get("cpus") else ""
        return f"{gpu}{driver}{cuda}{cpus}"

    def versions(self) -> str:
        v = self.doc.get("versions", {})
        keys = ("python", "cuda-core", "cuda-bindings", "ray", "distributed")
        names = {"python": "Python"}
        return ", ".join(f"{names.get(k, k)} {v[k]}" for k in keys if k in v)


def load(paths: list[str]) -> list[Run]:
    """The data files named (folders: their ``*.json``), oldest first.

    Raises:
        SystemExit: a file is not in the format this script reads.
    """
    files: list[str] = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
    runs = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            doc = json.load(fh)
        if doc.get("format") != FORMAT:
            raise SystemExit(f"{f}: not a {FORMAT} file (format {doc.get('format')!r})")
        runs.append(Run(f, doc, list(doc.get("results", []))))
    return sorted(runs, key=lambda r: r.order)


def rows_of(run: Run, **match: Any) -> list[dict[str, Any]]:
    return [r for r in run.rows if all(r.get(k) == v for k, v in match.items())]


def newest(runs: list[Run], *, real: bool = True, **match: Any) -> tuple[Run, list[dict]] | None:
    """The newest run with rows matching ``match`` (on a real GPU unless ``real`` is False)."""
    for run in reversed(runs):
        if real and not run.real_gpu:
            continue
        found = rows_of(run, **match)
        if found:
            return run, found
    return None


# --- the hand-off plot ---------------------------------------------------------------------------

STYLE = {  # series: (label, colour, line style, marker); the same in every panel
    "gpu_serde.kept": ("gpu_serde, pool keeps its memory", "#1b7f2a", "-", "o"),
    "gpu_serde.new": ("gpu_serde, new memory", "#1b7f2a", "--", "s"),
    "gpu_serde.default": ("gpu_serde, cuda.core's default pool", "#7cc47f", ":", "^"),
    "cuda_core.mp": ("cuda.core's own multiprocessing path", "#6a1b9a", "-", "D"),
    "host_copy": ("a copy through host memory", "#616161", "-", "x"),
    "engine_default.torch": ("Ray's or Dask's default, torch CUDA tensor", "#c62828", "-", "v"),
    "ray_rdt.cuda_ipc.torch": (
        "Ray Direct Transport, cuda_ipc, torch (actor to actor)",
        "#ef6c00",
        "-.",
        "P",
    ),
    "dask.cupy": ("Dask's own serialization, CuPy (worker to worker)", "#ef6c00", ":", "X"),
    "gpu_serde.arena": ("gpu_serde ArenaMemoryResource", "#0d47a1", "-", "*"),
    "torch.mp": ("torch.multiprocessing, CUDA IPC (torch)", "#ef6c00", "--", "d"),
}
ARENA_PANELS = [  # the hand-off table of one handoff_table.py run: (title, engine, path, series)
    (
        "Ray: actor to actor",
        "ray",
        "actor to actor",
        ["gpu_serde.arena", "gpu_serde.kept", "ray_rdt.cuda_ipc.torch", "engine_default.torch"],
    ),
    (
        "Ray: task to task",
        "ray",
        "task to task",
        ["gpu_serde.arena", "gpu_serde.kept", "engine_default.torch"],
    ),
    (
        "Dask: worker to worker",
        "dask",
        "worker to worker",
        ["gpu_serde.arena", "gpu_serde.kept", "dask.cupy"],
    ),
    (
        "multiprocessing.Queue",
        "multiprocessing",
        "queue",
        ["gpu_serde.arena", "gpu_serde.kept", "torch.mp"],
    ),
]
ARENA_SIZES = [*SIZES, (16 << 30, "16 GiB")]
PANELS = [  # (title, engine, [(series, path), ...])
    (
        "multiprocessing.Queue, to a warm child",
        "multiprocessing",
        [
            ("gpu_serde.kept", "queue"),
            ("gpu_serde.default", "queue"),
            ("cuda_core.mp", "queue"),
            ("host_copy", "in one process"),
        ],
    ),
    (
        "Ray: a task argument",
        "ray",
        [
            ("gpu_serde.kept", "task argument"),
            ("gpu_serde.new", "task argument"),
            ("host_copy", "task argument"),
            ("engine_default.torch", "task argument"),
            ("ray_rdt.cuda_ipc.torch", "actor to actor"),
        ],
    ),
    (
        "Dask: a task argument",
        "dask",
        [
            ("gpu_serde.kept", "task argument"),
            ("gpu_serde.new", "task argument"),
            ("host_copy", "task argument"),
            ("engine_default.torch", "task argument"),
            ("dask.cupy", "worker to worker"),
        ],
    ),
]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.hashsalt": "gpu_serde",  # the same data give the same file
            "svg.fonttype": "path",  # text as shapes: the same in every browser
            "font.family": "DejaVu Sans",  # matplotlib's own font: the same on every machine
            "font.size": 11.5,
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return plt


def _points(rows: list[dict]) -> tuple[list[int], list[float], list[float], list[float]]:
    rows = sorted((r for r in rows if "size_bytes" in r), key=lambda r: r["size_bytes"])
    xs = [r["size_bytes"] for r in rows]
    ys = [r["value"] * 1e3 for r in rows]
    lo = [max(r["value"] - r.get("low", r["value"]), 0) * 1e3 for r in rows]
    hi = [max(r.get("high", r["value"]) - r["value"], 0) * 1e3 for r in rows]
    # an interval that reaches below zero (Dask's noise) is drawn down to the plot's floor
    lo = [min(d, y * 0.95) for d, y in zip(lo, ys, strict=True)]
    return xs, ys, lo, hi


def _size_axis(ax: Any, title: str, sizes: list[tuple[int, str]]) -> None:
    """A panel whose x axis is the buffer size, log 2, one tick per size."""
    ax.set_title(title, fontsize=12.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([s for s, _ in sizes], [n for _, n in sizes], rotation=35, ha="right")
    ax.minorticks_off()
    ax.set_xlim(sizes[0][0] / 1.6, sizes[-1][0] * 1.6)
    ax.grid(True, which="major", color="#dddddd", lw=0.8)
    ax.set_xlabel("buffer size")


def _time_axis(ax: Any, label: str, top: float) -> None:
    """The shared y axis: milliseconds, log 10, from 0.05 to ``top``."""
    ax.set_ylabel(label)
    ax.set_ylim(0.05, top)
    ticks = [0.1, 1, 10, 100, 1e3, 1e4]
    ax.set_yticks(ticks, ["0.1", "1", "10", "100", "1,000", "10,000"])


def plot_handoff(runs: list[Run], out: str) -> list[Run]:
    """Write the hand-off plot to ``out``; return the runs it drew from."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 6), sharey=True)
    used: list[Run] = []
    drawn: dict[str, Any] = {}
    for ax, (title, engine, series) in zip(axes, PANELS, strict=True):
        for name, path in series:
            label, colour, line, marker = STYLE[name]
            match = {"metric": "handoff", "engine": engine, "series": name, "path": path}
            top = newest(runs, **match)
            if top is None:
                continue
            run, rows = top
            for other in runs:  # other runs of the same series: faint points
                if other is run:
                    continue
                xs, ys, _, _ = _points(rows_of(other, **match))
                if xs:
                    ax.plot(xs, ys, marker, color=colour, alpha=0.35, ms=6, ls="none")
                    used.append(other)
            xs, ys, lo, hi = _points(rows)
            drawn[name] = ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi] if any(lo) or any(hi) else None,
                color=colour,
                ls=line,
                marker=marker,
                ms=7,
                lw=2.2 if name.startswith("gpu_serde") else 1.6,
                capsize=3,
                label=label,
            )
            used.append(run)
        _size_axis(ax, title, SIZES)
    _time_axis(axes[0], "hand-off time (ms, log scale)", 5e4)
    order = [name for name in STYLE if name in drawn]
    fig.legend(
        [drawn[n] for n in order],
        [STYLE[n][0] for n in order],
        loc="lower center",
        ncol=2,
        fontsize=11,
        frameon=False,
        bbox_to_anchor=(0.5, 0.045),
    )
    machines = sorted({r.machine() for r in used})
    fig.text(
        0.5,
        0.01,
        "Lines: the newest run of each series; faint points: other runs. "
        + "; ".join(machines)
        + ". Data: benchmarks/results/.",
        fontsize=9,
        color="#555555",
        ha="center",
    )
    fig.tight_layout(rect=(0, 0.25, 1, 1))
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)
    return used


# --- the task-overhead plot ----------------------------------------------------------------------

ENGINE = {"ray": "Ray", "dask": "Dask"}


def overhead_points(runs: list[Run]) -> list[dict[str, Any]]:
    """Per run and engine: the Device task's round trip over the int task's (and cuda.core's
    ordinal pickle's, where measured)."""
    points = []
    for run in runs:
        for engine in ENGINE:
            times = {
                r["series"]: r["value"]
                for r in rows_of(run, metric="task_round_trip", engine=engine)
            }
            ratios = {
                r["series"]: r["value"] for r in rows_of(run, metric="task_ratio", engine=engine)
            }
            if "int" in times:
                ratios.update({k: v / times["int"] for k, v in times.items() if k != "int"})
            if "gpu_serde.device" not in ratios:
                continue
            points.append(
                {
                    "run": run,
                    "engine": engine,
                    "device": ratios["gpu_serde.device"],
                    "ordinal": ratios.get("cuda.core.ordinal"),
                    "int_s": times.get("int"),
                }
            )
    return points


def plot_overhead(runs: list[Run], out: str) -> list[Run]:
    """Write the task-overhead plot to ``out``; return the runs it drew from."""
    plt = _pyplot()
    points = sorted(overhead_points(runs), key=lambda p: (p["engine"] != "ray", p["run"].order))
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(points) + 1.6))
    ax.axvspan(1.0, 1.05, color="#e8f5e9", zorder=0)
    ax.axvline(1.0, color="#888888", lw=1)
    labels = []
    for i, p in enumerate(points):
        run = p["run"]
        version = run.doc.get("versions", {}).get("ray" if p["engine"] == "ray" else "distributed")
        where = "an H200 machine" if run.real_gpu else "2 CPUs, simulated GPUs"
        if run.real_gpu and run.doc.get("machine", {}).get("gpu") != "NVIDIA H200":
            where = run.doc["machine"].get("gpu", "a GPU machine")
        labels.append(f"{ENGINE[p['engine']]} {version or ''}, {where}, {run.date or '?'}")
        ax.plot(p["device"], i, "o", color="#1b7f2a", ms=9, zorder=3)
        text = f"{p['device']:.3f}x"
        if p["int_s"]:
            text += f"  (an int task: {p['int_s'] * 1e3:.2f} ms)"
        ax.annotate(text, (p["device"], i), xytext=(8, 6), textcoords="offset points", fontsize=9)
        if p["ordinal"] is not None:
            ax.plot(p["ordinal"], i, "D", mfc="none", color="#6a1b9a", ms=8, zorder=3)
    ax.set_yticks(range(len(points)), labels)
    ax.invert_yaxis()
    ax.set_xlim(0.95, 1.15)
    ax.set_ylim(len(points) - 0.4, -0.8)
    ax.set_xlabel("round trip of a task with a Device argument / the same task with an int")
    ax.plot([], [], "o", color="#1b7f2a", label="a Device, sent by gpu_serde (by UUID)")
    ax.plot([], [], "D", mfc="none", color="#6a1b9a", label="a Device, cuda.core's own pickle")
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=10, frameon=False)
    ax.grid(True, axis="x", color="#dddddd", lw=0.8)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)
    return [p["run"] for p in points]


def handoff_table_run(runs: list[Run]) -> Run | None:
    """The newest real-GPU run of ``handoff_table.py`` (its table comes from one run)."""
    found = [r for r in runs if r.real_gpu and r.doc.get("benchmark") == "handoff_table"]
    return found[-1] if found else None


def plot_arena(runs: list[Run], out: str) -> list[Run]:
    """Write the arena plot (issue 22's table, one run) to ``out``; return the run it drew."""
    run = handoff_table_run(runs)
    if run is None:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(13, 6), sharey=True)
    drawn: dict[str, Any] = {}
    for ax, (title, engine, path, series) in zip(axes, ARENA_PANELS, strict=True):
        for name in series:
            label, colour, line, marker = STYLE[name]
            rows = rows_of(run, metric="handoff", engine=engine, series=name, path=path)
            # Dask's round trip moves by about 1 ms between rounds: a median below the plot's
            # floor (or below zero) is drawn at the floor
            rows = [{**r, "value": max(r["value"], 0.06e-3)} for r in rows]
            xs, ys, lo, hi = _points(rows)
            if not xs:
                continue
            drawn[name] = ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                color=colour,
                ls=line,
                marker=marker,
                ms=8,
                lw=2.4 if name == "gpu_serde.arena" else 1.6,
                capsize=3,
                label=label,
            )
        _size_axis(ax, title, ARENA_SIZES)
    _time_axis(axes[0], "added to the engine's round trip (ms, log scale)", 2e4)
    order = [name for name in STYLE if name in drawn]
    fig.legend(
        [drawn[n] for n in order],
        [STYLE[n][0] for n in order],
        loc="lower center",
        ncol=3,
        fontsize=11,
        frameon=False,
        bbox_to_anchor=(0.5, 0.02),
    )
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(out, metadata={"Date": None})
    plt.close(fig)
    return [run]


# --- the tables ----------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.2f} ms"


def _times(ratio: float) -> str:
    if ratio >= 100:
        digits = len(str(int(ratio))) - 2
        return f"{round(ratio, -digits):,.0f}x"
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"


def _at(runs: list[Run], size: int, **match: Any) -> tuple[Run, dict] | None:
    """The newest real-GPU row of ``match`` at ``size``."""
    for run in reversed(runs):
        if not run.real_gpu:
            continue
        for r in rows_of(run, **match):
            if r.get("size_bytes") == size:
                return run, r
    return None


def _pair(ours: float, theirs: float) -> str:
    """Their time, and how many times gpu_serde's it is."""
    return f"{_ms(theirs)} ({_times(theirs / ours)})"


def headlines(runs: list[Run]) -> tuple[str, list[Run]]:
    """The headline tables (Markdown), and the runs they quote."""
    used: list[Run] = []

    def at(engine: str, series: str, path: str) -> dict | None:
        found = _at(runs, GIB, metric="handoff", engine=engine, series=series, path=path)
        if found is None:
            return None
        used.append(found[0])
        return found[1]

    lines = [
        "| a 1 GiB GPU buffer | gpu_serde | the engine's default, torch CUDA tensor | a copy "
        "through host memory | cuda.core's own path |",
        "|---|---|---|---|---|",
    ]
    for engine, what in (("ray", "to a Ray task"), ("dask", "to a Dask task")):
        kept = at(engine, "gpu_serde.kept", "task argument")
        if kept is None:
            continue
        default = at(engine, "engine_default.torch", "task argument")
        copy = at(engine, "host_copy", "task argument")
        ours = kept["value"]
        cells = [
            _pair(ours, default["value"]) if default else "not measured",
            _pair(ours, copy["value"]) if copy else "not measured",
            "\N{EN DASH}",
        ]
        lines.append(f"| {what} | {_ms(ours)} | " + " | ".join(cells) + " |")
    kept = at("multiprocessing", "gpu_serde.default", "queue")
    if kept:
        copy = at("multiprocessing", "host_copy", "in one process")
        theirs = at("multiprocessing", "cuda_core.mp", "queue")
        ours = kept["value"]
        cells = [
            "not measured",
            _pair(ours, copy["value"]) if copy else "not measured",
            f"{_ms(theirs['value'])} ({theirs['value'] / ours:.2f}x)" if theirs else "not measured",
        ]
        lines.append(f"| on a `multiprocessing.Queue` | {_ms(ours)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| a Device | gpu_serde | cuda.core's own pickle (by ordinal) |",
        "|---|---|---|",
    ]
    real = [r for r in runs if r.real_gpu]
    for engine, what in (("ray", "Ray"), ("dask", "Dask")):
        points = [p for p in overhead_points(real) if p["engine"] == engine]
        if not points:
            continue
        p = max(points, key=lambda p: p["run"].order)
        used.append(p["run"])

        def over(ratio: float | None) -> str:
            if ratio is None:
                return "not measured"
            pct = (ratio - 1) * 100
            return "level" if abs(pct) < 0.5 else f"{pct:+.1f}%"

        lines.append(
            f"| as a {what} task argument: its round trip over an int's | {over(p['device'])} "
            f"| {over(p['ordinal'])} |"
        )
    size = newest(runs, metric="payload_bytes", engine="pickle")
    if size:
        run, rows = size
        used.append(run)
        base = next(r["value"] for r in rows if r["series"] == "cuda.core")
        ours = next(
            r for r in rows if r["series"] == "gpu_serde" and r.get("host_name_length") is not None
        )
        n = ours["host_name_length"]
        longer = ours["value"] + len(REALISTIC_HOST) - n
        lines.append(
            f"| pickled size | {ours['value']} bytes from a host whose name has {n} characters, "
            f"{longer} from one of {len(REALISTIC_HOST)} | {base} bytes |"
        )
    gpus = sorted({r.machine() for r in used})
    days = sorted({r.date for r in used if r.date})
    undated = any(not r.date for r in used)
    lines += [
        "",
        f"Measured on {'; '.join(gpus)}, on {' and '.join(days)}"
        + (" (the engines' defaults on a day not noted)" if undated else "")
        + ". In brackets: that time over gpu_serde's. cuda.core's own path exists only over "
        "multiprocessing.",
    ]
    return "\n".join(lines), used


def arena_table(runs: list[Run]) -> str:
    """Issue 22's headline numbers from the newest ``handoff_table.py`` run (Markdown)."""
    run = handoff_table_run(runs)
    if run is None:
        return "No run of `benchmarks/handoff_table.py` on a real GPU yet."

    def value(engine: str, path: str, series: str, size: int, metric: str = "handoff") -> Any:
        for r in rows_of(run, metric=metric, engine=engine, series=series, path=path):
            if r.get("size_bytes") == size:
                return r["value"]
        return None

    def cell(v: Any) -> str:
        return "not run" if v is None else _ms(v)

    lines = [
        "| from a process to another | arena, 1 MiB | 1 GiB | 16 GiB | first hand-off from a new "
        "1 GiB region | at 1 GiB: pool that keeps memory | the engine's other ways |",
        "|---|---|---|---|---|---|---|",
    ]
    others = {
        "ray_rdt.cuda_ipc.torch": "RDT cuda_ipc",
        "engine_default.torch": "default (torch)",
        "dask.cupy": "default (CuPy)",
        "torch.mp": "torch.multiprocessing",
    }
    for title, engine, path, series in ARENA_PANELS:
        arena = [value(engine, path, "gpu_serde.arena", s) for s in (1 << 20, GIB, 16 * GIB)]
        first = value(engine, path, "gpu_serde.arena", GIB, "handoff_first")
        kept = value(engine, path, "gpu_serde.kept", GIB)
        theirs = []
        for name in series[2:]:
            v = value(engine, path, name, GIB)
            if v is not None:
                ratio = f" ({_times(v / arena[1])})" if arena[1] and arena[1] > 0.05e-3 else ""
                theirs.append(f"{others[name]} {_ms(v)}{ratio}")
        lines.append(
            f"| {title} | " + " | ".join(cell(v) for v in arena) + f" | {cell(first)} | "
            f"{cell(kept)} | {'; '.join(theirs) or '-'} |"
        )
    lines += [
        "",
        f"One run of `benchmarks/handoff_table.py` on {run.machine()}, {run.date}: what each "
        "hand-off adds to the engine's round trip with an int (median of 31 interleaved rounds; "
        "the slow defaults: 3 rounds). In brackets: that time over the arena's at 1 GiB. A "
        "negative median is below the engine's own noise.",
    ]
    return "\n".join(lines)


def floor_table(runs: list[Run]) -> str:
    """Issue 31's table from the newest ``handoff_table.py`` run: what the arena adds over the
    engine's own cost for a plain object of its payload's size, size by size; a buffer sent again
    and one sent after other GPU traffic against a fresh one (worst size); the first hand-off from
    a new region, by its size (Markdown)."""
    run = handoff_table_run(runs)
    if run is None:
        return "No run of `benchmarks/handoff_table.py` on a real GPU yet."

    def at(engine: str, path: str, series: str, metric: str = "handoff") -> dict[int, float]:
        return {
            r["size_bytes"]: r["value"]
            for r in rows_of(run, metric=metric, engine=engine, series=series, path=path)
        }

    head = " | ".join(name for _, name in ARENA_SIZES)
    lines = [
        f"| from a process to another | the engine's cost for a plain object, 1 MiB | arena over "
        f"it: {head} | target | the same buffer sent again, minus a fresh one (worst size) | "
        "right after other GPU traffic, minus a fresh one (worst size) |",
        "|---|---|" + "---|" * len(ARENA_SIZES) + "---|---|---|",
    ]
    targets = {_results.ENGINES[k]: v for k, v in _results.OVER_PLAIN_S.items()}
    firsts = []
    for title, engine, path, _ in ARENA_PANELS:
        plain = at(engine, path, "engine.plain_object")
        arena = at(engine, path, "gpu_serde.arena")
        if not plain or not arena:
            continue
        over = [
            _ms(arena[size] - plain[size]) if size in arena and size in plain else "not run"
            for size, _ in ARENA_SIZES
        ]
        worst = []
        for series in ("gpu_serde.arena.sent_again", "gpu_serde.arena.after_traffic"):
            other = at(engine, path, series)
            diffs = [(other[s] - arena[s], s) for s in other if s in arena]
            if diffs:
                d, s = max(diffs)
                worst.append(f"{_ms(d)} ({_results.label(s)})")
            else:
                worst.append("not run")
        target = targets.get((engine, path))
        lines.append(
            f"| {title} | {_ms(plain.get(1 << 20, float('nan')))} | "
            + " | ".join(over)
            + f" | {('<= ' + _ms(target)) if target else 'none'} | "
            + " | ".join(worst)
            + " |"
        )
        first = at(engine, path, "gpu_serde.arena", "handoff_first")
        if first:
            firsts.append(
                f"{title}: "
                + ", ".join(f"{_ms(v)} ({_results.label(s)})" for s, v in sorted(first.items()))
            )
    lines += [
        "",
        f"One run of `benchmarks/handoff_table.py` on {run.machine()}, {run.date}: medians of 31 "
        'interleaved rounds, each a round trip minus the int\'s in the same round; "over it" is '
        "the arena's median minus the plain object's. The first hand-off from a new region (the "
        "receiver maps it), by region size, median of 3 (16 GiB: 1): " + "; ".join(firsts) + ".",
    ]
    return "\n".join(lines)


def cross_host_table(runs: list[Run]) -> str:
    """The newest ``cross_host.py`` run: gpu_serde beside the engine moving a host array."""
    found = [r for r in runs if r.real_gpu and r.doc.get("benchmark") == "cross_host"]
    if not found:
        return "No run of `benchmarks/cross_host.py` on a real GPU yet."
    run = found[-1]
    lines = [
        "| to a worker on another host | size | gpu_serde | by hand: the engine moves a host array "
        "+ device-to-host + host-to-device copies | ratio |",
        "|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["engine"], r["path"]) for r in rows_of(run, metric="cross_host")},
        key=lambda k: (k[0], k[1]),
    )
    for engine, path in keys:
        for size, name in SIZES:
            got = {
                r["series"]: r["value"]
                for r in rows_of(run, metric="cross_host", engine=engine, path=path)
                if r["size_bytes"] == size
            }
            if "gpu_serde" not in got:
                continue
            parts = f"{_ms(got['host_array'])} + {_ms(got['dtoh'])} + {_ms(got['htod'])}"
            ratio = got["gpu_serde"] / got["baseline"] if got["baseline"] > 0 else float("nan")
            lines.append(
                f"| {engine.capitalize()}, {path} | {name} | {_ms(got['gpu_serde'])} | "
                f"{_ms(got['baseline'])} ({parts}) | {ratio:.2f}x |"
            )
    lines += ["", f"One run of `benchmarks/cross_host.py` on {run.machine()}, {run.date}."]
    return "\n".join(lines)


def sources(runs: list[Run]) -> str:
    """The list of data files by machine and versions, newest first (Markdown)."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in sorted(runs, key=lambda r: r.order, reverse=True):
        groups.setdefault((run.machine(), run.versions()), []).append(run)
    lines = []
    for (machine, versions), members in groups.items():
        lines.append(f"- {machine}; {versions}:")
        for run in members:
            command = run.doc.get("command")
            what = f"`{command}`" if command else run.doc.get("benchmark", "a measurement")
            lines.append(
                f"  - `{os.path.basename(run.path)}`, {run.date or 'day not noted'}: {what}"
            )
    return "\n".join(lines)


SECTION = re.compile(r"(<!-- plot\.py: (\w+) -->\n)(.*?)(<!-- plot\.py: \2 end -->)", re.S)


def fill(page: str, sections: dict[str, str]) -> str:
    """``page`` with each ``<!-- plot.py: NAME -->`` section replaced by ``sections[NAME]``.

    Raises:
        SystemExit: a section of ``sections`` is missing from the page.
    """
    missing = set(sections) - {m.group(2) for m in SECTION.finditer(page)}
    if missing:
        raise SystemExit(f"{PAGE}: no <!-- plot.py: NAME --> section for {sorted(missing)}")
    return SECTION.sub(lambda m: m.group(1) + sections[m.group(2)] + "\n" + m.group(4), page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="*", default=[RESULTS], help="data files or folders")
    parser.add_argument("--check", action="store_true", help="fail if the page is out of date")
    parser.add_argument("--out", default=STATIC, help="where the plots go (docs/_static)")
    args = parser.parse_args(argv)
    runs = load(args.data)
    if not runs:
        raise SystemExit("no data files")
    with tempfile.TemporaryDirectory(prefix="gpu-serde-plots-") as scratch:
        out = scratch if args.check else args.out  # --check: draw them, keep the page's
        plot_handoff(runs, os.path.join(out, "perf-handoff.svg"))
        plot_overhead(runs, os.path.join(out, "perf-task-overhead.svg"))
        plot_arena(runs, os.path.join(out, "perf-arena.svg"))
    table, _ = headlines(runs)
    with open(PAGE, encoding="utf-8") as f:
        page = f.read()
    sections = {
        "headlines": table,
        "arena": arena_table(runs),
        "floor": floor_table(runs),
        "cross_host": cross_host_table(runs),
        "sources": sources(runs),
    }
    filled = fill(page, sections)
    if args.check:
        if filled != page:
            print(
                f"{PAGE} is out of date with the data: run python benchmarks/plot.py",
                file=sys.stderr,
            )
            return 1
        print(f"{len(runs)} data files: the plots draw, and the page's tables are up to date")
        return 0
    if filled != page:
        with open(PAGE, "w", encoding="utf-8") as f:
            f.write(filled)
    print(f"{len(runs)} data files -> {out}/perf-*.svg; {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
