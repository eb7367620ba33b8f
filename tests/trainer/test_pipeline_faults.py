"""Failures of real pipeline processes: a learner SIGKILLed mid-iteration and between its
checkpoint commit and its acknowledgements (exactly-once from the rollout ids), a rollout worker
SIGKILLed (its pending tasks reclaimed by another worker), the teacher restarted (the worker
retries and loses nothing), a teacher with another tokenizer (refused)."""

from __future__ import annotations

import time

import pytest
from eopd_trainer.queue.streams import Keys, read_dead_letters

from tests.procs import restart_port, start_teacher
from tests.trainer.pipeline_helpers import (
    committed_state,
    describe,
    overrides,
    rollout_accounting,
    spawn_learner,
    spawn_worker,
    trained_ids,
    wait_exit,
    wait_for_iterations,
)
from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration

ITERATIONS = 6  # shorter than configs/tiny.yaml's 12
EXPECTED_IDS = {f"t{t}-s{s}" for t in range(4 * ITERATIONS) for s in range(2)}


@pytest.fixture(scope="module")
def redis_server():
    with running_redis() as proc:
        yield proc


def assert_exactly_once(run_dir) -> dict:
    state = committed_state(run_dir)
    assert state["iteration"] == ITERATIONS
    ids = trained_ids(state)  # fails if an id is in two iterations
    assert set(ids) == EXPECTED_IDS, sorted(set(ids) ^ EXPECTED_IDS)
    assert all(list(ids.values()).count(it) == 8 for it in range(1, ITERATIONS + 1))
    # No optimizer step of a killed attempt survives: exactly B / B_mini steps per iteration.
    assert state["optimizer_steps"] == state["global_steps"] == 2 * ITERATIONS
    return state


@pytest.mark.chaos
def test_learner_sigkill_exactly_once(tmp_path, redis_server, tiny_teacher):
    """checkpoint.every=2 (commits after iterations 2, 4, 6), a rollout of iteration 4 lost to the
    dead-letter stream, and two learner SIGKILLs. Iteration 4 is short while iteration 3's entries
    are still held unacknowledged (waiting for the commit): the learner must see that nothing more
    can arrive and publish a replacement task (it used to count the held entries as still to come
    and wait forever)."""
    ns, run_dir = "kill-learner", tmp_path / "run"
    ov = overrides(run_dir, redis_server.url, tiny_teacher.target, ns, f"train.iterations={ITERATIONS}",
                   "checkpoint.every=2")
    client = redis_server.client()
    # The worker's 26th rollout (iteration 4's 2nd: 8 per iteration) is published damaged.
    worker = spawn_worker([*ov, "faults=[{point: rollout.publish, count: 26, action: corrupt}]"], "w0")
    procs = [worker]
    try:
        # 1. killed after the first optimizer step of iteration 4: iterations 3 and 4 uncommitted.
        learner = spawn_learner([*ov, "faults=[{point: learner.after_step, iteration: 4, step: 1}]"])
        procs.append(learner)
        assert wait_exit(learner, 240, worker) == -9, describe(learner, worker)
        assert "iteration 4 short of 1 rollouts with every task done: 1 replacement tasks" in learner.log()
        assert committed_state(run_dir)["iteration"] == 2
        assert client.xpending(Keys(ns).rollouts, "learner")["pending"] == 16  # iterations 3 and 4, unacknowledged
        assert int(client.get(Keys(ns).tasks_next)) == 4 * 4 + 1

        # 2. restarted, killed after committing iteration 4 but before acknowledging its entries.
        learner = spawn_learner([*ov, "faults=[{point: learner.after_commit, iteration: 4}]"])
        procs.append(learner)
        assert wait_exit(learner, 240, worker) == -9, describe(learner, worker)
        assert "found 16 unacknowledged rollouts" in learner.log()
        assert committed_state(run_dir)["iteration"] == 4
        assert client.xpending(Keys(ns).rollouts, "learner")["pending"] == 16  # trained and committed

        # 3. restarted: iterations 3-4's entries are recognised as trained and only acknowledged.
        learner = spawn_learner(ov)
        procs.append(learner)
        assert wait_exit(learner, 300, worker) == 0, describe(learner, worker)
        assert wait_exit(worker, 60) == 0, describe(worker)
    finally:
        for p in procs:
            p.stop()
    state = committed_state(run_dir)
    assert state["iteration"] == ITERATIONS and state["optimizer_steps"] == state["global_steps"] == 2 * ITERATIONS
    acc = rollout_accounting(client, ns, state)
    ids = trained_ids(state)
    assert len(ids) == 8 * ITERATIONS and all(list(ids.values()).count(it) == 8 for it in range(1, ITERATIONS + 1))
    dead = read_dead_letters(client, Keys(ns).dead)
    assert len(dead) == 1 and dead[0]["reason"].startswith("undecodable ScoredRollout"), dead
    assert len(acc["dead"]) == 1 and not acc["unread"]
    # The replacement task's second rollout (sampled by version 3) is read in iteration 5: stale in
    # sync mode, dropped and counted. Every other rollout of every published task is trained once.
    assert acc["dropped"] and len(acc["dropped"]) == state["counters"]["stale_dropped"], (acc["dropped"], state["counters"])
    assert state["counters"]["duplicates"] >= 16
    assert client.xpending(Keys(ns).rollouts, "learner")["pending"] == 0
    assert client.xlen(Keys(ns).rollouts) == 0 and client.xlen(Keys(ns).tasks) == 0


