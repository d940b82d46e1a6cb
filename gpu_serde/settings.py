"""Numbers gpu_serde reads from the environment, checked where they are read.

``GPU_SERDE_RELEASE_GRACE_S`` and ``GPU_SERDE_SHARE_ARENA_MIB`` (:func:`number`, at import): a
value that is not one the variable takes (not a number, negative, not finite, out of range) is
said in a warning that names the variable, its value (escaped) and what it takes, and the
default is used: importing gpu_serde never fails on one (a Ray worker's setup hook imports it,
and a hook that fails ends the worker). ``GPU_SERDE_KEEP_S`` (:func:`parse`, in
:func:`gpu_serde.memory.broker.keeper.keep_s`) is checked when a process first sends memory: a
bad value is a warning there too, and no keeper serves what that process sends. An empty value
counts as unset.
"""

from __future__ import annotations

import math
import os
import warnings

from gpu_serde.text import quoted


def parse(
    raw: str, *, integer: bool = False, low: float = 0.0, high: float = math.inf
) -> float | None:
    """``raw`` as a finite number from ``low`` to ``high`` (a whole one when ``integer``), or
    None when it is not one."""
    try:
        value: float = int(raw) if integer else float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and low <= value <= high else None


def number(
    name: str,
    default: float,
    takes: str,
    *,
    integer: bool = False,
    low: float = 0.0,
    high: float = math.inf,
) -> float:
    """The environment variable ``name`` as :func:`parse` reads it; ``default`` when it is unset
    or empty, and, with a warning that says it takes ``takes`` (words: "a number of seconds, 0
    or more"), when it is not such a number."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    value = parse(raw, integer=integer, low=low, high=high)
    if value is None:
        warnings.warn(
            f"{name}={quoted(raw)} is not {takes}: gpu_serde uses the default, {default:g}",
            stacklevel=2,
        )
        return default
    return value
