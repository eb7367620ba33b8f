"""The learner's side of the decision "systematic poison vs. an attacker" (RolloutFeed on fakeredis,
pure logic; the real learner process against a real redis-server: test_queue_auth.py): entries
without a valid MAC never count toward queue.max_rejected_in_a_row, authenticated entries that
fail validation (the run's own processes failing) still stop the learner."""

from __future__ import annotations

import fakeredis
import pytest
from eopd_trainer.config.load import load_config
from eopd_trainer.learner.feed import EXIT_REJECTED, LearnerAbort, RolloutFeed
from eopd_trainer.learner.state import LearnerState
from eopd_trainer.queue.messages import encode_rollout
from eopd_trainer.queue.signing import Signer, load_key, write_key_file
from eopd_trainer.queue.namespace import RunQueue
from eopd_trainer.queue.streams import read_counts

from tests.trainer.pipeline_helpers import TINY
from tests.trainer.learner.test_learner_units import rollout


def _feed(tmp_path):
    key_file = write_key_file(tmp_path / "queue.key")
    cfg = load_config(TINY, ["train.batch_size=2", "train.mini_batch_size=2", "train.micro_batch_size=2",
                             f"queue.auth_key_file={key_file}"])
    feed = RolloutFeed(cfg)
    feed.queue = RunQueue(fakeredis.FakeRedis(), "ns", signer=feed.signer)  # what acquire_lease sets
    feed.setup_queues(LearnerState(), num_prompts=4, vocab_size=100)
    return feed, Signer(load_key(key_file))


def test_unauthenticated_entries_do_not_count_toward_the_stop_rule(tmp_path):
    feed, signer = _feed(tmp_path)
    k, t = feed.cfg.teacher.top_k, feed.cfg.loss.temperature
    stream = feed.queue.keys.rollouts
    for i in range(3 * feed.rejects.limit):  # junk, and well-formed rollouts with no or a wrong MAC
        data = encode_rollout(rollout("t0-s0", k=k, sampling_temperature=t)) if i % 2 else b"junk %d" % i
        feed.queue.client.xadd(stream, {b"data": data} if i % 3 else {b"data": data, b"mac": b"\0" * 32})
    for rid in ("t0-s0", "t0-s1"):
        feed.queue.client.xadd(stream, signer.fields(stream, encode_rollout(rollout(rid, k=k, sampling_temperature=t))))
    collected = feed.collect(1)
    assert [r.rollout_id for r in collected.rollouts] == ["t0-s0", "t0-s1"]
    assert read_counts(feed.queue.client, feed.queue.keys.counts) == {"unauthenticated": 3 * feed.rejects.limit}
    assert feed.state.feed.counters.dead_letters == 0 and feed.state.feed.counters.duplicates == 0


def test_authenticated_poison_still_stops_the_learner(tmp_path):
    feed, signer = _feed(tmp_path)
    for _ in range(feed.rejects.limit):  # the run's own worker sending what fails validation
        feed.queue.client.xadd(feed.queue.keys.rollouts, signer.fields(feed.queue.keys.rollouts, b"junk"))
    with pytest.raises(LearnerAbort) as exc:
        feed.collect(1)
    assert exc.value.code == EXIT_REJECTED
    assert read_counts(feed.queue.client, feed.queue.keys.counts) == {"dead_letter": feed.rejects.limit}
