"""What a keeper costs an exporter's exit (docs/memory.md, "When the exporter exits"): the whole
life of a short exporter process that sends one arena buffer nobody has claimed yet, with the
keeper (it starts at exit) and without (``GPU_SERDE_KEEP_S=0``, the baseline), measured in the
same run, the two cases alternating.

    python benchmarks/keeper_exit.py [--rounds 11] [--json PATH]

Real GPUs when a driver is present, else simulated ones. The keepers started here keep their
payload 1 s (``GPU_SERDE_KEEP_S=1``; how long it keeps does not change what its start costs), so
none outlives the run by more.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import _common

EXPORTER = """
import pickle, gpu_serde
from cuda.core import Device
gpu_serde.install(); d = Device(0); d.set_current()
buf = gpu_serde.ArenaMemoryResource(d, 4 << 20).allocate(1 << 20)
blob = pickle.dumps(buf)  # sent, not claimed: what a Ray task's result is when its worker ends
"""


def life(keep: str) -> float:
    """Seconds from starting an exporter process to its end."""
    env = dict(os.environ, GPU_SERDE_KEEP_S=keep)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", EXPORTER], env=env, capture_output=True, text=True, timeout=120
    )
    took = time.perf_counter() - start
    if done.returncode != 0 or "could not be handed" in done.stderr:
        raise SystemExit(f"the exporter failed: {done.stderr}")
    return took


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=11)
    args = p.parse_args()
    where = _common.use_gpus()
    print(f"# {_common.machine()} ({where})")
    print("# An exporter's whole life (start to exit, one unclaimed arena buffer), median")
    samples: dict[str, list[float]] = {"no keeper": [], "keeper": []}
    for i in range(args.rounds):
        order = ("no keeper", "keeper") if i % 2 == 0 else ("keeper", "no keeper")
        for case in order:
            samples[case].append(life("0" if case == "no keeper" else "1"))
    t = {case: statistics.median(v) for case, v in samples.items()}
    print("| exporter's life | no keeper (`GPU_SERDE_KEEP_S=0`) | with its keeper | added ", end="")
    print("| ratio |")
    print("|---|---|---|---|---|")
    added = t["keeper"] - t["no keeper"]
    ratio = t["keeper"] / t["no keeper"]
    print(
        f"| start to exit | {t['no keeper']:.3f} s | {t['keeper']:.3f} s | {added:.3f} s | "
        f"{_common.times(ratio)} |"
    )
    rows = [
        _common.result("keeper_exit", "process", series, t[case], path="exit", stat="median")
        for series, case in (("exit.no_keeper", "no keeper"), ("exit.keeper", "keeper"))
    ]
    _common.write_json(args.json, "keeper_exit", rows)


if __name__ == "__main__":
    main()
