"""rollout/versions.py after a torn load (issue 50 ask 5): the mapped buffer is copied straight into
the sampler's model, so a copy that overlapped a rewrite leaves the model holding parts of two
versions (WeightsTorn). The tracker then samples nothing, in async mode too (where a failed load
otherwise keeps the current weights), until a whole version loads. Pure logic: the sampler, the
queue and the metrics are stand-ins; the torn copy itself is real in tests/trainer/queue/
test_weights_buffer.py."""

from __future__ import annotations

import asyncio

from eopd_trainer.queue.messages import PolicyVersion
from eopd_trainer.queue.weights import WeightsUnavailable
from eopd_trainer.queue.weights_buffer import WeightsTorn
from eopd_trainer.rollout.versions import VersionTracker


class _Metric:
    def set(self, *_):
        pass

    def observe(self, *_):
        pass

    def inc(self, *_):
        pass


class _Metrics:
    version = reload_seconds = reload_failures = _Metric()


class _Queue:
    def __init__(self, pv: PolicyVersion):
        self.pv = pv

    def announcement(self) -> PolicyVersion:
        return self.pv

    def is_done(self) -> bool:
        return False


class _Sampler:
    """Fails its first `failures` loads with the given errors, then loads."""

    engine = "test"

    def __init__(self, failures: list[Exception]):
        self.failures = list(failures)
        self.calls: list[int] = []

    def load_weights(self, pv: PolicyVersion) -> None:
        self.calls.append(pv.version)
        if self.failures:
            raise self.failures.pop(0)


def _tracker(sampler, pv: PolicyVersion, mode: str) -> VersionTracker:
    return VersionTracker(sampler, _Queue(pv), _Metrics(), mode=mode, weights_poll_s=0.001, stop=asyncio.Event())


def _pv(version: int) -> PolicyVersion:
    return PolicyVersion(version, "/dev/shm/x/policy.buf", f"seq:{2 * version}", 64, version, format="mapped")


def test_async_worker_samples_nothing_from_a_torn_model_until_a_whole_version_loads():
    sampler = _Sampler([])
    tracker = _tracker(sampler, _pv(1), "async")
    assert asyncio.run(tracker.ensure(1)) and tracker.version == 1 and not tracker.torn
    tracker.queue.pv = _pv(2)
    sampler.failures = [WeightsTorn("torn"), WeightsTorn("torn again")]
    # version 1 would do for these tasks, but the model no longer holds it: the tracker retries
    assert asyncio.run(tracker.ensure(1))
    assert sampler.calls == [1, 2, 2, 2] and tracker.version == 2 and not tracker.torn


def test_async_worker_keeps_a_whole_model_when_a_load_is_refused_untouched():
    sampler = _Sampler([])
    tracker = _tracker(sampler, _pv(1), "async")
    assert asyncio.run(tracker.ensure(1))
    tracker.queue.pv = _pv(2)
    sampler.failures = [WeightsUnavailable("being written")]  # refused before the model was touched
    assert asyncio.run(tracker.ensure(1))  # sampling version 1 meanwhile, as before
    assert sampler.calls == [1, 2] and tracker.version == 1 and not tracker.torn
