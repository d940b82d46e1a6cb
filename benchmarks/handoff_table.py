"""The hand-off table of issue 22, from one run: what handing a GPU buffer to another process adds
to the engine's own round trip, for Ray's default, Ray Direct Transport ``cuda_ipc``, today's
gpu_serde pool path and the new ArenaMemoryResource, actor to actor and task to task, and the
same for Dask (worker to worker) and multiprocessing (a warm spawned child).

    python benchmarks/handoff_table.py [--sizes 1MiB,64MiB,1GiB,4GiB,16GiB] [--rounds 31]
        [--engines ray-actor,ray-task,dask,mp] [--json results.json] [--raw-json raw.json]

On the simulated tier (no driver here) run it small: ``--sizes 1MiB,4MiB``; the paths that need
torch or CuPy (real kernels) are left out with the reason printed. About 2 minutes on one H100
or H200 with the defaults (105 s on an H100, 2026-12-05).

Method. A hand-off is the median over rounds of (round trip with the object minus round trip with
an int), the two interleaved round by round (which goes first alternates), with a distribution-free
95% confidence interval of that median. Every object carries a marker word that the sender sets and
the receiver reads back on the GPU and returns (the int path writes and reads the same 4 bytes of
scratch memory), so each round trip proves the hand-off delivered the right memory. The round
trips:

- Ray, actor to actor: ``ray.get(receiver.consume.remote(sender.make.remote()))`` on two
  long-lived ``num_gpus=0.5`` actors; the sender prepares the object (allocates it, sets the
  marker) in an untimed call before each round trip. RDT: the same call with
  ``make.options(tensor_transport="cuda_ipc")`` (actors with ``enable_tensor_transport=True``).
- Ray, task to task: ``ray.get(consume.remote(make.remote(...)))``, ``num_gpus=0.5`` tasks with
  ``max_calls=0`` (Ray would otherwise end a GPU task's worker after each task, and with it the
  exporter) whose workers keep their memory between tasks (producers and consumers get separate
  worker processes through a ``runtime_env`` variable); the allocation is inside the round trip,
  for every path.
- Dask, worker to worker: ``make`` submitted to worker A, ``consume`` of its future to worker B,
  ``.result()``; allocation inside the round trip.
- multiprocessing: ``inbox.put(obj); outbox.get()`` to a warm spawned child; the object is made
  before the clock starts.

Paths: ``arena`` (the new path: a Buffer of an ArenaMemoryResource large enough for two buffers of
the largest size); ``pool`` (an IPC DeviceMemoryResource that keeps its memory: release threshold =
its size); ``rdt`` (a torch CUDA tensor through RDT ``cuda_ipc``; Ray actors only); ``default`` (the
engine's own way: a torch CUDA tensor through Ray's object store, torch.multiprocessing's CUDA IPC,
a CuPy array through distributed's serialization; Dask cannot carry a torch CUDA tensor at all).
The slow defaults (copies through host memory: about 6 s a round at 1 GiB through Ray's object
store, 100 s at 16 GiB) run at sizes up to ``--slow-max`` (1 GiB) with ``--slow-rounds`` (3)
rounds above 1 MiB.

The first hand-off from a new region (the receiver maps it: the one-time cost) is timed apart, by
region size, over Ray (actor to actor, a fresh receiver) and multiprocessing (a fresh child).

Targets (issue 22): the arena path adds <= 0.3 ms at every size; flat (the largest size within
1.2x of the smallest); >= 10x faster than RDT ``cuda_ipc`` at 1 GiB; its ratio against Ray's
default is reported.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import _handoff_parts as parts
import _results
from _common import SIMULATED_VERDICTS, machine, paired_ci, times, use_gpus

UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
TIMEOUT_S = 600
TARGET_S = 0.3e-3
FLAT = 1.2
VS_RDT = 10.0
PATH_NAMES = {
    "plain": "a plain object of the arena payload's size (the engine's own cost)",
    "arena": "gpu_serde ArenaMemoryResource (new)",
    "arena-again": "arena, the same buffer sent again",
    "arena-busy": "arena, right after other GPU traffic",
    "pool": "gpu_serde pool that keeps memory",
    "rdt": "Ray Direct Transport cuda_ipc (torch)",
    "default": "the engine's default",
}
DEFAULTS = {  # what "default" hands off, per engine
    "ray-actor": "a torch CUDA tensor through Ray's object store",
    "ray-task": "a torch CUDA tensor through Ray's object store",
    "dask": "a CuPy array through distributed's serialization",
    "mp": "a torch CUDA tensor through torch.multiprocessing (CUDA IPC)",
}


def log(*words: object) -> None:
    print(*words, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    text = text.strip()
    for unit, factor in sorted(UNITS.items(), key=lambda u: -len(u[0])):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def label(size: int) -> str:
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size >= UNITS[unit] and size % UNITS[unit] == 0:
            return f"{size // UNITS[unit]} {unit}"
    return f"{size} B"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


class Values:
    """Distinct marker values, one per round trip."""

    def __init__(self) -> None:
        self.n = 1000

    def __call__(self) -> int:
        self.n += 1
        return self.n


class Run:
    """What one run measured, and what it left out and why."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: list[dict[str, Any]] = []
        self.first: list[dict[str, Any]] = []
        self.skipped: list[dict[str, Any]] = []
        self.values = Values()
        self.started = time.monotonic()

    def skip(self, engine: str, path: str, why: str, sizes: list[int] | None = None) -> None:
        shown = ", ".join(label(s) for s in sizes) if sizes else "every size"
        log(f"[{engine}] {path}: left out at {shown}: {why}")
        self.skipped.append({"engine": engine, "path": path, "sizes": sizes or "all", "why": why})

    def elapsed(self) -> str:
        return f"{time.monotonic() - self.started:.0f} s"


