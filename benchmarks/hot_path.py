"""Where an arena hand-off's time goes in Ray (issue 31's floor), split into what gpu_serde's
Python does and what is left, measured in one run against Ray's own cost for a plain object.

    python benchmarks/hot_path.py [--rounds 41] [--per-round 20] [--json PATH]

Runs on the real GPU when a driver is present, else on four simulated GPUs (the split is the same
code: only the driver calls differ). Two Ray actors, a sender and a receiver, on one GPU; cases
interleaved round by round, each round ``--per-round`` hand-offs, medians over rounds:

- ``int``: Ray's round trip with an int (the baseline);
- ``plain``: a plain object (a ``types.SimpleNamespace`` holding bytes) whose pickle is the size of
  an arena buffer's: Ray's own cost for carrying any pickled object (the baseline of issue 31's
  target, as ``handoff_table.py``'s ``plain``);
- ``bytes``: bytes of that size. Ray carries ``bytes`` raw, without pickling them (as it carries an
  int through msgpack), so they cost about what an int costs: no baseline for a pickled object;
- ``arena``: a new 1 MiB ``ArenaMemoryResource`` buffer, closed by the receiver (its release in the
  background), as ``handoff_table.py`` sends it;
- ``arena, kept``: the same, but the receiver keeps what it received (no release traffic);
- ``arena, kept, no note``: a what-if, not a mode anyone can run: the same, with the receiver's
  acquire not telling the exporter (its note unsent; the lock is still taken). What it saves over
  ``arena, kept`` bounds what a hold with no note at all could gain: the note's send and the
  exporter's thread woken to count it. Its blocks are never let go (nothing claimed them): they
  come from an arena of their own, sized for the run.

Inside the actors, over the same rounds: the sender's ``pickle.dumps`` of a new buffer, the
receiver's ``pickle.loads`` and ``close``. "Left" is the arena's cost over a plain object minus
those three: the time gpu_serde's work costs beyond its own Python (its threads waking, the
interpreter lock passed between them and Ray's).
"""

from __future__ import annotations

import os
import pickle
import statistics
import time
import types
from typing import Any

import _common

BUF = 1 << 20


class Sender:
    """A Ray actor that makes what each case sends."""

    def __init__(self, per_round: int) -> None:
        from cuda.core import Device

        import gpu_serde
        from gpu_serde.memory import lifetime

        gpu_serde.install()
        lifetime.RELEASE_GRACE_S = 0.0  # a released block comes back at once: the loop reuses
        dev = Device(0)
        dev.set_current()
        # a round's buffers made ahead, and as many kept by the receiver: room for both, twice
        self.arena = gpu_serde.ArenaMemoryResource(dev, max(256, 4 * per_round) * BUF)
        self.probe = gpu_serde.ArenaMemoryResource(dev, 1)
        size = len(pickle.dumps(self.probe.allocate(1)))
        self.bytes = bytes(size)
        pad = size - len(pickle.dumps(types.SimpleNamespace(b=b"")))
        self.plain = types.SimpleNamespace(b=bytes(max(0, pad)))
        self.ready: list[Any] = []
        self.unclaimed: Any = None  # the what-if's arena (its blocks are never let go)

    def _new(self, arena: Any = None) -> Any:
        deadline = time.monotonic() + 30
        while True:
            try:
                return (arena or self.arena).allocate(BUF)
            except Exception:  # released blocks come back in the background
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)

    def fill(self, n: int) -> None:
        """Allocate the next ``n`` buffers ahead (untimed, as ``handoff_table.py`` prepares)."""
        self.ready = [self._new() for _ in range(n)]

    def fill_unclaimed(self, n: int, total: int) -> None:
        """As :meth:`fill`, from the what-if's own arena (made once, for ``total`` buffers)."""
        import gpu_serde

        if self.unclaimed is None:
            self.unclaimed = gpu_serde.ArenaMemoryResource(self.arena.device, total * BUF)
        self.ready = [self._new(self.unclaimed) for _ in range(n)]

    def make(self, case: str) -> Any:
        if case == "int":
            return 7
        if case == "plain":
            return self.plain
        if case == "bytes":
            return self.bytes
        return self.ready.pop()

    def time_dumps(self, n: int) -> float:
        """The median of ``n`` pickles of a new buffer (each then closed, never received: kept
        until this process exits, so they come from an arena of their own)."""
        import gpu_serde

        side = gpu_serde.ArenaMemoryResource(self.arena.device, n * BUF)
        took = []
        for _ in range(n):
            buf = side.allocate(BUF)
            start = time.perf_counter()
            data = pickle.dumps(buf)
            took.append(time.perf_counter() - start)
            buf.close()
            del data
        return statistics.median(took)

    def payload(self) -> bytes:
        return pickle.dumps(self._new())

    def watch(self, on: bool) -> list[float]:
        """Time the Buffer reducer in place, as Ray calls it in each round trip (on), or stop
        and return those times (off)."""
        import copyreg

        from cuda.core import Buffer

        if on:
            self.reducer, self.watched = copyreg.dispatch_table[Buffer], []
            reducer, watched = self.reducer, self.watched

            def timed(buf: Any) -> Any:
                start = time.perf_counter()
                try:
                    return reducer(buf)
                finally:
                    watched.append(time.perf_counter() - start)

            copyreg.dispatch_table[Buffer] = timed
            return []
        copyreg.dispatch_table[Buffer] = self.reducer
        return self.watched


