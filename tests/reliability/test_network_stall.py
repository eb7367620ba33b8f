"""A stalled network path between a rollout worker and the teacher: a TCP proxy in the test stops
forwarding bytes without closing either connection (what a dead middlebox or a partitioned link
does). The worker's stream deadline (`teacher.timeout_s`) fires, the worker abandons the stream,
reconnects and re-sends the unanswered requests; once the path is restored the run completes with
every rollout trained exactly once."""

from __future__ import annotations

import time

import pytest

from tests.stalling_proxy import StallingProxy
from tests.trainer.pipeline_helpers import (
    committed_state,
    describe,
    overrides,
    spawn_learner,
    spawn_worker,
    trained_ids,
    wait_exit,
    wait_for_iterations,
)
from tests.trainer.redis_helpers import running_redis

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_stalled_teacher_path_deadline_fires_and_run_recovers(tmp_path, tiny_teacher):
    iterations, timeout_s = 4, 3.0
    proxy = StallingProxy(("127.0.0.1", tiny_teacher.grpc_port))
    with running_redis() as server:
        run_dir, ns = tmp_path / "run", "stall"
        ov = overrides(run_dir, server.url, proxy.target, ns, f"train.iterations={iterations}",
                       f"teacher.timeout_s={timeout_s}", "teacher.retry_timeout_s=120")
        learner = spawn_learner(ov)
        worker = spawn_worker(ov, "w0")
        try:
            wait_for_iterations(run_dir, 1, 180, learner, worker)
            proxy.stall()
            # The stall lasts longer than several deadlines: the worker abandons the stream more
            # than once (new connections through the stalled proxy stay silent too).
            deadline = time.monotonic() + 60
            while worker.log().count("abandoning the stream") < 2:
                assert time.monotonic() < deadline and worker.alive(), describe(worker)
                time.sleep(0.2)
            connections_during_stall = proxy.connections
            proxy.restore()
            assert wait_exit(learner, 240, worker) == 0, describe(learner, worker)
            assert wait_exit(worker, 60) == 0, describe(worker)
        finally:
            learner.stop()
            worker.stop()
            proxy.close()
    state = committed_state(run_dir)
    assert state["iteration"] == iterations
    ids = trained_ids(state)  # no id twice
    assert set(ids) == {f"t{t}-s{s}" for t in range(4 * iterations) for s in range(2)}
    assert connections_during_stall >= 2  # reconnected through the proxy
    assert "no answer from the teacher for 3.0s" in worker.log()