@pytest.mark.chaos
def test_worker_sigkill_reclaimed_and_teacher_restart(tmp_path, redis_server):
    ns, run_dir = "kill-worker", tmp_path / "run"
    gp, hp = restart_port(), restart_port()
    teacher = start_teacher("tiny-random@0", "--max-batch-wait-ms", "20", grpc_port=gp, http_port=hp)
    ov = overrides(run_dir, redis_server.url, teacher.target, ns, "rollout.claim_idle_ms=2000",
                   f"train.iterations={ITERATIONS}")
    client = redis_server.client()
    procs = [teacher]
    try:
        w0 = spawn_worker([*ov, "faults=[{point: rollout.after_publish, count: 3}]"], "w0")
        learner = spawn_learner(ov)
        procs += [w0, learner]
        assert wait_exit(w0, 180, learner) == -9, describe(w0)
        stranded = client.xpending_range(Keys(ns).tasks, "rollout", "-", "+", 100, consumername="w0")
        assert stranded, "the killed worker should leave pending tasks"

        w1 = spawn_worker(ov, "w1")
        procs.append(w1)
        wait_for_iterations(run_dir, 2, 240, learner, w1)
        # The teacher dies and comes back on the same port while the worker is working.
        teacher.popen.kill()
        teacher.popen.wait(10)
        time.sleep(1.0)
        teacher = start_teacher("tiny-random@0", "--max-batch-wait-ms", "20", grpc_port=gp, http_port=hp)
        procs.append(teacher)

        assert wait_exit(learner, 300, w1) == 0, describe(learner, w1)
        assert wait_exit(w1, 60) == 0, describe(w1)
    finally:
        for p in procs:
            p.stop()
    assert "reclaimed" in w1.log()
    assert not client.xpending_range(Keys(ns).tasks, "rollout", "-", "+", 100, consumername="w0")
    state = assert_exactly_once(run_dir)
    assert state["counters"]["duplicates"] >= 1  # t1-s0: published by w0 before the kill and again by w1


def test_tokenizer_mismatch_refused(tmp_path, redis_server, tiny_teacher):
    from eopd_common.models import build_tiny_random, load_tokenizer

    student_dir = tmp_path / "other-tokenizer"
    tok = load_tokenizer("tiny-random")
    tok.add_special_tokens({"additional_special_tokens": ["<|eopd_other|>"]})
    build_tiny_random(len(tok), seed=1).save_pretrained(student_dir)
    tok.save_pretrained(student_dir)
    ov = overrides(tmp_path / "run", redis_server.url, tiny_teacher.target, "mismatch", f"student.model={student_dir}")
    worker = spawn_worker(ov, "wx")
    try:
        assert wait_exit(worker, 120) == 3, describe(worker)
    finally:
        worker.stop()
    log = worker.log()
    assert "tokenizer mismatch" in log and "vocabulary sizes differ (49152 vs 49153)" in log, log[-2000:]
    assert redis_server.client().xlen(Keys("mismatch").rollouts) == 0


def test_teacher_limits_refused_at_start(tmp_path, redis_server, tiny_teacher):
    """A run whose requests the real teacher would refuse (its GetModelInfo: context 2048, top-k at
    most 64) is refused before any task is taken: exit code 2, one message naming every config key."""
    ov = overrides(tmp_path / "run", redis_server.url, tiny_teacher.target, "limits-start",
                   "teacher.top_k=100", "data.max_prompt_length=2040")
    worker = spawn_worker(ov, "wl")
    try:
        assert wait_exit(worker, 120) == 2, describe(worker)
    finally:
        worker.stop()
    log = worker.log()
    assert "cannot serve this run" in log, log[-2000:]
    assert ("data.max_prompt_length (2040) + rollout.max_response_length (16) = 2056 exceeds the teacher's "
            "max_context_length (2048)") in log, log[-2000:]
    assert "teacher.top_k (100) exceeds the teacher's max_top_k (64)" in log, log[-2000:]
    assert redis_server.client().xlen(Keys("limits-start").rollouts) == 0


