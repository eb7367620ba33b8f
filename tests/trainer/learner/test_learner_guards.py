"""The learner's guards, with real learner processes and a private redis-server (no worker: the
test writes the rollouts): drops recorded durably at the moment they are acknowledged (survive a
SIGKILL), the lease on the namespace (a SIGKILLed learner's lease taken over at once; a live one
refused, exit 2), rollout metadata checks (dead letters with the reason) and the bound on
systematic rejection (exit 5 listing the reasons)."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
from eopd_trainer.queue.lease import Lease
from eopd_trainer.queue.messages import Rollout, encode_rollout
from eopd_trainer.queue.streams import Keys, connect, read_counts, read_dead_letters, read_dropped

from tests.trainer.pipeline_helpers import describe, overrides, spawn_learner, wait_exit
from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration

K = 64  # configs/tiny.yaml: teacher.top_k


def scored(rid: str, *, version: int = 0, temperature: float = 1.0, k: int = K, n: int = 4,
           sample_index: int | None = None) -> bytes:
    """A well-formed ScoredRollout for the tiny models (vocabulary 49152)."""
    rng = np.random.default_rng(int.from_bytes(rid.encode(), "little") % 2**32)
    task, sample = rid.split("-")
    r = Rollout(rollout_id=rid, task_id=task, prompt_index=0,
                sample_index=int(sample[1:]) if sample_index is None else sample_index,
                prompt_ids=rng.integers(0, 1000, 5).astype(np.int32), response_ids=rng.integers(0, 1000, n).astype(np.int32),
                old_logprobs=-rng.random(n).astype(np.float32), teacher_logprobs=-rng.random(n).astype(np.float32),
                teacher_entropies=rng.random(n).astype(np.float32), teacher_topk_ids=rng.integers(0, 1000, (n, k)).astype(np.int32),
                teacher_topk_logprobs=-rng.random((n, k)).astype(np.float32), policy_version=version,
                sampling_temperature=temperature)
    return encode_rollout(r)


def test_drops_survive_a_sigkill_lease_and_poison_bound(tmp_path):
    ns = "guards"
    keys = Keys(ns)
    with running_redis() as redis_server:
        client = connect(redis_server.url)
        ov = overrides(tmp_path / "run", redis_server.url, "127.0.0.1:1", ns)

        # 1. Two rollouts from a future policy version: acknowledged without training, then SIGKILL
        #    while the learner waits for more. The drops were recorded with the acks, not at a commit.
        #    (Task t3 is one the learner publishes for iteration 1: rollouts of unpublished tasks are
        #    dead-lettered, tests/reliability/test_queue_bounds.py.)
        for rid in ("t3-s0", "t3-s1"):
            client.xadd(keys.rollouts, {b"data": scored(rid, version=7)})
        first = spawn_learner(ov, name="learner-1")
        try:
            deadline = time.monotonic() + 240
            while read_counts(client, keys.counts).get("future", 0) < 2:
                assert first.alive() and time.monotonic() < deadline, describe(first)
                time.sleep(0.2)
            first.signal(signal.SIGKILL)
            assert wait_exit(first, 30) == -9
        finally:
            first.stop()
        assert read_counts(client, keys.counts) == {"future": 2}
        dropped = read_dropped(client, keys.dropped)
        assert sorted((d["rollout_id"], d["reason"], d["policy_version"], d["staleness"]) for d in dropped) == [
            ("t3-s0", "future", "7", "-7"), ("t3-s1", "future", "7", "-7")]
        assert client.xlen(keys.rollouts) == 0 and client.xpending(keys.rollouts, "learner")["pending"] == 0
        assert client.exists(keys.lease)  # left behind by the killed learner

        # 2. Rollouts a learner must not train (metadata), four in a row with the bound at 4: the
        #    killed learner's lease is taken over at once (same host, its pid is gone), each rollout is
        #    dead-lettered with its reason, and the learner stops with status 5 listing them.
        bad = {"t0-s0": scored("t0-s0", temperature=0.5), "t0-s1": scored("t0-s1", k=8),
               "t1-s0": scored("t1-s0", n=17), "t1-s1": scored("t1-s1", sample_index=0)}
        for data in bad.values():
            client.xadd(keys.rollouts, {b"data": data})
        second = spawn_learner([*ov, "queue.max_rejected_in_a_row=4"], name="learner-2")
        try:
            rc = wait_exit(second, 240)
        finally:
            second.stop()
        log = second.log()
        assert rc == 5, describe(second)
        assert "took over the lease" in log
        reasons = [d["reason"] for d in read_dead_letters(client, keys.dead)]
        assert reasons == [
            "rollout t0-s0: sampling_temperature 0.5 differs from loss.temperature 1",
            f"inconsistent ScoredRollout t0-s1: top_k 8 differs from teacher.top_k {K}",
            "oversized ScoredRollout t1-s0: response_ids has 17 tokens, more than rollout.max_response_length 16",
            "rollout t1-s1: rollout_id does not match task_id 't1' and sample_index 0 (expected 't1-s0')",
        ]
        assert "4 rollouts in a row were rejected" in log and all(r in log for r in reasons)
        assert read_counts(client, keys.counts) == {"future": 2, "dead_letter": 4}
        assert not client.exists(keys.lease)  # released on the way out

        # 3. A live lease (held here, renewed by its heartbeat): the learner refuses to start.
        holder = Lease(connect(redis_server.url), keys.lease, ttl_ms=2000, description="the test's holder")
        holder.acquire()
        try:
            third = spawn_learner([*ov, "queue.lease_wait_s=1"], name="learner-3")
            try:
                rc = wait_exit(third, 120)
            finally:
                third.stop()
            assert rc == 2, describe(third)
            assert "is held by host" in third.log() and "(the test's holder)" in third.log()
            assert "another learner is running on this queue namespace" in third.log()
            holder.check()  # untouched
        finally:
            holder.release()
