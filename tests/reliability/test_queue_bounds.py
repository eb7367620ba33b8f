"""Issue 17 section 1, the bounds: forged queue entries against a real redis-server and the
project's own decoders and consumers (the learner's `RolloutFeed`, the worker's `TaskBook` and
`VersionTracker`, `pack_rollouts`). Each attack of the issue's (obs) bullets is reproduced and
shown refused with a reason naming the field, while the honest entries beside it go through:

- a 2,000,000-token prompt and a top_k of 200,000 in a ScoredRollout (dead-lettered before they
  are parsed; `pack_rollouts` cannot be made to pad to such a k);
- rollouts of a task never published, or of a sample the task never asked for;
- a PromptTask with num_samples 4294967295 and min_policy_version 2^64-1;
- a weights announcement with uri=/dev/zero (or any file outside the run's weights directory);
- a rollout that crashes the learner, re-read after every restart: dead-lettered after the cap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from eopd.v1 import rollout_pb2 as pb
from eopd_trainer.batching import pack_rollouts
from eopd_trainer.config.load import load_config
from eopd_trainer.learner.feed import RolloutFeed
from eopd_trainer.learner.ledger import Ledger
from eopd_trainer.learner.state import LearnerState
from eopd_trainer.queue.announce import announce
from eopd_trainer.queue.messages import (
    PoisonMessage,
    PolicyVersion,
    PromptTask,
    Rollout,
    RolloutLimits,
    decode_rollout,
    encode_rollout,
    encode_task,
)
from eopd_trainer.queue.namespace import RunQueue
from eopd_trainer.queue.streams import GROUP_ROLLOUT, Keys, StreamQueue, connect, read_counts, read_dead_letters
from eopd_trainer.queue.weights import WeightsUnavailable, read_weights, save_weights, verify_weights
from eopd_trainer.rollout.task_book import TaskBook
from eopd_trainer.rollout.versions import VersionTracker

from tests.trainer.pipeline_helpers import TINY
from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration

VOCAB = 49152
TOP_K = 64  # configs/tiny.yaml's teacher.top_k
HANG_BOUND_S = 60  # generous: each refusal takes milliseconds; hashing /dev/zero would never end


@pytest.fixture(scope="module")
def server():
    with running_redis() as s:
        yield s


def make_rollout(rid: str, *, n: int = 4, k: int = TOP_K, p: int = 5, seed: int = 0) -> Rollout:
    rng = np.random.default_rng(seed)
    task, sample = rid.split("-")
    return Rollout(
        rollout_id=rid, task_id=task, prompt_index=0, sample_index=int(sample[1:]),
        prompt_ids=rng.integers(0, VOCAB, p).astype(np.int32), response_ids=rng.integers(0, VOCAB, n).astype(np.int32),
        old_logprobs=-rng.random(n).astype(np.float32), teacher_logprobs=-rng.random(n).astype(np.float32),
        teacher_entropies=rng.random(n).astype(np.float32),
        teacher_topk_ids=rng.integers(0, VOCAB, (n, k)).astype(np.int32),
        teacher_topk_logprobs=-rng.random((n, k)).astype(np.float32), policy_version=0, sampled_unix_ns=1)


def config(server, tmp_path: Path, ns: str, *extra: str):
    return load_config(TINY, [f"run_dir={tmp_path}", f"queue.redis_url={server.url}", f"queue.namespace={ns}",
                              "train.batch_size=2", "train.mini_batch_size=2", "train.micro_batch_size=2",
                              "queue.block_ms=50", "queue.lease_wait_s=5", *extra])


def start_learner(cfg, ledger: Ledger | None = None) -> RolloutFeed:
    """The learner's Redis side as a (re)started learner sets it up: lease, groups, pending entries."""
    feed = RolloutFeed(cfg)
    feed.acquire_lease()
    feed.setup_queues(LearnerState(ledger=ledger or Ledger()), num_prompts=4, vocab_size=VOCAB)
    return feed


