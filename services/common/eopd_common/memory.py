"""A process's freed memory handed back to the system (glibc), for every eopd process.

glibc serves an allocation below its mmap threshold from its heap arenas and keeps the pages of
what is freed there for reuse; the threshold starts at 128 KiB and rises to the size of every
larger block freed (up to 32 MiB), so after the first weight load or forward pass a torch
process's tensors (a few MiB each) live on the heap and the process's RSS stays at its highest
point for good, fragmented between live objects.

- `return_large_frees()`: allocations of at least `MMAP_THRESHOLD` are mmapped (the threshold
  pinned, no longer raised), so freeing one unmaps it at once. Measured on the main job
  (issue 50; docs/benchmarks.md "Main job"): the processes' summed peak went from 7.4 to 6.2 GiB
  over 4 iterations, and the iterations were not slower.
- `release_freed()`: a garbage collection (torch's many objects make full collections rare, and a
  reference cycle holds its tensors until one runs), then `malloc_trim(0)`: the arenas' free pages
  back to the system. For the end of a phase that allocated much (preparing the run, a checkpoint).

On a C library without these calls (musl, macOS) both do what they can: nothing, or the collection."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import resource

# glibc's mallopt parameter number for the mmap threshold (malloc.h: M_MMAP_THRESHOLD = -3).
M_MMAP_THRESHOLD = -3
# Allocations at least this large are mmapped, so freeing them returns them to the system at once.
MMAP_THRESHOLD = 1 << 20


@functools.cache
def libc() -> ctypes.CDLL | None:
    """glibc with malloc_trim and mallopt, or None (another C library)."""
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    return lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None


def return_large_frees(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pins glibc's mmap threshold at `threshold` bytes; False where it could not (no glibc, or
    mallopt refused)."""
    lib = libc()
    return bool(lib is not None and lib.mallopt(M_MMAP_THRESHOLD, int(threshold)))


def release_freed() -> int:
    """A full garbage collection, then the heap's free pages back to the system; returns the
    number of objects the collection freed."""
    collected = gc.collect()
    lib = libc()
    if lib is not None:
        lib.malloc_trim(0)
    return collected


def resident_bytes() -> int | None:
    """This process's resident memory (Linux: /proc/self/statm), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None