class Stopped(BaseException):
    """The run was asked to stop (SIGTERM: ``timeout``'s, a machine's time limit). Not an
    ``Exception``: no ``except Exception`` on the way swallows it."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(time.monotonic())  # when it came: the cleanup on the way out takes a while


def watch_for_stop() -> None:
    """Make a SIGTERM stop the run (:func:`run_engines`); call it again after anything that
    installs its own handler (``ray.init`` does)."""
    signal.signal(signal.SIGTERM, _stop)


def run_engines(run: Run, steps: list[tuple[list[str], Callable[[], None]]]) -> None:
    """Run each step (the engines it measures, and how) in turn. A SIGTERM stops the run where
    it is: what was measured is kept, the rest is recorded as left out, and the tables and files
    are still written (run under ``timeout -k 120 ...``: the engines shut down first). From the
    end of the measuring on, SIGTERM is ignored."""
    try:
        for i, (_engines, step) in enumerate(steps):
            watch_for_stop()
            try:
                step()
            except Stopped as stop:
                why = f"the run was stopped (SIGTERM) after {stop.args[0] - run.started:.0f} s"
                for engines, _ in steps[i:]:
                    for engine in engines:
                        run.skip(engine, "what was not measured by then", why)
                return
    finally:  # measured: the tables and files are written whatever comes now
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


RoundTrip = Callable[[str, int, int], float]


def slow_default(path: str, engine: str, size: int) -> bool:
    """True where a path copies through host memory (the engine's default above 1 MiB, but for
    multiprocessing's): it runs ``--slow-rounds`` rounds."""
    return path == "default" and engine != "mp" and size > (1 << 20)


def block(
    run: Run,
    engine: str,
    rt: RoundTrip,
    paths: dict[str, list[int]],
    slow: Callable[[str, str, int], bool] = slow_default,
) -> None:
    """Measure each path at its sizes against the int, interleaved round by round (``slow``
    says which run ``--slow-rounds`` rounds)."""
    args = run.args
    for size in args.sizes:
        for path, sizes in paths.items():
            if size not in sizes:
                continue
            rounds = args.slow_rounds if slow(path, engine, size) else args.rounds
            rt(path, size, run.values())  # warm: the first of each path and size is not counted
            rt("int", size, run.values())
            samples: dict[str, list[float]] = {path: [], "int": []}
            for r in range(rounds):
                order = [path, "int"] if r % 2 == 0 else ["int", path]
                for p in order:
                    samples[p].append(rt(p, size, run.values()))
            median, low, high = paired_ci(samples, path, "int")
            srt = sorted(samples[path])[len(samples[path]) // 2]
            sint = sorted(samples["int"])[len(samples["int"]) // 2]
            run.results.append(
                {
                    "engine": engine,
                    "path": path,
                    "size": size,
                    "rounds": rounds,
                    "handoff_s": median,
                    "low_s": low,
                    "high_s": high,
                    "roundtrip_s": srt,
                    "int_roundtrip_s": sint,
                    "samples_s": samples[path],
                    "int_samples_s": samples["int"],
                }
            )
            log(
                f"[{engine}] {label(size)} {path}: hand-off {ms(median)} ({ms(low)} to "
                f"{ms(high)}), round trip {ms(srt)} vs int {ms(sint)}, {rounds} rounds "
                f"({run.elapsed()})"
            )


def first_maps(run: Run, engine: str, rt: RoundTrip) -> None:
    """The first hand-off from a new region, by size (the receiver maps it); none with
    ``--first-rounds 0``."""
    for size in run.args.sizes if run.args.first_rounds > 0 else ():
        n = run.args.first_rounds if size <= (4 << 30) else 1
        firsts, ints = [], []
        for _ in range(n):
            ints.append(rt("int", size, run.values()))
            firsts.append(rt("arena-new", size, run.values()))
        ints.sort()
        firsts.sort()
        base = ints[len(ints) // 2]
        run.first.append(
            {
                "engine": engine,
                "size": size,
                "first_handoff_s": [f - base for f in firsts],
                "int_roundtrip_s": base,
            }
        )
        log(
            f"[{engine}] first hand-off from a new {label(size)} region: "
            f"{', '.join(ms(f - base) for f in firsts)} ({run.elapsed()})"
        )


def expect(got: Any, value: int, path: str) -> None:
    if got != value:
        raise AssertionError(f"{path}: the receiver read {got!r}, not the marker {value}")


# ---- Ray ----
def ray_engines(run: Run, kinds: dict[str, bool]) -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray

    import gpu_serde.ray

    args = run.args
    max_size = max(args.sizes)
    gpu_serde.ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    watch_for_stop()  # ray.init installs a SIGTERM handler of its own
    log(f"[ray] Ray {ray.__version__} started ({run.elapsed()})")
    try:
        actor_opts: dict[str, Any] = {"num_gpus": 0.5}
        if kinds["torch"]:
            actor_opts["enable_tensor_transport"] = True  # RDT (cuda_ipc) needs it on both
        sender_cls = ray.remote(**actor_opts)(parts.Sender)
        receiver_cls = ray.remote(**actor_opts)(parts.Receiver)
        if "ray-actor" in args.engines:
            sender = sender_cls.remote(max_size)

            def actor_rt(receiver: Any) -> RoundTrip:
                def rt(path: str, size: int, value: int) -> float:
                    kind = {"rdt": "torch", "default": "torch"}.get(path, path)
                    ray.get(sender.prepare.remote(kind, size, value), timeout=TIMEOUT_S)
                    start = time.perf_counter()
                    if path == "rdt":
                        ref = sender.make.options(tensor_transport="cuda_ipc").remote()
                    else:
                        ref = sender.make.remote()
                    got = ray.get(receiver.consume.remote(ref), timeout=TIMEOUT_S)
                    took = time.perf_counter() - start
                    expect(got, value, path)
                    return took

                return rt

            fresh = receiver_cls.remote(max_size)  # maps every new region, then goes
            ray.get(fresh.pid.remote(), timeout=TIMEOUT_S)
            first_maps(run, "ray-actor", actor_rt(fresh))
            ray.kill(fresh)
            receiver = receiver_cls.remote(max_size)
            assert ray.get(receiver.pid.remote()) != ray.get(sender.pid.remote())
            block(run, "ray-actor", actor_rt(receiver), paths_for(run, "ray-actor", kinds))
            ray.kill(sender)
            ray.kill(receiver)
        if "ray-task" in args.engines:
            # Ray ends a GPU task's worker after each task (max_calls=1) unless told otherwise:
            # an exporter must outlive its importers' use, so the workers stay (max_calls=0);
            # producers and consumers get worker processes of their own (a runtime_env each)
            env = {"env_vars": {"GPU_SERDE_BENCH_ROLE": "producer"}}
            make = ray.remote(num_gpus=0.5, max_calls=0, runtime_env=env)(parts.make_task)
            env = {"env_vars": {"GPU_SERDE_BENCH_ROLE": "consumer"}}
            consume = ray.remote(num_gpus=0.5, max_calls=0, runtime_env=env)(parts.consume_task)

            def task_rt(path: str, size: int, value: int) -> float:
                kind = "torch" if path == "default" else path
                start = time.perf_counter()
                ref = make.remote(kind, size, value, max_size)
                got = ray.get(consume.remote(ref, max_size), timeout=TIMEOUT_S)
                took = time.perf_counter() - start
                expect(got, value, path)
                return took

            block(run, "ray-task", task_rt, paths_for(run, "ray-task", kinds))
    finally:
        ray.shutdown()


# ---- Dask ----
def dask_engine(run: Run, kinds: dict[str, bool]) -> None:
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
    import dask
    import distributed
    from distributed import Client, LocalCluster

    import gpu_serde.dask

    max_size = max(run.args.sizes)
    # the scheduler keeps its last messages (and so task arguments) alive: none here
    dask.config.set({"distributed.admin.low-level-log-length": 0})
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address=None,
        ) as cluster,
        Client(cluster) as client,
    ):
        gpu_serde.dask.register(client)
        client.run(parts.setup, max_size)
        a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])
        log(f"[dask] distributed {distributed.__version__}: workers {a} and {b}")

        def rt(path: str, size: int, value: int) -> float:
            kind = "cupy" if path == "default" else path
            start = time.perf_counter()
            made = client.submit(
                parts.make_task, kind, size, value, max_size, workers=[a], pure=False
            )
            got = client.submit(parts.consume_task, made, max_size, workers=[b], pure=False)
            got = got.result(timeout=TIMEOUT_S)
            took = time.perf_counter() - start
            del made
            expect(got, value, path)
            return took

        block(run, "dask", rt, paths_for(run, "dask", kinds))