# The learner: rollouts -------------------------------------------------------------------------

def test_forged_rollouts_beyond_the_runs_bounds_are_dead_lettered_and_honest_ones_trained(server, tmp_path):
    cfg = config(server, tmp_path, "qb-rollouts")
    feed = start_learner(cfg)
    keys, r = feed.queue.keys, feed.queue.client
    forged = {
        # a forged copy of a real id sent first, with a 2,000,000-token prompt
        "t0-s0": encode_rollout(make_rollout("t0-s0", p=2_000_000)),
        # top_k 200,000 (one response token: 200,000 ids and log-probs)
        "t0-s1": encode_rollout(make_rollout("t0-s1", n=1, k=200_000)),
        "t999-s0": encode_rollout(make_rollout("t999-s0")),  # a task never published
        "t0-s5": encode_rollout(make_rollout("t0-s5")),  # rollout.n_samples is 2
    }
    for data in forged.values():
        r.xadd(keys.rollouts, {b"data": data})
    honest = [make_rollout("t0-s0", seed=1), make_rollout("t0-s1", seed=2)]
    for h in honest:
        r.xadd(keys.rollouts, {b"data": encode_rollout(h)})

    collected = feed.collect(1)  # publishes task t0 (batch 2 / n_samples 2), reads all six entries
    assert [x.rollout_id for x in collected.rollouts] == ["t0-s0", "t0-s1"]
    assert [int(x.prompt_ids.shape[0]) for x in collected.rollouts] == [5, 5]  # the honest ones
    dead = read_dead_letters(r, keys.dead)
    assert [d["data"] for d in dead] == list(forged.values())  # kept for inspection
    reasons = [d["reason"] for d in dead]
    limit = RolloutLimits.from_config(cfg).max_bytes
    assert reasons[0].startswith(f"oversized ScoredRollout: {len(forged['t0-s0'])} bytes, more than the {limit}")
    assert reasons[1].startswith(f"oversized ScoredRollout: {len(forged['t0-s1'])} bytes")
    assert reasons[2] == "rollout t999-s0: task t999 was never published (the learner published 1 tasks)"
    assert reasons[3] == "rollout t0-s5: sample_index 5 is not below rollout.n_samples 2"
    assert read_counts(r, keys.counts)["dead_letter"] == 4
    packed = pack_rollouts(collected.rollouts, pad_id=0)
    assert tuple(packed.loss_inputs.teacher_topk_ids.shape) == (8, TOP_K)  # 2 x 4 response tokens at the run's k, no more
    feed.close()


@pytest.mark.parametrize(("rollout", "reason"), [
    (make_rollout("t0-s0", p=1025), "oversized ScoredRollout t0-s0: prompt_ids has 1025 tokens, more than "
                                    "data.max_prompt_length 1024"),
    (make_rollout("t0-s0", n=17), "oversized ScoredRollout t0-s0: response_ids has 17 tokens, more than "
                                  "rollout.max_response_length 16"),
    (make_rollout("t0-s0", k=TOP_K + 1), f"inconsistent ScoredRollout t0-s0: top_k {TOP_K + 1} differs from "
                                         f"teacher.top_k {TOP_K}"),
    (make_rollout("t0-s0", k=TOP_K - 1), f"inconsistent ScoredRollout t0-s0: top_k {TOP_K - 1} differs"),
])
def test_each_field_bound_names_the_field(rollout, reason, tmp_path):
    """Entries small enough to be parsed: the field's bound refuses them before any array is built."""
    limits = RolloutLimits.from_config(load_config(TINY, [f"run_dir={tmp_path}"]))
    data = encode_rollout(rollout)
    assert len(data) <= limits.max_bytes
    with pytest.raises(PoisonMessage) as exc:
        decode_rollout(data, vocab_size=VOCAB, limits=limits)
    assert exc.value.reason.startswith(reason), exc.value.reason
    decode_rollout(encode_rollout(make_rollout("t0-s0", p=1024, n=16)), vocab_size=VOCAB, limits=limits)  # at the bounds


