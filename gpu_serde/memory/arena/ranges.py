"""A best-fit allocator of offsets in one fixed range: what :class:`~gpu_serde.ArenaMemoryResource`
sub-allocates its region with.

It hands out ``[offset, offset + n)`` ranges of ``[0, size)``, aligned to :data:`ALIGN` bytes (what
``cudaMalloc`` guarantees), and takes them back with their neighbours merged into one free range.
It never touches memory: it only does arithmetic on offsets, so the region may live anywhere
(another process maps the same offsets at its own address).

Why a new one: the maintained allocators own their memory or need the CUDA runtime (RMM's
resources allocate from an upstream resource through ``cudart``; CuPy's and PyTorch's caching
allocators likewise), and the offset allocators on PyPI are single releases without upkeep
(``tlsfallocator`` 0.0.1, 2023). This one is 150 lines of plain Python.

The free ranges are kept twice, in sorted lists: by offset (to find a freed range's neighbours)
and by (size, offset) (best fit: the smallest free range that fits, the lowest one among equals).
Both searches are binary (``bisect``, O(log n)); an insertion or removal moves list items, which is
O(n) but a ``memmove`` of pointers, faster than a tree for the few hundred ranges an arena has.
Thread-safe: every method takes the instance's lock.
"""

from __future__ import annotations

import bisect
import threading

#: Every range starts at a multiple of this many bytes and is a multiple of it long.
ALIGN = 256


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (a power of two)."""
    return (n + align - 1) & ~(align - 1)


class Ranges:
    """Best-fit allocation of aligned ranges of ``[0, size)``.

    Args:
        size: the bytes to hand out; a multiple of ``align``.
        align: the alignment of every range (a power of two).

    Raises:
        ValueError: ``size`` is not a positive multiple of ``align``, or ``align`` is not a power
            of two.
    """

    def __init__(self, size: int, align: int = ALIGN) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"the alignment must be a power of two, not {align}")
        if size <= 0 or size % align:
            raise ValueError(f"the size must be a positive multiple of {align}, not {size}")
        self.size, self.align = size, align
        self._lock = threading.Lock()
        self._free: dict[int, int] = {0: size}  # offset -> length of each free range
        self._offsets: list[int] = [0]  # the free ranges' offsets, sorted
        self._by_size: list[tuple[int, int]] = [(size, 0)]  # (length, offset), sorted
        self._taken: dict[int, int] = {}  # offset -> length of each range handed out
        self._used = 0

    def take(self, nbytes: int) -> int | None:
        """Hand out a range of at least ``nbytes`` (rounded up to the alignment): its offset, or
        None when no free range is that long.

        Raises:
            ValueError: ``nbytes`` is not positive.
        """
        if nbytes <= 0:
            raise ValueError(f"a range has a positive length, not {nbytes}")
        need = align_up(nbytes, self.align)
        with self._lock:
            i = bisect.bisect_left(self._by_size, (need, -1))
            if i == len(self._by_size):
                return None
            length, offset = self._by_size.pop(i)
            self._offsets.pop(bisect.bisect_left(self._offsets, offset))
            del self._free[offset]
            if length > need:  # the rest stays free
                self._add_free(offset + need, length - need)
            self._taken[offset] = need
            self._used += need
            return offset

    def handed_out(self, offset: int) -> bool:
        """True when a range handed out starts at ``offset`` (one dictionary lookup, without
        the lock: safe during garbage collection)."""
        return offset in self._taken

    def give(self, offset: int) -> int:
        """Take back the range handed out at ``offset``, merged with free neighbours; returns its
        length.

        Raises:
            KeyError: no range was handed out at ``offset`` (or it was given back already).
        """
        with self._lock:
            length = self._taken.pop(offset)
            self._used -= length
            start, end = offset, offset + length
            i = bisect.bisect_left(self._offsets, offset)
            below = self._offsets[i - 1] if i > 0 else None
            above = self._offsets[i] if i < len(self._offsets) else None
            if below is not None and below + self._free[below] == start:  # ends where we start
                self._drop_free(below)
                start = below
            if above == end:  # starts where we end
                end += self._drop_free(end)
            self._add_free(start, end - start)
            return length

    def _add_free(self, offset: int, length: int) -> None:
        self._free[offset] = length
        bisect.insort(self._offsets, offset)
        bisect.insort(self._by_size, (length, offset))

    def _drop_free(self, offset: int) -> int:
        length = self._free.pop(offset)
        self._offsets.pop(bisect.bisect_left(self._offsets, offset))
        self._by_size.pop(bisect.bisect_left(self._by_size, (length, offset)))
        return length

    @property
    def used(self) -> int:
        """Bytes handed out (each range counted at its aligned length)."""
        return self._used

    @property
    def free(self) -> int:
        """Bytes not handed out."""
        return self.size - self._used

    @property
    def largest_free(self) -> int:
        """The length of the longest free range (0 when none): the most one :meth:`take` gets."""
        with self._lock:
            return self._by_size[-1][0] if self._by_size else 0

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as ``(offset, length)``, by offset."""
        with self._lock:
            return [(o, self._free[o]) for o in self._offsets]

    def taken(self) -> dict[int, int]:
        """The ranges handed out: offset -> length."""
        with self._lock:
            return dict(self._taken)