# ---- multiprocessing ----
def mp_engine(run: Run, kinds: dict[str, bool]) -> None:
    import multiprocessing

    if kinds["torch"]:
        import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reducers)
    max_size = max(run.args.sizes)
    parts.setup(max_size)
    ctx = multiprocessing.get_context("spawn")

    def start() -> tuple[Any, Any, Any]:
        inbox, outbox = ctx.Queue(), ctx.Queue()
        # a daemon: a run stopped while it starts does not wait for it at exit
        child = ctx.Process(target=parts.serve, args=(inbox, outbox, max_size), daemon=True)
        child.start()
        outbox.get(timeout=TIMEOUT_S)  # warm: CUDA started there
        return child, inbox, outbox

    def child_rt(inbox: Any, outbox: Any) -> RoundTrip:
        def rt(path: str, size: int, value: int) -> float:
            obj = parts.make_object("torch" if path == "default" else path, size, value)
            start = time.perf_counter()
            inbox.put(obj)
            got = outbox.get(timeout=TIMEOUT_S)
            took = time.perf_counter() - start
            del obj
            expect(got, value, path)
            return took

        return rt

    for phase in ("first", "steady"):
        child, inbox, outbox = start()
        try:
            if phase == "first":
                first_maps(run, "mp", child_rt(inbox, outbox))
            else:
                block(run, "mp", child_rt(inbox, outbox), paths_for(run, "mp", kinds))
        finally:
            inbox.put(None)
            child.join(60)