def test_pack_rollouts_cannot_be_made_to_pad_to_a_huge_k():
    """The packing's own guard (the learner never admits such a rollout): one honest 16-token
    rollout beside a top_k-200,000 one would have been padded to 200,000 x 16 x 12 bytes."""
    honest, huge = make_rollout("t0-s0", n=16), make_rollout("t0-s1", n=1, k=200_000)
    with pytest.raises(ValueError, match=r"rollouts \['t0-s1'\]: top_k above the packing's maximum 1024"):
        pack_rollouts([honest, huge], pad_id=0)
    assert tuple(pack_rollouts([honest], pad_id=0).loss_inputs.teacher_topk_ids.shape) == (16, TOP_K)


def test_a_rollout_that_crashes_the_learner_is_dead_lettered_after_the_cap(server, tmp_path):
    """The learner reads a batch and dies before committing it (the rollouts crash it), again and
    again: each restart re-reads them first. Past rollout.max_rollout_deliveries restarts they are
    dead-lettered and the next learner trains what comes next; one whose training is committed
    (in the checkpoint's ledger, not yet acknowledged) is kept and dropped as a duplicate."""
    cfg = config(server, tmp_path, "qb-crash", "rollout.max_rollout_deliveries=2")
    feed = start_learner(cfg)
    for rid in ("t0-s0", "t0-s1"):
        feed.queue.client.xadd(feed.queue.keys.rollouts, {b"data": encode_rollout(make_rollout(rid))})
    assert [x.rollout_id for x in feed.collect(1).rollouts] == ["t0-s0", "t0-s1"]
    feed.close()  # the crash: nothing acknowledged
    for _ in range(2):  # restarts within the cap: the same rollouts are read first again
        feed = start_learner(cfg)
        assert [x.rollout_id for x in feed.collect(1).rollouts] == ["t0-s0", "t0-s1"]
        feed.close()
    committed = Ledger()
    committed.record(1, ["t0-s1"])
    feed = start_learner(cfg, committed)  # the third restart: over the cap
    dead = read_dead_letters(feed.queue.client, feed.queue.keys.dead)
    assert [decode_rollout(d["data"]).rollout_id for d in dead] == ["t0-s0"]
    assert dead[0]["reason"] == ("rollout held across 3 learner starts without being committed "
                                 "(rollout.max_rollout_deliveries 2): it may crash the learner")
    for rid in ("t1-s0", "t1-s1"):
        feed.queue.client.xadd(feed.queue.keys.rollouts, {b"data": encode_rollout(make_rollout(rid, seed=3))})
    assert [x.rollout_id for x in feed.collect(2).rollouts] == ["t1-s0", "t1-s1"]
    assert read_counts(feed.queue.client, feed.queue.keys.counts) == {"dead_letter": 1, "duplicate": 1}  # t0-s1: committed
    feed.close()


# The worker: tasks and weights ----------------------------------------------------------------

class _Count:
    def __init__(self):
        self.n = 0

    def inc(self, by: int = 1):
        self.n += by

    def set(self, value):
        self.n = value

    def observe(self, value):
        self.n += 1


class _Metrics:  # the worker's Prometheus counters register globally; the book only counts
    def __init__(self):
        self.dead, self.reclaimed, self.reload_failures = _Count(), _Count(), _Count()
        self.version, self.reload_seconds = _Count(), _Count()


