"""Where ``gpu_serde.share``'s hand-off spends more than an arena Buffer's (issue 29's +0.05 ms):
the receiver's ``pickle.loads`` of a shared 1 MiB torch tensor against an arena ``Buffer`` of
the same arena, paired, with the receiver giving each back at once (closing the Buffer, dropping
the tensor) or keeping everything (no release traffic); and the sender's ``pickle.dumps`` of
each.

    python benchmarks/share_receive.py [--rounds 4] [--per-round 100] [--json PATH]

Needs a real GPU and torch with CUDA. The sender is a spawned child (the exporter); this process
receives. Each round runs both modes (in alternating order), each over ``--per-round`` pairs: a
Buffer's payload and a shared tensor's (in alternating order), each timed around
``pickle.loads``; the sender starts a round once every release of the last one was counted. What
a pair's shared tensor costs over its Buffer is the paired difference; medians with a
distribution-free 95% interval over all pairs of a mode. Released, a closed Buffer is given back
in the closing thread (its stream had no work left), a dropped tensor by gpu_serde's release
thread once the whole device is idle (nobody said which stream read it last): the difference
between the modes shows what that costs the next hand-off. Diagnostic, no target.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import statistics
import time
from typing import Any

import _common

MIB = 1 << 20


def sender(conn: Any, per_round: int) -> None:
    """The exporter: on each ``("make", n)`` (``n`` at most ``per_round``), ``n`` Buffer payloads
    and ``n`` shared tensor payloads (pickled in a tight loop, timed), until ``None``."""
    import torch
    from cuda.core import Device

    import gpu_serde
    from gpu_serde.memory import lifetime

    gpu_serde.install()
    lifetime.RELEASE_GRACE_S = 0.0  # a block given back comes back at once: the rounds reuse
    dev = Device(0)
    dev.set_current()
    torch.cuda.set_device(0)
    # a round's blocks twice over: what the receiver keeps, and the next round's
    arena = gpu_serde.ArenaMemoryResource(dev, (4 * per_round + 8) * MIB)
    while (ask := conn.recv()) is not None:
        n = ask[1]
        # the last round's releases all counted first: none of their traffic falls in this one
        deadline = time.monotonic() + 30
        while arena.held_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
        bufs = [_retry(lambda: arena.allocate(MIB)) for _ in range(n)]
        tensors = [
            _retry(lambda: gpu_serde.tensors.empty((MIB,), torch.uint8, 0, arena=arena))
            for _ in range(n)
        ]
        dumps: dict[str, list[float]] = {"buffer": [], "shared": []}
        blobs: dict[str, list[bytes]] = {"buffer": [], "shared": []}
        for buf, t in zip(bufs, tensors, strict=True):
            for kind, obj in (("buffer", buf), ("shared", gpu_serde.share(t))):
                start = time.perf_counter()
                blobs[kind].append(pickle.dumps(obj))
                dumps[kind].append(time.perf_counter() - start)
        del bufs, tensors  # kept for the receivers until they let go
        conn.send((blobs, {k: statistics.median(v) for k, v in dumps.items()}))


def _retry(allocate: Any) -> Any:
    from gpu_serde import ArenaFullError

    deadline = time.monotonic() + 30
    while True:
        try:
            return allocate()
        except ArenaFullError:  # blocks given back return in the background
            if time.monotonic() > deadline:
                raise
            time.sleep(0.001)


def receive(blobs: dict[str, list[bytes]], keep: bool) -> dict[str, list[float]]:
    """Load each pair (the Buffer first in even pairs, the shared tensor first in odd ones, so
    that neither always follows the other's give-back); give each back at once unless
    ``keep``."""
    took: dict[str, list[float]] = {"buffer": [], "shared": [], "close": [], "drop": []}
    kept: list[Any] = []
    pairs = zip(blobs["buffer"], blobs["shared"], strict=True)
    for i, pair in enumerate(pairs):
        for kind in ("buffer", "shared") if i % 2 == 0 else ("shared", "buffer"):
            blob = pair[0] if kind == "buffer" else pair[1]
            start = time.perf_counter()
            obj = pickle.loads(blob)
            loaded = time.perf_counter()
            if keep:
                kept.append(obj)
            elif kind == "buffer":
                obj.close()
            del obj  # a tensor dropped: its block goes back once the device is idle
            took[kind].append(loaded - start)
            took["close" if kind == "buffer" else "drop"].append(time.perf_counter() - loaded)
    for obj in kept:
        if hasattr(obj, "close"):
            obj.close()
    return took


def main() -> None:
    args = _common.rounds_args(
        __doc__, (4, "rounds; each runs both modes"), (100, "pairs per mode in a round")
    )
    gpus = _common.use_gpus()
    import torch

    if "simulated" in gpus or not torch.cuda.is_available():
        raise SystemExit(
            "share_receive.py needs a real GPU and torch with CUDA (simulated GPUs run no torch "
            "CUDA): run it on a GPU machine"
        )
    from cuda.core import Device

    import gpu_serde

    gpu_serde.install()
    Device(0).set_current()
    torch.cuda.set_device(0)
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=sender, args=(theirs, max(4, args.per_round)), daemon=True)
    child.start()
    try:
        mine.send(("make", 4))  # warm: the region mapped, the connection open
        receive(mine.recv()[0], keep=False)
        samples: dict[str, dict[str, list[float]]] = {"released": {}, "kept": {}}
        dumps: dict[str, list[float]] = {"buffer": [], "shared": []}
        for r in range(args.rounds):
            for mode in ("released", "kept") if r % 2 == 0 else ("kept", "released"):
                mine.send(("make", args.per_round))
                blobs, sent = mine.recv()
                for kind, value in sent.items():
                    dumps[kind].append(value)
                for kind, values in receive(blobs, keep=mode == "kept").items():
                    samples[mode].setdefault(kind, []).extend(values)
    finally:
        with contextlib.suppress(OSError):
            mine.send(None)
        child.join(30)
        if child.is_alive():
            child.kill()

    def us(seconds: float) -> str:
        return f"{seconds * 1e6:.1f} us"

    print(f"# share's receive against an arena Buffer's, 1 MiB ({gpus}; {_common.machine()})")
    print(f"{args.rounds} rounds of {args.per_round} pairs per mode; medians over pairs\n")
    print(
        "| receiver gives back | Buffer loads | shared loads | shared minus Buffer (95% interval) "
        "| close (Buffer) | drop (tensor) |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for mode in ("released", "kept"):
        s = samples[mode]
        diff = _common.paired_ci(s, "shared", "buffer")
        med = {k: statistics.median(v) for k, v in s.items()}
        how = "each at once" if mode == "released" else "nothing (keeps all)"
        gave = f"{us(med['close'])} | {us(med['drop'])}" if mode == "released" else "- | -"
        print(
            f"| {how} | {us(med['buffer'])} | {us(med['shared'])} | {us(diff[0])} "
            f"({us(diff[1])} to {us(diff[2])}) | {gave} |"
        )
        for series, value in med.items():
            rows.append(
                _common.result("share_receive", "pickle", series, value, path=mode, stat="median")
            )
        rows.append(
            _common.result(
                "share_receive",
                "pickle",
                "shared minus buffer",
                diff[0],
                path=mode,
                low=diff[1],
                high=diff[2],
                stat="median over pairs of (shared - buffer), 95% interval",
            )
        )
    sent_med = {k: statistics.median(v) for k, v in dumps.items()}
    print(
        f"\n- the sender's pickle.dumps: Buffer {us(sent_med['buffer'])}, shared tensor "
        f"{us(sent_med['shared'])} (medians of the rounds' tight-loop medians)"
    )
    for kind, value in sent_med.items():
        rows.append(
            _common.result("share_receive", "pickle", f"dumps {kind}", value, stat="median")
        )
    _common.write_json(args.json, "share_receive", rows)


if __name__ == "__main__":
    main()
