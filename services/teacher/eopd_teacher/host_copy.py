"""Statistics from the engine's device to the host, asynchronously: only what is sent (token
log-prob, entropy, top-k ids and log-probs, candidate log-probs) is copied, `non_blocking` into
pinned (page-locked) buffers, and a CUDA event recorded after the copies is what the caller waits
on. So the engine's thread returns as soon as the work is queued and the device goes on with the
next batch while this one's answers are split and encoded. On the CPU there is nothing to copy:
the statistics are the host tensors already and `wait()` returns them.

    pending = to_host(device_statistics(...))   # queues the copies, returns at once
    stats = pending.wait()                      # CPU tensors (blocks until the copies are done)
"""

from __future__ import annotations

import time
from dataclasses import fields

import torch

from .stats import TokenStatistics


class HostStatistics:
    """A `TokenStatistics` on its way to the host: `wait()` returns it on the CPU, once.
    `copy_wait_s`: the seconds the last `wait()` blocked on the device (0 on the CPU)."""

    def __init__(self, stats: TokenStatistics, event: torch.cuda.Event | None = None):
        self._stats = stats
        self._event = event
        self.copy_wait_s = 0.0

    @property
    def ready(self) -> bool:
        """True when `wait()` would not block."""
        return self._event is None or self._event.query()

    def wait(self) -> TokenStatistics:
        if self._event is not None:
            started = time.perf_counter()
            self._event.synchronize()
            self.copy_wait_s = time.perf_counter() - started
            self._event = None
        return self._stats


def to_host(stats: TokenStatistics) -> HostStatistics:
    """Starts copying `stats` to the host (see the module docstring); a no-op on the CPU."""
    device = stats.token_logprobs.device
    if device.type != "cuda":
        return HostStatistics(stats)
    pinned = {}
    for f in fields(TokenStatistics):
        t = getattr(stats, f.name)
        if t is None:
            pinned[f.name] = None
            continue
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch's caching host allocator reuses these
        buf.copy_(t, non_blocking=True)
        pinned[f.name] = buf
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return HostStatistics(TokenStatistics(**pinned), event)
