"""The arena's sub-allocator (gpu_serde.memory.arena.ranges): ranges never overlap, every byte comes back after
the frees, and free neighbours are always merged into one range."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpu_serde.memory.arena.ranges import ALIGN, Ranges, align_up

SIZE = 64 * ALIGN


class RangesMachine(RuleBasedStateMachine):
    """Random takes and gives, checked against the ranges handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.ranges = Ranges(SIZE)
        self.mine: dict[int, int] = {}  # offset -> length, what the test holds

    @rule(nbytes=st.integers(min_value=1, max_value=SIZE))
    def take(self, nbytes: int) -> None:
        largest = self.ranges.largest_free
        offset = self.ranges.take(nbytes)
        if offset is None:
            assert align_up(nbytes) > largest  # refused only when nothing is long enough
            return
        assert offset % ALIGN == 0 and offset + align_up(nbytes) <= SIZE
        self.mine[offset] = align_up(nbytes)

    @precondition(lambda self: self.mine)
    @rule(data=st.data())
    def give(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.mine)))
        assert self.ranges.give(offset) == self.mine.pop(offset)

    @invariant()
    def no_two_ranges_overlap(self) -> None:
        spans = sorted([*self.mine.items(), *self.ranges.free_ranges()])
        for (a, la), (b, _) in itertools.pairwise(spans):
            assert a + la <= b
        assert sum(length for _, length in spans) == SIZE  # and together they cover everything

    @invariant()
    def free_neighbours_are_merged(self) -> None:
        free = self.ranges.free_ranges()
        for (a, la), (b, _) in itertools.pairwise(free):
            assert a + la < b

    @invariant()
    def the_counts_agree(self) -> None:
        assert self.ranges.used == sum(self.mine.values()) == SIZE - self.ranges.free
        assert self.ranges.taken() == self.mine

    def teardown(self) -> None:
        for offset in list(self.mine):
            self.ranges.give(offset)
        assert self.ranges.free_ranges() == [(0, SIZE)]  # all memory back, in one range


TestRanges = RangesMachine.TestCase
TestRanges.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)


def test_best_fit_takes_the_smallest_free_range_that_fits():
    r = Ranges(16 * ALIGN)
    a, b, c = r.take(4 * ALIGN), r.take(ALIGN), r.take(2 * ALIGN)
    r.take(ALIGN)
    r.give(a)  # a free hole of 4 at 0, one of 2 at c, and the tail of 8
    r.give(c)
    assert r.take(2 * ALIGN) == c
    assert (a, b) == (0, 4 * ALIGN)


def test_a_range_too_long_for_any_free_one_is_refused():
    r = Ranges(4 * ALIGN)
    r.take(ALIGN)
    assert r.take(4 * ALIGN) is None
    assert r.largest_free == 3 * ALIGN


def test_giving_back_a_range_twice_raises():
    r = Ranges(4 * ALIGN)
    offset = r.take(1)
    r.give(offset)
    with pytest.raises(KeyError):
        r.give(offset)


@pytest.mark.parametrize("size, align", [(0, ALIGN), (ALIGN + 1, ALIGN), (ALIGN, 3)])
def test_a_size_or_alignment_that_cannot_work_is_a_value_error(size, align):
    with pytest.raises(ValueError):
        Ranges(size, align)


def test_threads_taking_and_giving_at_once_lose_nothing():
    r = Ranges(256 * ALIGN)

    def churn() -> None:
        for n in range(2000):
            offset = r.take(ALIGN * (1 + n % 3))
            if offset is not None:
                r.give(offset)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert r.free_ranges() == [(0, 256 * ALIGN)] and r.used == 0