def paths_for(run: Run, engine: str, kinds: dict[str, bool]) -> dict[str, list[int]]:
    """Each path of ``engine`` and the sizes it runs at (the rest is recorded as skipped)."""
    sizes = run.args.sizes
    big = [s for s in sizes if s <= run.args.others_max]
    over = [s for s in sizes if s > run.args.others_max]
    paths = {"plain": sizes, "arena": sizes, "arena-again": sizes, "arena-busy": sizes, "pool": big}
    if over:
        why = (
            "the other paths run up to --others-max: at 16 GiB the sender holds the arena, a pool "
            "and a tensor of twice the size at once, and the receiving Ray actor died there (a "
            "pool buffer of 16 GiB) in a run on an H200, cause not found"
        )
        run.skip(engine, "pool", why, over)
    if engine == "ray-actor":
        if kinds["torch"]:
            paths["rdt"] = big
            if over:
                run.skip(engine, "rdt", why, over)
        else:
            run.skip(engine, "rdt", kinds["why torch"])
    need = "cupy" if engine == "dask" else "torch"
    if not kinds[need]:
        run.skip(engine, "default", kinds[f"why {need}"])
        return paths
    if engine == "mp":
        paths["default"] = big
        return paths
    slow = [s for s in big if s <= run.args.slow_max]
    left = [s for s in sizes if s > run.args.slow_max]
    if left:
        run.skip(
            engine,
            "default",
            f"{DEFAULTS[engine]} copies through host memory (about 6 s a round at 1 GiB on an "
            f"H200, 100 s at 16 GiB): run up to --slow-max {label(run.args.slow_max)}",
            left,
        )
    paths["default"] = slow
    return paths


