"""The learner hands memory freed by an update back to the OS (learner/learner.py `release_freed_memory`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# In a fresh interpreter: a long test session's heap already holds free chunks that new buffers reuse.
SCENARIO = textwrap.dedent("""
    import json
    from learner.learner import release_freed_memory, resident_mb
    start = resident_mb()
    big, small = [], []
    for _ in range(4000):  # 64 KB each: below glibc's mmap threshold, so they come from the heap
        big.append(bytearray(65536))
        small.append(bytearray(600))
    held = resident_mb()
    del big
    freed = resident_mb()
    print(json.dumps({"start": start, "held": held, "freed": freed, "trimmed": release_freed_memory()}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim and /proc/self/statm")
def test_freed_but_fragmented_heap_goes_back_to_the_os():
    """Buffers freed between live small ones stay resident (glibc cannot shrink the heap past them),
    as an update's activations did between the engines' allocations; the trim returns them."""
    out = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True, timeout=120, check=True)
    mb = json.loads(out.stdout.strip().splitlines()[-1])
    grown = mb["held"] - mb["start"]
    assert grown > 200, mb  # 250 MB touched
    assert mb["freed"] > mb["held"] - 0.2 * grown, f"glibc returned the freed buffers by itself: {mb}"
    assert mb["trimmed"] < mb["freed"] - 0.8 * grown, mb
