"""Issue 17 section 1, part A: the queue authenticates its writers. Against a real redis-server:

- a learner (real process) reading forged well-formed ScoredRollouts sent before the real ones
  (same ids), junk and entries signed with another key, 4 x batch_size and more of them in a row:
  every forged entry is dead-lettered `unauthenticated` before it is decoded, none counts toward
  `max_rejected_in_a_row`, the real rollouts are the ones trained;
- forged PromptTasks (num_samples 2^32-1, min_policy_version 2^64-1) never reach the worker's decoder;
- a forged policy announcement is ignored;
- the redis-server `eopd run` starts refuses a stranger's CONFIG SET requirepass (NOAUTH) while the
  run's children, given REDIS_PASSWORD, use it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from eopd_trainer.config import QueueConfig
from eopd_trainer.config.load import load_config
from eopd_trainer.job.local_queue import choose_queue, run_key_file
from eopd_trainer.job.supervisor import Supervisor
from eopd_trainer.queue.announce import announce, current_announcement
from eopd_trainer.queue.messages import PolicyVersion, PromptTask, decode_task, encode_policy, encode_task
from eopd_trainer.queue.signing import Signer, load_key, write_key_file
from eopd_trainer.queue.streams import GROUP_ROLLOUT, Keys, StreamQueue, connect, read_counts, read_dead_letters
from eopd_trainer.rollout.metrics import WorkerMetrics
from eopd_trainer.rollout.task_book import TaskBook

from tests.trainer.pipeline_helpers import TINY, committed_state, describe, overrides, spawn_learner, wait_exit
from tests.trainer.redis_helpers import running_redis
from tests.trainer.learner.test_learner_guards import scored

pytestmark = pytest.mark.integration

BATCH = 8  # configs/tiny.yaml: train.batch_size (so max_rejected_in_a_row defaults to 32)


def test_forged_rollouts_and_junk_neither_train_nor_stop_the_learner(tmp_path):
    ns = "auth"
    keys = Keys(ns)
    key_file = write_key_file(tmp_path / "queue.key")
    signer, stranger = Signer(load_key(key_file)), Signer(b"s" * 32)
    real_ids = [f"t{t}-s{s}" for t in range(BATCH // 2) for s in (0, 1)]
    with running_redis() as server:
        client = connect(server.url)
        # A stranger's entries first: the ids of the first task, well-formed (they would pass every
        # decoder check), unsigned and signed with another key; then junk, 5 x batch_size in a row.
        forged = [scored("t0-s0", n=3), scored("t0-s1", n=3)]
        for data in forged:
            client.xadd(keys.rollouts, {b"data": data})
        client.xadd(keys.rollouts, stranger.fields(keys.rollouts, scored("t1-s0", n=3)))
        client.xadd(keys.rollouts, {b"data": scored("t1-s1", n=3), b"mac": b"\0" * 32})
        junk = 5 * BATCH
        for i in range(junk):
            client.xadd(keys.rollouts, {b"data": b"\xff junk %d" % i})
        # Then the workers' real rollouts, signed with the run's key.
        real = {rid: scored(rid) for rid in real_ids}
        for rid, data in real.items():
            client.xadd(keys.rollouts, signer.fields(keys.rollouts, data))

        run_dir = tmp_path / "run"
        learner = spawn_learner(overrides(run_dir, server.url, "127.0.0.1:1", ns, "train.iterations=1",
                                          f"queue.auth_key_file={key_file}"))
        try:
            rc = wait_exit(learner, 300)
        finally:
            learner.stop()
        assert rc == 0, describe(learner)
        log = learner.log()
        assert "in a row were rejected" not in log

        n_forged = 4 + junk
        counts = read_counts(client, keys.counts)
        assert counts == {"unauthenticated": n_forged}, counts  # no duplicate, no dead_letter, no stale
        dead = read_dead_letters(client, keys.dead)
        assert [d["reason"] for d in dead] == ["unauthenticated"] * n_forged
        assert [d["data"] for d in dead[:2]] == forged  # kept for the operator, never decoded
        state = committed_state(run_dir)
        assert sorted(state["ledger"]["1"]) == sorted(real_ids)  # the real t0-s0 / t0-s1 were trained
        assert client.xlen(keys.rollouts) == 0

        # What the learner wrote carries the run's MAC: its tasks and its policy announcement.
        tasks = client.xrange(keys.tasks)
        assert tasks and all(signer.valid(keys.tasks, f[b"data"], f.get(b"mac")) for _, f in tasks)
        pv = current_announcement(client, keys.policy, signer)
        assert pv is not None and pv.version == 1
        assert current_announcement(client, keys.policy, stranger) is None


def test_forged_tasks_never_reach_the_workers_decoder(tmp_path):
    ns = "auth-tasks"
    keys = Keys(ns)
    key_file = write_key_file(tmp_path / "queue.key")
    signer = Signer(load_key(key_file))
    with running_redis() as server:
        cfg = load_config(TINY, overrides(tmp_path / "run", server.url, "127.0.0.1:1", ns,
                                          f"queue.auth_key_file={key_file}"))
        client = connect(server.url)
        tasks = StreamQueue(client, keys.tasks, GROUP_ROLLOUT, "w1", keys.dead, signer=signer)
        tasks.ensure_group()
        huge = encode_task(PromptTask(0, 0, 2**32 - 1, 2**64 - 1))  # decodable: the decoder would accept it
        client.xadd(keys.tasks, {b"data": huge})
        client.xadd(keys.tasks, Signer(b"s" * 32).fields(keys.tasks, huge))
        genuine = PromptTask(1, 3, 2, 0, created_unix_ns=123)
        tasks.add(encode_task(genuine))  # as the learner publishes (signed)
        book = TaskBook(tasks, cfg, WorkerMetrics(0), "w1")
        entries = book.next_entries(10)
        assert [decode_task(e.data) for e in entries] == [genuine]
        dead = read_dead_letters(client, keys.dead)
        assert [(d["reason"], d["consumer"], d["data"]) for d in dead] == [("unauthenticated", "w1", huge)] * 2
        assert client.xlen(keys.tasks) == 1  # the forged ones acknowledged and deleted
        # A forged entry re-delivered (XAUTOCLAIM of an idle one) is checked the same way.
        client.xadd(keys.tasks, {b"data": huge})
        client.xreadgroup(GROUP_ROLLOUT, "dead-worker", {keys.tasks: ">"}, count=10)
        claimed = tasks.claim_idle(0, 10)  # idle for 0 ms: w1's own genuine task comes back too
        assert [decode_task(e.data) for e in claimed] == [genuine] and len(read_dead_letters(client, keys.dead)) == 3


def test_forged_policy_announcement_is_ignored(tmp_path):
    keys = Keys("auth-policy")
    signer = Signer(b"r" * 32)
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"weights")
    real = PolicyVersion(3, str(weights), "ab" * 32, 7, 3, created_unix_ns=5)
    with running_redis() as server:
        client = connect(server.url)
        announce(client, keys.policy, real, signer)
        assert current_announcement(client, keys.policy, signer) == real
        forged = PolicyVersion(4, "/dev/zero", "cd" * 32, 1, 4, created_unix_ns=6)
        client.set(keys.policy, encode_policy(forged))  # a stranger overwrites it
        assert current_announcement(client, keys.policy, signer) is None  # ignored: the worker keeps its weights
        assert current_announcement(client, keys.policy) == forged  # no key configured: not authenticated
        client.set(keys.policy, Signer(b"s" * 32).seal(keys.policy, encode_policy(forged)))
        assert current_announcement(client, keys.policy, signer) is None
        assert current_announcement(client, keys.policy) is None  # sealed, and this reader has no key


def test_eopd_runs_redis_server_refuses_strangers(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("REDIS_PASSWORD", "meant-for-an-external-redis")
    sup = Supervisor(tmp_path / "logs", pdeathsig=False)
    try:
        q = choose_queue(sup, tmp_path, QueueConfig(backend="redis-server"))
        assert q.backend == "redis-server" and "with a random password" in q.message
        password = sup.child_env["REDIS_PASSWORD"]
        assert len(password) == 64 and password == q.password and password not in q.message + q.url
        conf = tmp_path / "redis" / "auth.conf"
        assert stat.S_IMODE(os.stat(conf).st_mode) == 0o600
        redis_child = sup.children[0]
        cmdline = Path(f"/proc/{redis_child.popen.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline  # argv is readable by every local user

        stranger = redis.Redis.from_url(q.url, socket_timeout=5)
        for attempt in (lambda: stranger.config_set("requirepass", "x"), lambda: stranger.scan(match="*:rollouts"),
                        lambda: stranger.xadd("eopd:rollouts", {b"data": b"x"})):
            with pytest.raises(redis.exceptions.AuthenticationError, match="(?i)auth"):
                attempt()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(q.url, password="guess", socket_timeout=5).ping()
        # The pipeline's own client (queue/streams.connect, which retries connection errors for
        # minutes) fails at once on a refused password instead of hanging in its backoff.
        monkeypatch.setenv("REDIS_PASSWORD", "guess")
        t0 = time.monotonic()
        with pytest.raises(redis.exceptions.AuthenticationError):
            connect(q.url).ping()
        assert time.monotonic() - t0 < 5.0, "a refused password must not be retried"
        monkeypatch.delenv("REDIS_PASSWORD")

        # The run's children get the password (REDIS_PASSWORD) and connect as the learner and workers do.
        assert sup.drop_env == ("REDIS_PASSWORD",)  # the external Redis' password goes to no child
        probe = sup.start("probe", [sys.executable, "-c", "from eopd_trainer.queue.streams import connect; import sys; "
                                    f"r = connect({q.url!r}); r.set('probe', 'ok'); sys.exit(0 if r.ping() else 1)"])
        assert probe.wait(60) == 0, probe.log()
        teacher_like = sup.start("no-hold", [sys.executable, "-c", "import os, sys; "
                                             "sys.exit(1 if 'REDIS_PASSWORD' in os.environ else 0)"], hold=False)
        assert teacher_like.wait(60) == 0  # a child outside the run's state (the teacher) does not get it
        assert redis.Redis.from_url(q.auth_url).get("probe") == b"ok"
        assert redis.Redis.from_url(q.auth_url).config_get("requirepass")["requirepass"] == password
    finally:
        sup.stop_all()


def test_run_key_file_is_private_and_kept(tmp_path):
    path = Path(run_key_file(tmp_path, QueueConfig()))
    assert path == tmp_path / "queue.key" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = path.read_bytes()
    assert run_key_file(tmp_path, QueueConfig()) == str(path) and path.read_bytes() == key  # a resume keeps it
    assert run_key_file(tmp_path, QueueConfig(auth_key_file="/secrets/queue-key")) == "/secrets/queue-key"
    assert subprocess.run(["stat", "-c", "%a", str(path)], capture_output=True, text=True).stdout.strip() == "600"
