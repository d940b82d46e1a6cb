"""The result rows (benchmarks/results/README.md's format) of ``handoff_table.py`` and
``cross_host.py``, from the raw record each writes: one place that names their series.

    python benchmarks/_results.py RAW.json OUT.json

converts a raw record (``handoff_table.py --raw-json``, or a record of either written before their
``--json`` wrote this format) into a results file.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

FORMAT = "gpu_serde-benchmark-results/1"
ENGINES = {  # handoff_table's engine -> (engine, path) in the results' words
    "ray-actor": ("ray", "actor to actor"),
    "ray-task": ("ray", "task to task"),
    "dask": ("dask", "worker to worker"),
    "mp": ("multiprocessing", "queue"),
}
SERIES = {  # handoff_table's path -> series (the default depends on the engine)
    "plain": "engine.plain_object",
    "arena": "gpu_serde.arena",
    "arena-again": "gpu_serde.arena.sent_again",
    "arena-busy": "gpu_serde.arena.after_traffic",
    "pool": "gpu_serde.kept",
    "rdt": "ray_rdt.cuda_ipc.torch",
}
#: issue 31: what the arena may add over the engine's cost for a plain object of its payload's
#: size, by handoff_table's engine
OVER_PLAIN_S = {"ray-actor": 0.1e-3, "ray-task": 0.1e-3, "mp": 0.15e-3}
DEFAULT = {
    "ray-actor": "engine_default.torch",
    "ray-task": "engine_default.torch",
    "dask": "dask.cupy",
    "mp": "torch.mp",
}


def label(size: int) -> str:
    """``1 MiB``, ``16 GiB``: the size words the results use."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} B"


def handoff_row(
    r: dict[str, Any], metric: str, engine: str, series: str, path: str
) -> dict[str, Any]:
    """One measured hand-off (a ``results`` entry of ``handoff_table.py``'s or
    ``tensor_table.py``'s raw record) as a result row of ``metric``."""
    return {
        "metric": metric,
        "engine": engine,
        "series": series,
        "path": path,
        "size": label(r["size"]),
        "size_bytes": r["size"],
        "value": r["handoff_s"],
        "unit": "s",
        "low": r["low_s"],
        "high": r["high_s"],
        "stat": f"median over {r['rounds']} interleaved rounds of (round trip - int round "
        "trip), 95% interval",
        "round_trip": r["roundtrip_s"],
        "int_round_trip": r["int_roundtrip_s"],
    }


def handoff_rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """``handoff_table.py``'s raw record as result rows: ``handoff`` and ``handoff_first``."""
    rows = []
    for r in raw["results"]:
        engine, path = ENGINES[r["engine"]]
        series = SERIES.get(r["path"]) or DEFAULT[r["engine"]]
        rows.append(handoff_row(r, "handoff", engine, series, path))
    for f in raw.get("first_handoff", []):
        engine, path = ENGINES[f["engine"]]
        samples = sorted(f["first_handoff_s"])
        rows.append(
            {
                "metric": "handoff_first",
                "engine": engine,
                "series": "gpu_serde.arena",
                "path": path,
                "size": label(f["size"]),
                "size_bytes": f["size"],
                "value": samples[len(samples) // 2],
                "unit": "s",
                "samples": samples,
                "stat": "median of the first hand-offs from new regions (the receiver maps each)",
            }
        )
    return rows


def cross_host_rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """``cross_host.py``'s raw record as result rows: ``cross_host`` hand-offs by series."""
    rows = []
    paths = {
        "task result, worker to worker": "worker to worker",
        "portable buffer, driver to actor": "portable, task argument",
        "Ray Direct Transport, actor to actor": "Ray Direct Transport, actor to actor",
    }
    for r in raw["rows"]:
        common = {
            "metric": "cross_host",
            "engine": r["engine"],
            "path": paths[r["path"]],
            "size": label(r["size"]),
            "size_bytes": r["size"],
            "unit": "s",
        }
        for series, key in (
            ("gpu_serde", "gpu_serde_ms"),
            ("host_array", "host_array_ms"),
            ("dtoh", "dtoh_ms"),
            ("htod", "htod_ms"),
            ("baseline", "baseline_ms"),
        ):
            rows.append(
                {
                    **common,
                    "series": series,
                    "value": r[key] / 1e3,
                    "stat": f"median over {r['rounds']} rounds of (round trip - int round "
                    "trip); dtoh/htod: median of 5 copies",
                }
            )
    return rows


def document(
    raw: dict[str, Any], rows: list[dict[str, Any]], benchmark: str, command: str
) -> dict[str, Any]:
    """A results file: ``rows`` with the raw record's machine and versions."""
    machine = raw.get("machine", {})
    versions = dict(raw.get("versions", {}))
    if isinstance(machine, str):  # cross_host.py's one line, and its "gpus" line
        gpus = str(raw.get("gpus", ""))
        for name, pattern in (("python", r"Python (\S+?),"), ("cuda-core", r"cuda-core (\S+)")):
            found = re.search(pattern, machine)
            if found and name not in versions:
                versions[name] = found.group(1)
        machine = {
            "description": machine,
            "simulated": "simulated" in gpus,
            "gpu": gpus.partition("first ")[2] or None,
        }
    machine = dict(machine)
    if "gpu" in raw and isinstance(raw["gpu"], dict):
        machine.update(gpu=raw["gpu"].get("name"), simulated=raw["gpu"].get("simulated", False))
    if "driver" in versions:  # NVRM's line: keep the version number
        found = re.search(r"\d+\.\d+(\.\d+)?", str(versions.pop("driver")))
        machine["driver"] = found.group(0) if found else None
    cuda = versions.pop("CUDA (cuDriverGetVersion)", None)
    if isinstance(cuda, int):
        machine["cuda_driver_api"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    return {
        "format": FORMAT,
        "benchmark": benchmark,
        "command": command,
        "date": str(raw.get("date", ""))[:10] or None,
        "source": "written by the command's --json option",
        "machine": machine,
        "versions": versions,
        "results": rows,
        **({"left_out": raw["skipped"]} if raw.get("skipped") else {}),
    }


def main() -> None:
    raw_path, out = sys.argv[1:3]
    with open(raw_path) as f:
        raw = json.load(f)
    if "first_handoff" in raw:
        doc = document(
            raw, handoff_rows(raw), "handoff_table", "python benchmarks/handoff_table.py --json ..."
        )
    else:
        doc = document(
            raw, cross_host_rows(raw), "cross_host", "python benchmarks/cross_host.py --json ..."
        )
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
