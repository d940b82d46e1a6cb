"""A hold with no round trip (issue 31): what an importer pays to take and give back a hold on an
exported block, against the broker round trip that a hold used to be, measured in the same run.

    python benchmarks/hold.py [--rounds 41] [--per-round 200] [--json PATH]

No GPU is needed: the hold is the broker's, whatever the memory. The exporter is another process
(a broker with a held object); this process is the importer, with its connection and holds file
already open (a hand-off's steady state). Cases, interleaved round by round:

- ``hold``: ``acquire`` then ``release``, as a hand-off's receiver does (a lock, a read of the
  holds table and a note each way; the release's unlock and note run in the release thread in a
  real hand-off, off the receiver's path).
- ``round trip`` (the baseline): one request answered by the exporter's broker thread over the
  same kind of kept connection (a fetch of an unknown token), which is what an acquire cost before
  (an acquire and a release: two).

Each is measured twice: with the exporter idle (blocked in a read, as an actor waiting for its
next call), and with the exporter's main thread busy running Python (as an exporter that keeps
producing), where its broker thread must win the interpreter lock to answer.
"""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import sys

import _common

EXPORTER = """
import sys, threading
from gpu_serde.memory.broker import broker
b = broker()
token = b.hold(["a block"], lambda obj: None, grace=60)
print(b.address, token.hex(), flush=True)
if sys.argv[1] == "busy":
    def spin():
        while True:
            sum(range(1000))
    threading.Thread(target=spin, daemon=True).start()
sys.stdin.read()
"""


def measure(state: str, rounds: int, per_round: int) -> dict[str, float]:
    from gpu_serde.errors import TokenRefusedError
    from gpu_serde.memory.broker import acquire, fetch, release

    proc = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, state],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address, hexed = proc.stdout.readline().split()  # type: ignore[union-attr]
        token = bytes.fromhex(hexed)
        unknown = bytes(16)

        def hold() -> None:
            acquire(address, token)
            release(address, token)

        def round_trip() -> None:
            with contextlib.suppress(TokenRefusedError):
                fetch(address, unknown)

        def two_round_trips() -> None:
            round_trip()
            round_trip()

        hold()  # the connection and the holds file, opened once
        round_trip()
        samples = _common.interleaved_samples(
            {"hold": hold, "round trip": round_trip, "two round trips": two_round_trips},
            rounds=rounds,
            per_round=per_round,
            alternate=True,
        )
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(10)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--per-round", type=int, default=200)
    args = p.parse_args()
    print(f"# {_common.machine()}")
    print("# A hold (acquire + release, in the importer) against the broker round trip it replaced")
    print(
        "| exporter | hold (acquire + release) | one round trip | two round trips (the old hold) "
        "| old / new |"
    )
    print("|---|---|---|---|---|")
    rows = []
    for state in ("idle", "busy"):
        t = measure(state, args.rounds, args.per_round)
        ratio = t["two round trips"] / t["hold"]
        print(
            f"| {state} | {t['hold'] * 1e6:.1f} us | {t['round trip'] * 1e6:.1f} us | "
            f"{t['two round trips'] * 1e6:.1f} us | {_common.times(ratio)} |"
        )
        for series, key in (
            ("gpu_serde.hold", "hold"),
            ("broker.round_trip", "round trip"),
            ("broker.two_round_trips", "two round trips"),
        ):
            rows.append(_common.result("hold", "broker", series, t[key], path=state, stat="median"))
    _common.write_json(args.json, "hold", rows)


if __name__ == "__main__":
    main()