# ---- report ----
def table(run: Run, engine: str) -> None:
    rows = [r for r in run.results if r["engine"] == engine]
    if not rows:
        return
    order = ("plain", "arena", "arena-again", "arena-busy", "pool", "rdt", "default")
    paths = [p for p in order if any(r["path"] == p for r in rows)]
    at = {(r["path"], r["size"]): r for r in rows}
    print(f"\n## {engine}: hand-off = round trip minus the int's, median (95% interval)\n")
    names = [PATH_NAMES[p] if p != "default" else f"default: {DEFAULTS[engine]}" for p in paths]
    print("| size | int round trip | " + " | ".join(names) + " |")
    print("|---" * (len(paths) + 2) + "|")
    for size in run.args.sizes:
        cells, ints = [], []
        for p in paths:
            r = at.get((p, size))
            if r is None:
                cells.append("not run")
                continue
            ints.append(r["int_roundtrip_s"])
            cells.append(
                f"{ms(r['handoff_s'])} ({r['low_s'] * 1e3:.3f} to {r['high_s'] * 1e3:.3f})"
            )
        base = ms(sorted(ints)[len(ints) // 2]) if ints else "-"
        print(f"| {label(size)} | {base} | " + " | ".join(cells) + " |")
    verdicts(run, engine, at)


def ratio(a: float, b: float) -> str:
    return times(a / b) if b > 0 else "? (the new path is within the noise)"


def verdicts(run: Run, engine: str, at: dict[tuple[str, int], dict[str, Any]]) -> None:
    arena = {s: at[("arena", s)] for s in run.args.sizes if ("arena", s) in at}
    if not arena:
        return
    worst = max(r["handoff_s"] for r in arena.values())
    top = max(r["high_s"] for r in arena.values())
    meets = (
        "meets target"
        if top <= TARGET_S
        else "MISSES target"
        if worst > TARGET_S
        else "the median meets the target, the upper bound does not"
    )
    print(
        f"\n- new path, largest hand-off over sizes: {ms(worst)} (upper 95% bound {ms(top)}); "
        f"target <= 0.3 ms at every size: {meets}"
    )
    small, large = arena[min(arena)], arena[max(arena)]
    if small["handoff_s"] > 0:
        flat = large["handoff_s"] / small["handoff_s"]
        print(
            f"- flatness, {label(max(arena))} / {label(min(arena))}: {flat:.2f}x "
            f"(target <= {FLAT}x: {'meets' if flat <= FLAT else 'MISSES'} target)"
        )
    else:
        print("- flatness: the smallest size's hand-off is within the noise (<= 0)")
    gib = 1 << 30
    for path, target in (("rdt", VS_RDT), ("default", None), ("pool", None)):
        for size in (gib, max(arena)):
            if (path, size) in at and size in arena:
                ours, theirs = arena[size]["handoff_s"], at[(path, size)]["handoff_s"]
                goal = f" (target >= {target:.0f}x)" if target and size == gib else ""
                print(
                    f"- {PATH_NAMES[path] if path != 'default' else 'the default'} / new path "
                    f"at {label(size)}: {ratio(theirs, ours)}{goal}"
                )
                if size == max(arena) and size == gib:
                    break
    over_plain(run, engine, at, arena)


def over_plain(
    run: Run,
    engine: str,
    at: dict[tuple[str, int], dict[str, Any]],
    arena: dict[int, dict[str, Any]],
) -> None:
    """Issue 31's verdicts: the arena over a plain object of its payload's size, at every size;
    a buffer sent again and one sent after other GPU traffic against a fresh one."""
    plain = {s: at[("plain", s)]["handoff_s"] for s in arena if ("plain", s) in at}
    if plain:
        worst = max(arena[s]["handoff_s"] - plain[s] for s in plain)
        target = _results.OVER_PLAIN_S.get(engine)
        goal = (
            f"target <= {target * 1e3:.2f} ms: {'meets' if worst <= target else 'MISSES'} target"
            if target
            else "no target for this engine"
        )
        print(
            f"- the arena over a plain object of its payload's size, worst size: {ms(worst)} "
            f"({goal})"
        )
    for path in ("arena-again", "arena-busy"):
        pairs = [(s, at[(path, s)]["handoff_s"]) for s in arena if (path, s) in at]
        if pairs:
            worst_size, worst = max(pairs, key=lambda p: p[1] - arena[p[0]]["handoff_s"])
            print(
                f"- {PATH_NAMES[path]}, minus a fresh buffer's hand-off, worst size "
                f"({label(worst_size)}): {ms(worst - arena[worst_size]['handoff_s'])} "
                "(target: about 0, the cost of a fresh one)"
            )


def first_table(run: Run) -> None:
    if not run.first:
        return
    print("\n## The first hand-off from a new region (the receiver maps it once)\n")
    print("| engine | region size | first hand-off minus the int round trip (each sample) |")
    print("|---|---|---|")
    for f in run.first:
        shown = ", ".join(ms(x) for x in f["first_handoff_s"])
        print(f"| {f['engine']} | {label(f['size'])} | {shown} |")


def versions() -> dict[str, Any]:
    import cuda.bindings
    import cuda.core
    from cuda.bindings import driver

    import gpu_serde

    got: dict[str, Any] = {
        "python": platform.python_version(),
        "cuda-core": cuda.core.__version__,
        "cuda-bindings": cuda.bindings.__version__,
        "gpu_serde": gpu_serde.__version__,
        "CUDA (cuDriverGetVersion)": int(driver.cuDriverGetVersion()[1]),
    }
    try:  # the kernel module's version line names the driver (580.95.05, ...)
        with open("/proc/driver/nvidia/version") as f:
            got["driver"] = f.readline().strip()
    except OSError:
        got["driver"] = "no NVIDIA kernel module (simulated GPUs)"
    for name in ("ray", "distributed", "torch", "cupy", "numpy"):
        if importlib.util.find_spec(name) is not None:
            module = __import__(name)
            got[name] = getattr(module, "__version__", "?")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", default="1MiB,64MiB,1GiB,4GiB,16GiB", help="buffer sizes, comma-separated"
    )
    parser.add_argument("--rounds", type=int, default=31, help="rounds per path and size")
    parser.add_argument("--slow-rounds", type=int, default=3, help="rounds of slow defaults")
    parser.add_argument("--slow-max", default="1GiB", help="largest size for slow defaults")
    parser.add_argument("--others-max", default="4GiB", help="largest size for other paths")
    parser.add_argument("--first-rounds", type=int, default=3, help="new regions per size")
    parser.add_argument(
        "--engines",
        default="ray-actor,ray-task,dask,mp",
        help="which engines, comma-separated (ray-actor, ray-task, dask, mp)",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the results here (benchmarks/results/README.md)"
    )
    parser.add_argument("--raw-json", metavar="PATH", help="write the raw record, samples too")
    args = parser.parse_args()
    args.sizes = sorted(parse_size(s) for s in args.sizes.split(","))
    args.slow_max = parse_size(args.slow_max)
    args.others_max = parse_size(args.others_max)
    args.engines = [e.strip() for e in args.engines.split(",")]
    gpus = use_gpus()
    from gpu_serde.inventory import inventory

    real = not inventory().simulated
    kinds: dict[str, Any] = {}
    for lib in ("torch", "cupy"):
        found = importlib.util.find_spec(lib) is not None
        kinds[lib] = real and found
        kinds[f"why {lib}"] = (
            f"{lib} is not installed"
            if not found
            else f"simulated GPUs run no kernels ({lib} needs a real GPU)"
        )
    from cuda.core import Device

    dev = Device(0)
    dev.set_current()
    run = Run(args)
    log(f"{gpus}; {machine()}; sizes {', '.join(label(s) for s in args.sizes)}")
    steps: list[tuple[list[str], Callable[[], None]]] = []
    rays = [e for e in ("ray-actor", "ray-task") if e in args.engines]
    if rays:
        steps.append((rays, lambda: ray_engines(run, kinds)))
    if "dask" in args.engines:
        steps.append((["dask"], lambda: dask_engine(run, kinds)))
    if "mp" in args.engines:
        steps.append((["mp"], lambda: mp_engine(run, kinds)))
    run_engines(run, steps)
    print(f"# GPU buffer hand-off ({dev.name}; {gpus}; {machine()}; {run.elapsed()})")
    if not real:
        print(f"\n{SIMULATED_VERDICTS}")
    for engine in ("ray-actor", "ray-task", "dask", "mp"):
        table(run, engine)
    first_table(run)
    print_left_out(run)
    write(run, dev, not real, "handoff_table", _results.handoff_rows, first_handoff=run.first)


def print_left_out(run: Run) -> None:
    """Say which paths and sizes a run left out, and why."""
    if run.skipped:
        print("\nLeft out:")
        for s in run.skipped:
            sizes = s["sizes"] if s["sizes"] == "all" else ", ".join(map(label, s["sizes"]))
            print(f"- {s['engine']} {s['path']} ({sizes}): {s['why']}")


def write(
    run: Run,
    dev: Any,
    simulated: bool,
    benchmark: str,
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]],
    **more: Any,
) -> None:
    """Write a run's raw record (``--raw-json``, samples too) and its result rows (``--json``,
    made by ``rows`` from the raw record) for ``benchmarks/<benchmark>.py``."""
    args = run.args
    if not (args.json or args.raw_json):
        return
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {
            "host": platform.node(),
            "arch": platform.machine(),
            "cpus": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },
        "gpu": {"name": dev.name, "uuid": dev.uuid, "simulated": simulated},
        "versions": versions(),
        "args": dict(vars(args)),
        "method": "median over interleaved rounds of (round trip with the object - round "
        "trip with an int), distribution-free 95% interval; see the script's docstring",
        "results": run.results,
        **more,
        "skipped": run.skipped,
        "seconds": time.monotonic() - run.started,
    }
    if args.raw_json:
        with open(args.raw_json, "w") as f:
            json.dump(record, f, indent=1)
        log(f"raw numbers written to {args.raw_json}")
    if args.json:
        command = f"python benchmarks/{benchmark}.py " + " ".join(sys.argv[1:])
        doc = _results.document(record, rows(record), benchmark, command)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        log(f"results written to {args.json}")


if __name__ == "__main__":
    main()
