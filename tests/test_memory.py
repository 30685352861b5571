"""The learner hands memory freed by an update back to the OS (learner/learner.py `release_freed_memory`)."""

from __future__ import annotations

import sys

import pytest

from learner.learner import release_freed_memory, resident_mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc/self/statm")
def test_freed_but_fragmented_heap_goes_back_to_the_os():
    """Buffers freed between live small ones stay resident (glibc cannot shrink the heap past them),
    as an update's activations did between the engines' allocations; the trim returns them."""
    start = resident_mb()
    big, small = [], []
    for _ in range(4000):  # 64 KB each: below glibc's mmap threshold, so they come from the heap
        big.append(bytearray(65536))
        small.append(bytearray(600))
    held = resident_mb()
    del big
    freed = resident_mb()
    trimmed = release_freed_memory()
    del small
    grown = held - start
    assert grown > 200  # 250 MB touched
    assert freed > held - 0.2 * grown, "glibc returned the freed buffers by itself: nothing here to test"
    assert trimmed < freed - 0.8 * grown