class Receiver:
    """A Ray actor that receives, closes or keeps."""

    def __init__(self) -> None:
        from cuda.core import Device

        import gpu_serde

        gpu_serde.install()
        Device(0).set_current()
        self.kept: list[Any] = []

    def consume(self, obj: Any, keep: bool) -> int:
        if isinstance(obj, (int, bytes, types.SimpleNamespace)):
            return 1
        if keep:
            self.kept.append(obj)
        else:
            obj.close()
        return 2

    def watch(self, on: bool) -> list[float]:
        """Time the arena buffer's rebuild in place, as Ray calls it before each ``consume``
        (on), or stop and return those times (off)."""
        from gpu_serde import wire
        from gpu_serde.placeholders import rebuild

        if on:
            self.rebuild, self.watched = wire.abuf, []
            original, watched = self.rebuild, self.watched

            def timed(*payload: Any) -> Any:  # what wire.abuf does, timed
                start = time.perf_counter()
                try:
                    return rebuild(original, payload)
                finally:
                    watched.append(time.perf_counter() - start)

            wire.abuf = timed  # type: ignore[assignment]  # pickles name it: found at load
            return []
        wire.abuf = self.rebuild  # type: ignore[assignment]
        return self.watched

    def drop_kept(self) -> None:
        for buf in self.kept:
            buf.close()
        self.kept.clear()

    def without_note(self, on: bool) -> None:
        """The what-if: from now on (on) an acquire takes its lock but sends the exporter no
        note, or (off) sends it again. gpu_serde's own module, in this actor only."""
        from gpu_serde.memory.broker import client

        if not hasattr(self, "note"):
            self.note = client._note
        original = self.note

        def unsent(link: Any, address: str, op: bytes, *args: Any, **kwargs: Any) -> bool:
            if op == client.ACQUIRE:
                return True
            return bool(original(link, address, op, *args, **kwargs))

        client._note = unsent if on else original  # type: ignore[assignment]

    def time_loads(self, payloads: list[bytes]) -> tuple[float, float]:
        """Medians of ``pickle.loads`` and ``close`` over ``payloads``."""
        loads, closes = [], []
        for data in payloads:
            start = time.perf_counter()
            buf = pickle.loads(data)
            mid = time.perf_counter()
            buf.close()
            loads.append(mid - start)
            closes.append(time.perf_counter() - mid)
        return statistics.median(loads), statistics.median(closes)


