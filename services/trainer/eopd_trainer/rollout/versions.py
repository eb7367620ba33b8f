"""The policy version a worker samples with (`VersionTracker`): announced weights are loaded in
place into the sampler (a file or the mapped buffer by `sampler.load_weights`, a broadcast version
from the worker's receiver by `sampler.load_state`), and `ensure(min_version)` waits until the
sampler holds what a task asks for."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from ..queue.namespace import RunQueue
from ..queue.weights import WeightsUnavailable, check_weights_location
from ..queue.weights_buffer import WeightsTorn
from ..queue.weights_broadcast import FORMAT as BROADCAST_FORMAT
from ..queue.weights_broadcast import BroadcastReceiver, endpoint_of
from .metrics import WorkerMetrics

log = logging.getLogger("eopd.rollout")

WEIGHTS_RETRY_MAX_S = 5.0  # longest wait between attempts to load an announced file that failed


def start_receiver(cfg) -> BroadcastReceiver | None:
    """The worker's broadcast receiver (`weight_sync: broadcast`), started; None otherwise."""
    if cfg.weight_sync != "broadcast":
        return None
    return BroadcastReceiver(endpoint_of(cfg.weight_broadcast, cfg.queue.auth_key_file), torch.device(cfg.student.device)).start()


class VersionTracker:
    """The sampler's policy version, kept up to date with the announcements (`RunQueue.announcement`:
    one without its MAC is ignored, queue/announce.py)."""

    def __init__(self, sampler, queue: RunQueue, metrics: WorkerMetrics, *, mode: str, weights_poll_s: float,
                 stop: asyncio.Event, weights_dir: Path | None = None, receiver: BroadcastReceiver | None = None,
                 release_idle: bool = False):
        self.sampler = sampler
        self.queue = queue
        self.metrics = metrics
        self.mode = mode  # "sync" or "async" (the run's mode)
        self.weights_poll_s = weights_poll_s
        self.stop = stop
        self.weights_dir = weights_dir  # announced files must lie inside it (the run's <run_dir>/weights)
        self.receiver = receiver  # weight_sync: broadcast (queue/weights_broadcast.py)
        self.version = -1  # -1: the spec's weights, not loaded from an announcement
        self._sha = ""
        self.torn = False  # a load copied a version being rewritten: no whole version until the next load
        self.release_idle = release_idle and mode == "sync"  # rollout.release_idle_weights
        self.parked = False  # the sampler's weights are released (`release_while_waiting`) until the next load

    def _maybe_reload(self) -> None:
        pv = self.queue.announcement()
        # (version, sha256): after a learner rolls back to its last checkpoint, a version number
        # may be announced again with other weights.
        if pv is not None and ((pv.version, pv.sha256) != (self.version, self._sha) or self.parked):
            t0 = time.monotonic()
            if pv.format == BROADCAST_FORMAT:
                if self.receiver is None:
                    raise WeightsUnavailable(f"version {pv.version} was broadcast, and this worker is not in the "
                                             "group (weight_sync is not broadcast here): waiting for a file")
                with self.receiver.holding(pv) as tensors:  # WeightsUnavailable unless it holds that sequence
                    self.sampler.load_state(pv, tensors)
            else:
                if self.weights_dir is not None:
                    check_weights_location(pv, self.weights_dir)  # before the sampler opens (and hashes) anything
                try:
                    self.sampler.load_weights(pv)  # in place, no restart (vLLM: reload_weights + prefix cache reset)
                except WeightsTorn:
                    self.torn = True
                    raise
            self.version, self._sha, self.torn, self.parked = pv.version, pv.sha256, False, False
            self.metrics.version.set(pv.version)
            took = time.monotonic() - t0
            self.metrics.reload_seconds.observe(took)
            log.info("loaded policy version %d into %s in %.2fs", pv.version, self.sampler.engine, took)

    def release_while_waiting(self) -> None:
        """Sync mode with `rollout.release_idle_weights`: the worker has no task, so the learner is
        training on its samples and the next tasks will ask for the version it publishes after that;
        the sampler's weights are freed until then (`samplers/parked.py`: on the main job, 0.5 GiB
        less at the moment the job's memory peaks). Only weights loaded from an announcement are
        released (they can be loaded again); a sampler that cannot (vLLM) keeps them."""
        if not self.release_idle or self.parked or self.torn or not self._sha:
            return
        release = getattr(self.sampler, "release_weights", None)
        if release is not None and release():
            self.parked = True
            log.info("released policy version %d's weights while waiting for a task (loaded again before sampling)",
                     self.version)

    async def ensure(self, min_version: int) -> bool:
        """Waits until the sampler holds a policy version >= `min_version` (False: the run is done
        or the worker is stopping). An announced file that cannot be loaded right now (missing,
        sha256 mismatch, rewritten while read: `WeightsUnavailable`) never crashes the worker: the
        announcement is read again and the load retried with backoff (weights_poll_s doubling up to
        WEIGHTS_RETRY_MAX_S). Meanwhile, in async mode, a worker whose current weights satisfy the
        tasks keeps sampling with them; in sync mode it waits (the rollouts of the old weights
        would be dropped as stale)."""
        poll = self.weights_poll_s
        delay = poll
        while not self.stop.is_set():
            failed = False
            try:
                await asyncio.to_thread(self._maybe_reload)
            except WeightsUnavailable as exc:
                failed = True
                self.metrics.reload_failures.inc()
                keep = self.mode == "async" and not self.torn and max(self.version, 0) >= min_version
                log.warning("cannot load the announced weights: %s; %s", exc,
                            f"sampling with policy version {max(self.version, 0)} meanwhile" if keep
                            else f"retrying in {delay:.1f}s")
            if not (self.torn or self.parked) and max(self.version, 0) >= min_version and (not failed or self.mode == "async"):
                self.version = max(self.version, 0)  # nothing announced yet: the spec's weights are version 0
                return True
            if await asyncio.to_thread(self.queue.is_done):
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, max(WEIGHTS_RETRY_MAX_S, poll)) if failed else poll
        return False