@pytest.mark.chaos
def test_learner_sigterm_stops_cleanly_and_resumes_nothing_lost(tmp_path, redis_server, tiny_teacher):
    """SIGTERM while waiting for rollouts: exit 0 without marking the run done."""
    import signal

    ns, run_dir = "sigterm", tmp_path / "run"
    ov = overrides(run_dir, redis_server.url, tiny_teacher.target, ns, "train.iterations=2")
    client = redis_server.client()
    learner = spawn_learner(ov)  # no worker: it publishes its tasks and waits
    try:
        deadline = time.monotonic() + 120
        while client.get(Keys(ns).policy) is None or client.xlen(Keys(ns).tasks) < 4:
            assert learner.alive() and time.monotonic() < deadline, describe(learner)
            time.sleep(0.2)
        learner.signal(signal.SIGTERM)
        assert wait_exit(learner, 60) == 0, describe(learner)
    finally:
        learner.stop()
    assert "stopped by a signal before iteration 1" in learner.log()
    assert not client.exists(Keys(ns).done)
    assert client.xlen(Keys(ns).tasks) == 4  # the published tasks stay for the restarted run


@pytest.mark.chaos
def test_worker_sigterm_while_teacher_is_gone_exits_within_grace(tmp_path, redis_server):
    """SIGTERM reaches a worker whose teacher has died (its client would retry for
    teacher.retry_timeout_s = 300 s): it exits 0 within rollout.stop_grace_s, its unanswered tasks
    stay pending, and another worker re-does them once the teacher is back: exactly once."""
    import signal

    ns, run_dir = "term-no-teacher", tmp_path / "run"
    gp, hp = restart_port(), restart_port()
    teacher = start_teacher("tiny-random@0", "--max-batch-wait-ms", "20", grpc_port=gp, http_port=hp)
    ov = overrides(run_dir, redis_server.url, teacher.target, ns, "rollout.claim_idle_ms=2000",
                   f"train.iterations={ITERATIONS}", "teacher.retry_timeout_s=300", "rollout.stop_grace_s=3")
    client = redis_server.client()
    procs = [teacher]
    try:
        w0, learner = spawn_worker(ov, "w0"), spawn_learner(ov)
        procs += [w0, learner]
        wait_for_iterations(run_dir, 1, 240, learner, w0)
        teacher.popen.kill()
        teacher.popen.wait(10)
        time.sleep(2.0)  # the worker's stream breaks; it is now retrying a teacher that is gone
        t0 = time.monotonic()
        w0.popen.send_signal(signal.SIGTERM)
        assert wait_exit(w0, 30) == 0, describe(w0)
        stop_s = time.monotonic() - t0
        assert client.xpending_range(Keys(ns).tasks, "rollout", "-", "+", 100, consumername="w0"), describe(w0)

        teacher = start_teacher("tiny-random@0", "--max-batch-wait-ms", "20", grpc_port=gp, http_port=hp)
        w1 = spawn_worker(ov, "w1")
        procs += [teacher, w1]
        assert wait_exit(learner, 300, w1) == 0, describe(learner, w1)
        assert wait_exit(w1, 60) == 0, describe(w1)
    finally:
        for p in procs:
            p.stop()
    assert "will be re-done" in w0.log(), describe(w0)
    assert stop_s < 25, f"the worker took {stop_s:.0f}s to stop (grace 3s; retry budget 300s)"
    assert_exactly_once(run_dir)


@pytest.mark.chaos
def test_slow_batches_are_not_reclaimed_from_a_live_worker(tmp_path, redis_server, tiny_teacher):
    """Two workers whose sampling takes 3x rollout.claim_idle_ms: the heartbeat keeps each one's
    tasks from looking idle, so neither takes the other's work (no reclaim, no duplicate)."""
    ns, run_dir = "slow-batches", tmp_path / "run"
    ov = overrides(run_dir, redis_server.url, tiny_teacher.target, ns, "rollout.claim_idle_ms=1500",
                   "train.iterations=3", "faults=[{point: rollout.sample, action: delay, seconds: 4.5}]")
    learner, w0, w1 = spawn_learner(ov), spawn_worker(ov, "w0"), spawn_worker(ov, "w1")
    try:
        assert wait_exit(learner, 300, w0, w1) == 0, describe(learner, w0, w1)
        assert wait_exit(w0, 60) == 0 and wait_exit(w1, 60) == 0, describe(w0, w1)
    finally:
        for p in (learner, w0, w1):
            p.stop()
    assert w0.log().count("injected fault delay") + w1.log().count("injected fault delay") >= 3
    assert "reclaimed" not in w0.log() + w1.log(), describe(w0, w1)
    state = committed_state(run_dir)
    assert state["iteration"] == 3 and state["counters"]["duplicates"] == 0
