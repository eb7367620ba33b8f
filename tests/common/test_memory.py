"""eopd_common.memory: freed memory goes back to the system. Each case runs in a fresh interpreter
(mallopt settings are per process): 200 blocks of 4 MiB, each followed by a small block that stays
alive (what a forward pass leaves between its activations), after one large block was freed (which
raises glibc's dynamic mmap threshold, as a weight load does); then the blocks are freed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eopd_common.memory import libc, release_freed, resident_bytes

COMMON = Path(__file__).resolve().parents[2] / "services" / "common"
PROGRAM = """
import sys
sys.path.insert(0, {common!r})
from eopd_common.memory import return_large_frees, release_freed, resident_bytes
mode = {mode!r}
if mode == "pinned":
    assert return_large_frees()
x = bytearray(8 << 20); del x
base = resident_bytes()
big, small = [], []
for _ in range(200):
    block = bytearray(4 << 20)
    block[::4096] = b"\\1" * len(block[::4096])  # touched: resident
    big.append(block)
    small.append(bytearray(2000))
peak = resident_bytes()
del big
if mode == "trimmed":
    release_freed()
print((peak - base) >> 20, (resident_bytes() - base) >> 20)
"""

glibc_only = pytest.mark.skipif(libc() is None, reason="not glibc: no mallopt / malloc_trim")


def _held_mib(mode: str) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PROGRAM.format(common=str(COMMON), mode=mode)],
                         capture_output=True, text=True, check=True, timeout=60)
    peak, held = map(int, out.stdout.split())
    return peak, held


@glibc_only
def test_without_it_freed_blocks_stay_resident():
    """The premise: glibc keeps the freed blocks (800 MiB) in its heap, the process's RSS at its peak."""
    peak, held = _held_mib("default")
    assert peak >= 780
    assert held >= 700, f"glibc returned the blocks on its own ({held} of {peak} MiB held)"


@glibc_only
def test_return_large_frees_hands_blocks_back_when_freed():
    peak, held = _held_mib("pinned")
    assert peak >= 780
    assert held <= 40, f"{held} MiB of {peak} still resident"


@glibc_only
def test_release_freed_hands_the_heaps_free_pages_back():
    peak, held = _held_mib("trimmed")
    assert peak >= 780
    assert held <= 40, f"{held} MiB of {peak} still resident"


def test_release_freed_collects_reference_cycles():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    del a, b
    assert release_freed() >= 2


def test_resident_bytes_reads_this_process():
    rss = resident_bytes()
    assert rss is None or rss > 10 << 20