def main() -> None:
    args = _common.rounds_args(
        __doc__, (41, "rounds; medians are over rounds"), (20, "hand-offs per case in a round")
    )
    gpus = _common.use_gpus()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    import ray

    import gpu_serde.ray

    gpu_serde.ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        sender = ray.remote(num_gpus=0.5)(Sender).remote(args.per_round)
        receiver = ray.remote(num_gpus=0.5)(Receiver).remote()

        def case(name: str, keep: bool = False) -> Any:
            def run() -> None:
                ray.get(receiver.consume.remote(sender.make.remote(name), keep))

            return run

        cases = {
            "int": case("int"),
            "plain": case("plain"),
            "bytes": case("bytes"),
            "arena": case("arena"),
            "arena, kept": case("arena", keep=True),
            "arena, kept, no note": case("arena", keep=True),
        }
        total = (args.rounds + 1) * args.per_round + 3  # the what-if's buffers, warm-up included

        def fill() -> None:
            ray.get([receiver.drop_kept.remote(), receiver.without_note.remote(False)])
            ray.get(sender.fill.remote(args.per_round))

        def fill_unclaimed() -> None:
            ray.get([receiver.drop_kept.remote(), receiver.without_note.remote(True)])
            ray.get(sender.fill_unclaimed.remote(args.per_round, total))

        cases["arena"].setup = fill  # type: ignore[attr-defined]
        cases["arena, kept"].setup = fill  # type: ignore[attr-defined]
        cases["arena, kept, no note"].setup = fill_unclaimed  # type: ignore[attr-defined]
        for fn in cases.values():  # warm: actors started, region mapped, connections open
            if setup := getattr(fn, "setup", None):
                setup()
            for _ in range(min(3, args.per_round)):
                fn()
        samples = _common.interleaved_samples(
            cases, rounds=args.rounds, per_round=args.per_round, alternate=True
        )
        ray.get([receiver.drop_kept.remote(), receiver.without_note.remote(False)])
        n = args.rounds * 3
        dumps = ray.get(sender.time_dumps.remote(n))
        loads_s, close_s = [], []
        for start in range(0, n, 50):  # in batches: each payload pins its block until received
            batch = [ray.get(sender.payload.remote()) for _ in range(min(50, n - start))]
            got = ray.get(receiver.time_loads.remote(batch))
            loads_s.append(got[0])
            close_s.append(got[1])
        loads, close = statistics.median(loads_s), statistics.median(close_s)
        # in place: the same steps timed inside the actors, round trip by round trip
        fill_n = min(args.per_round * 5, 200)
        ray.get(receiver.drop_kept.remote())
        ray.get(sender.fill.remote(fill_n))
        ray.get([sender.watch.remote(True), receiver.watch.remote(True)])
        for _ in range(fill_n):
            cases["arena, kept"]()
        reduce_in, rebuild_in = ray.get([sender.watch.remote(False), receiver.watch.remote(False)])
        ray.get(receiver.drop_kept.remote())
        dumps_in, loads_in = statistics.median(reduce_in), statistics.median(rebuild_in)
    finally:
        ray.shutdown()

    med = {k: statistics.median(v) for k, v in samples.items()}
    over = {
        k: _common.paired_ci(samples, k, "int")
        for k in ("plain", "bytes", "arena", "arena, kept", "arena, kept, no note")
    }
    vs_plain = _common.paired_ci(samples, "arena", "plain")
    kept_vs_plain = _common.paired_ci(samples, "arena, kept", "plain")
    note = _common.paired_ci(samples, "arena, kept", "arena, kept, no note")
    print(f"# an arena hand-off in Ray, split ({gpus}; {_common.machine()})")
    print(f"int round trip: {med['int'] * 1e3:.3f} ms; medians over {args.rounds} rounds\n")
    if "simulated" in gpus:
        print(f"{_common.SIMULATED_VERDICTS}\n")
    print(
        "Rows: plain, a pickled object the size of an arena buffer's payload (Ray's own cost for "
        "any pickled object); bytes, bytes of that size (Ray carries them raw, unpickled); arena, "
        "a new 1 MiB ArenaMemoryResource buffer the receiver closes; arena, kept, the same kept "
        "by the receiver (no release traffic); arena, kept, no note, a what-if: the same with the "
        "receiver's acquire sending the exporter no note (not a mode anyone can run).\n"
    )
    print("| case | adds to the int's round trip (95% interval) |")
    print("|---|---|")
    for k, (m, lo, hi) in over.items():
        print(f"| {k} | {m * 1e3:.3f} ms ({lo * 1e3:.3f} to {hi * 1e3:.3f}) |")
    own = dumps + loads + close
    left = vs_plain[0] - own
    print(
        f"\n- arena over a plain object: {vs_plain[0] * 1e3:.3f} ms ({vs_plain[1] * 1e3:.3f} to "
        f"{vs_plain[2] * 1e3:.3f}); target <= 0.100 ms: "
        f"{'meets' if vs_plain[0] <= 1e-4 else 'MISSES'} target"
    )
    print(
        f"- kept (no release traffic) over a plain object: {kept_vs_plain[0] * 1e3:.3f} ms "
        f"({kept_vs_plain[1] * 1e3:.3f} to {kept_vs_plain[2] * 1e3:.3f})"
    )
    print(
        f"- the acquire's note (kept, minus the what-if without it): {note[0] * 1e3:.3f} ms "
        f"({note[1] * 1e3:.3f} to {note[2] * 1e3:.3f}): the most a hold with no note could save"
    )
    print(
        f"- gpu_serde's own Python, in the actors: dumps {dumps * 1e6:.0f} us, loads "
        f"{loads * 1e6:.0f} us, close {close * 1e6:.0f} us: {own * 1e3:.3f} ms"
    )
    print(f"- left (the arena over plain, minus those): {left * 1e3:.3f} ms")
    print(
        f"- the same inside the actors, in place (round trip by round trip, kept): the sender's "
        f"Buffer reducer {dumps_in * 1e6:.0f} us, the receiver's rebuild {loads_in * 1e6:.0f} us "
        f"(against {dumps * 1e6:.0f} and {loads * 1e6:.0f} us in a tight loop)"
    )
    rows = [
        _common.result(
            "hot_path",
            "ray",
            k,
            m,
            path="actor to actor",
            low=lo,
            high=hi,
            stat="median over rounds of (round trip - int round trip), 95% interval",
        )
        for k, (m, lo, hi) in over.items()
    ]
    for series, value in (
        ("dumps", dumps),
        ("loads", loads),
        ("close", close),
        ("left", left),
        ("the acquire's note", note[0]),
        ("reduce in place", dumps_in),
        ("rebuild in place", loads_in),
    ):
        rows.append(
            _common.result("hot_path", "ray", series, value, path="in the actors", stat="median")
        )
    _common.write_json(args.json, "hot_path", rows)


if __name__ == "__main__":
    main()
