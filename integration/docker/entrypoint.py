"""The containers' entry point: run the command, on simulated GPUs when ``SIMULATED_GPUS`` is set.

``SIMULATED_GPUS=N`` (the CPU profile) gives the command the same N simulated GPUs in every
container (``gpu_serde.testing.make_gpus(N)``), seen through the container's own
``CUDA_VISIBLE_DEVICES`` (unset: all; ``""``: none). Unset or ``0`` (GPU hosts): the command runs
as is, on the real driver.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: entrypoint.py COMMAND [ARG...]")
    env = dict(os.environ)
    count = int(env.get("SIMULATED_GPUS") or 0)
    if count:
        from gpu_serde.testing import child_env, make_gpus

        env = child_env(make_gpus(count), env.get("CUDA_VISIBLE_DEVICES"))
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])