def test_forged_tasks_beyond_the_runs_bounds_are_dead_lettered(server, tmp_path):
    cfg = config(server, tmp_path, "qb-tasks")
    keys = Keys(cfg.queue.namespace)
    client = connect(server.url)
    tasks = StreamQueue(client, keys.tasks, GROUP_ROLLOUT, "worker-0", keys.dead)
    tasks.ensure_group()
    last = cfg.total_iterations(4)  # 12: train.iterations of configs/tiny.yaml
    forged = [
        pb.PromptTask(task_id="t1", task_seq=1, prompt_index=0, num_samples=4294967295).SerializeToString(),
        pb.PromptTask(task_id="t2", task_seq=2, prompt_index=0, num_samples=2,
                      min_policy_version=2**64 - 1).SerializeToString(),
        pb.PromptTask(task_id="t3", task_seq=3, prompt_index=0, num_samples=2,
                      min_policy_version=last + 1).SerializeToString(),
    ]
    honest = [encode_task(PromptTask(0, 1, 2, 0)), encode_task(PromptTask(4, 2, 2, last))]
    for data in [honest[0], *forged, honest[1]]:
        tasks.add(data)
    book = TaskBook(tasks, cfg, _Metrics(), "worker-0")
    work = asyncio.run(book.open(book.next_entries(10), num_prompts=4))
    assert [(t.task_id, t.num_samples, t.min_policy_version) for _, t in work] == [("t0", 2, 0), ("t4", 2, last)]
    reasons = [d["reason"] for d in read_dead_letters(client, keys.dead)]
    assert reasons == [
        "PromptTask 't1': num_samples 4294967295 is more than rollout.n_samples 2",
        f"PromptTask 't2': min_policy_version {2**64 - 1} is beyond the run's last policy version {last}",
        f"PromptTask 't3': min_policy_version {last + 1} is beyond the run's last policy version {last}",
    ]
    assert book.metrics.dead.n == 3 and sorted(book.held()) == sorted(eid for eid, _ in work)


class _ReadingSampler:
    """Reads announced weights as the transformers sampler does (verified, real file I/O)."""

    engine = "test"

    def __init__(self):
        self.loaded: list[int] = []

    def load_weights(self, pv: PolicyVersion) -> None:
        read_weights(pv)
        self.loaded.append(pv.version)


def _bounded(fn, *args):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=HANG_BOUND_S)


def test_forged_weights_announcements_are_refused_before_hashing(server, tmp_path):
    import torch

    cfg = config(server, tmp_path, "qb-weights")
    keys = Keys(cfg.queue.namespace)
    client = connect(server.url)
    torch.manual_seed(0)
    real = save_weights(torch.nn.Linear(4, 4), cfg.weights_dir, version=1, iteration=1)
    sampler = _ReadingSampler()
    tracker = VersionTracker(sampler, RunQueue(client, keys.ns), _Metrics(), mode="async", weights_poll_s=0.05,
                             stop=asyncio.Event(), weights_dir=cfg.weights_dir)
    announce(client, keys.policy, real)
    _bounded(tracker._maybe_reload)
    assert sampler.loaded == [1] and tracker.version == 1

    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(Path(real.uri).read_bytes())
    link = cfg.weights_dir / "v000003.safetensors"
    os.symlink("/dev/zero", link)
    zero_sha = hashlib.sha256(b"").hexdigest()
    for uri, sha, size in [("/dev/zero", zero_sha, 1 << 40), (str(outside), real.sha256, real.num_bytes),
                           (str(cfg.weights_dir / ".." / "elsewhere.safetensors"), real.sha256, real.num_bytes),
                           (str(link), zero_sha, 1 << 40)]:
        announce(client, keys.policy, PolicyVersion(2, uri, sha, size, 2))
        with pytest.raises(WeightsUnavailable, match="not inside the run's weights directory"):
            _bounded(tracker._maybe_reload)
    assert sampler.loaded == [1] and tracker.version == 1  # the worker keeps its weights

    # Without the directory check (verify_weights alone): the size is checked before any byte is hashed.
    with pytest.raises(WeightsUnavailable, match="/dev/zero .*not a regular file"):
        _bounded(verify_weights, PolicyVersion(2, "/dev/zero", zero_sha, 1 << 40, 2))
    grown = PolicyVersion(1, real.uri, real.sha256, real.num_bytes - 1, 1)
    with pytest.raises(WeightsUnavailable, match=f"{real.num_bytes} bytes, the announcement says {real.num_bytes - 1}"):
        _bounded(verify_weights, grown, cfg.weights_dir)
