"""Where a ``gpu_serde.share``'d tensor's ``multiprocessing`` hand-off spends more than an arena
Buffer's (issue 29's +0.05 ms), step by step inside real round trips: the sender's
``pickle.dumps``, the pipe, the receiver's ``pickle.loads``, its read of the marker, its let-go
(closing the Buffer, dropping the tensor) and the reply.

    python benchmarks/share_steps.py [--rounds 300] [--per-round 1] [--threads] [--json PATH]

Needs a real GPU and torch with CUDA. This process sends 1 MiB objects of one arena to a warm
spawned child over a ``multiprocessing`` pipe: an int, a shared tensor and an arena Buffer in
turn, each round (the int is the pipe's own round trip). Both processes stamp each step with
``time.perf_counter`` (one clock for all processes on Linux); a round's steps are the differences
between its stamps. The receiver lets go before replying (a Buffer is closed, a tensor dropped,
so that its release goes back through gpu_serde's release thread, as a user's tensor does). Per
step: the median over rounds of each object, and of the shared tensor minus the Buffer in the same
round (paired, distribution-free 95% interval). ``tensor_table.py`` times whole hand-offs through
a ``multiprocessing.Queue``, whose feeder threads pickle and send; ``--threads`` does that here
too (each side pickles and sends in a long-lived thread of its own, woken per object), so that
the two runs together say what a queue's threads add. Diagnostic, no target.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import queue
import statistics
import threading
import time
from typing import Any

import _common
import _handoff_parts as parts

MIB = 1 << 20
KINDS = ("int", "share", "arena")
#: step -> (first stamp, last stamp): the sender stamps 0 (handed to the sending thread: the
#: same as 1 without --threads), 1 (before dumps), 2 (dumps done) and 7 (the reply read); the
#: receiver 3 (bytes in), 4 (loads done), 5 (marker read) and 6 (let go, handed to its reply)
STEPS = {
    "sender's thread wakes": (0, 1),
    "sender's pickle.dumps": (1, 2),
    "the pipe, there": (2, 3),
    "receiver's pickle.loads": (3, 4),
    "receiver reads the marker": (4, 5),
    "receiver lets go": (5, 6),
    "the pipe, back": (6, 7),
    "round trip": (0, 7),
}


class Sending:
    """Sends on ``conn``: at once in the calling thread, or (``threaded``) in a long-lived
    thread of its own that pickles and sends each object handed to it, as a
    ``multiprocessing.Queue``'s feeder thread does. With ``stamped``, ``stamps`` gets each
    object's stamps before and after pickling, in order."""

    def __init__(self, conn: Any, threaded: bool, stamped: bool) -> None:
        self.conn, self.stamped = conn, stamped
        self.stamps: queue.SimpleQueue[tuple[float, float]] = queue.SimpleQueue()
        self.jobs: queue.SimpleQueue[Any] | None = None
        if threaded:
            self.jobs = queue.SimpleQueue()
            threading.Thread(target=self._run, daemon=True, name="share_steps sender").start()

    def _one(self, obj: Any) -> None:
        start = time.perf_counter()
        blob = pickle.dumps(obj)
        done = time.perf_counter()
        self.conn.send_bytes(blob)
        if self.stamped:
            self.stamps.put((start, done))

    def _run(self) -> None:
        assert self.jobs is not None
        while True:
            self._one(self.jobs.get())

    def send(self, obj: Any) -> None:
        """Send ``obj`` now, or hand it to the sending thread and return."""
        if self.jobs is None:
            self._one(obj)
        else:
            self.jobs.put(obj)


def receiver(conn: Any, threaded: bool) -> None:
    """The child: loads each object, reads its marker, lets go of it, replies with the marker
    and its stamps (from a thread of its own when ``threaded``), until it gets None."""
    parts.setup(4 * MIB)
    reply = Sending(conn, threaded, stamped=False)
    conn.send_bytes(b"ready")
    while True:
        blob = conn.recv_bytes()
        got = time.perf_counter()
        obj = pickle.loads(blob)
        if obj is None:
            return
        loaded = time.perf_counter()
        value = parts.consume(obj)  # a Buffer is closed in there
        read = time.perf_counter()
        del obj  # a tensor dropped: its block goes back through the release thread
        reply.send((value, (got, loaded, read, time.perf_counter())))


def main() -> None:
    args = _common.rounds_args(
        __doc__,
        (300, "rounds"),
        (1, "hand-offs per object a round"),
        lambda p: p.add_argument(
            "--threads",
            action="store_true",
            help="pickle and send in a thread of its own on each side, as a "
            "multiprocessing.Queue does",
        ),
    )
    gpus = _common.use_gpus()
    import torch

    if "simulated" in gpus or not torch.cuda.is_available():
        raise SystemExit(
            "share_steps.py needs a real GPU and torch with CUDA (simulated GPUs run no torch "
            "CUDA): run it on a GPU machine"
        )
    parts.setup(4 * MIB)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(theirs, args.threads), daemon=True)
    sending = Sending(mine, args.threads, stamped=True)
    child.start()
    samples: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STEPS} for k in KINDS}
    try:
        mine.recv_bytes()
        for r in range(args.rounds + 20):  # the first 20 rounds warm up, not counted
            for kind in KINDS:
                for _ in range(args.per_round):
                    obj = parts.make_object(kind, MIB, 7 + r)
                    handed = time.perf_counter()
                    sending.send(obj)  # with --threads: handed over, as Queue.put does
                    value, (t2, t3, t4, t5) = mine.recv()
                    t6 = time.perf_counter()
                    t0, t1 = sending.stamps.get()
                    del obj
                    if value != 7 + r:
                        raise SystemExit(f"{kind}: the receiver read {value}, not {7 + r}")
                    if r >= 20:
                        stamps = (handed if args.threads else t0, t0, t1, t2, t3, t4, t5, t6)
                        for step, (a, b) in STEPS.items():
                            samples[kind][step].append(stamps[b] - stamps[a])
    finally:
        with contextlib.suppress(OSError):
            mine.send_bytes(pickle.dumps(None))
        child.join(30)
        if child.is_alive():
            child.kill()

    def us(seconds: float) -> str:
        return f"{seconds * 1e6:.1f} us"

    n = len(samples["int"]["round trip"])
    engine = "multiprocessing, sent from threads" if args.threads else "multiprocessing"
    print(
        f"# a shared tensor's hand-off against an arena Buffer's, 1 MiB, {engine} ({gpus}; "
        f"{_common.machine()})"
    )
    print(f"{n} hand-offs of each; medians\n")
    print("| step | int | shared tensor | arena Buffer | tensor minus Buffer (95% interval) |")
    print("|---|---|---|---|---|")
    rows = []
    for step in STEPS:
        med = {k: statistics.median(samples[k][step]) for k in KINDS}
        pair = {"share": samples["share"][step], "arena": samples["arena"][step]}
        diff = _common.paired_ci(pair, "share", "arena")
        print(
            f"| {step} | {us(med['int'])} | {us(med['share'])} | {us(med['arena'])} | "
            f"{us(diff[0])} ({us(diff[1])} to {us(diff[2])}) |"
        )
        for kind, value in med.items():
            rows.append(
                _common.result("share_step", engine, kind, value, path=step,
                               stat="median")
            )  # fmt: skip
        rows.append(
            _common.result(
                "share_step",
                engine,
                "share minus arena",
                diff[0],
                path=step,
                low=diff[1],
                high=diff[2],
                stat="median over rounds of (shared tensor - arena Buffer), 95% interval",
            )
        )
    _common.write_json(args.json, "share_steps", rows)


if __name__ == "__main__":
    main()
