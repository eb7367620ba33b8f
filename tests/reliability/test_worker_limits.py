"""The rollout worker's limits, on a real redis-server and (for max_in_flight) the real teacher,
calling the worker's own code in this process instead of a full pipeline run:

    rollout.max_task_deliveries   a task delivered more often goes to the dead-letter stream
    queue.dead_letter_maxlen      the dead-letter stream stays bounded
    teacher.max_in_flight         unanswered requests on the worker's teacher stream
    teacher.retry_timeout_s       the teacher client's retry budget (then it gives up)
    teacher.ready_timeout_s       the wait for the teacher at start

and the worker loop's handling of poison tasks (dead-lettered with the reason, the run goes on).

One worker (tiny config, `RolloutWorker.setup()`, so the limits come from the config exactly as in
`eopd-rollout`) is shared by the module."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest
from eopd_trainer.config import load_config
from eopd_trainer.queue.messages import PromptTask, encode_task
from eopd_trainer.queue.streams import GROUP_ROLLOUT, Entry, StreamQueue, read_dead_letters
from eopd_trainer.rollout.worker import RolloutWorker

from tests.procs import free_port
from tests.trainer.pipeline_helpers import TINY
from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration

MAX_DELIVERIES = 3
DEAD_MAXLEN = 20
MAX_IN_FLIGHT = 2
CLAIM_IDLE_MS = 300


@contextlib.contextmanager
def make_worker(cfg, worker_id: str):
    """A RolloutWorker in this process. Its metrics live in prometheus_client's global registry, where
    the metrics of another worker would collide: those are set aside meanwhile and put back after."""
    from prometheus_client import REGISTRY

    def ours() -> list:
        return [c for c, names in list(REGISTRY._collector_to_names.items()) if any(n.startswith("eopd_rollout_") for n in names)]

    set_aside = ours()
    for c in set_aside:
        REGISTRY.unregister(c)
    w = RolloutWorker(cfg, worker_id)
    try:
        yield w
    finally:
        if getattr(w, "sampler", None) is not None:
            w.sampler.close()
        for c in ours():
            REGISTRY.unregister(c)
        for c in set_aside:
            REGISTRY.register(c)


@pytest.fixture(scope="module")
def worker(tiny_teacher, tmp_path_factory):
    with running_redis() as server:
        cfg = load_config(TINY, [
            f"run_dir={tmp_path_factory.mktemp('run')}", f"queue.redis_url={server.url}", "queue.namespace=limits",
            f"teacher.target={tiny_teacher.target}", f"rollout.max_task_deliveries={MAX_DELIVERIES}",
            f"rollout.claim_idle_ms={CLAIM_IDLE_MS}", f"queue.dead_letter_maxlen={DEAD_MAXLEN}",
            f"teacher.max_in_flight={MAX_IN_FLIGHT}", "teacher.sequences_per_request=1", "queue.block_ms=50",
        ])
        with make_worker(cfg, "w-live") as w:
            w.setup()
            yield w


def task(seq: int, num_samples: int = 2) -> bytes:
    return encode_task(PromptTask(task_seq=seq, prompt_index=seq % 32, num_samples=num_samples, min_policy_version=0))


def test_max_task_deliveries_dead_letters_with_reason(worker):
    """A task whose worker keeps dying before acknowledging it: it is delivered (first read, then
    reclaimed from the idle consumer by `TaskBook.next_entries`) up to max_task_deliveries times; the next
    reclaim moves it to the dead-letter stream with the reason instead of handing it out again."""
    w = worker
    assert w.cfg.rollout.max_task_deliveries == MAX_DELIVERIES
    data = task(1000)
    eid = w.tasks.add(data)
    crashed = StreamQueue(w.queue.client, w.queue.keys.tasks, GROUP_ROLLOUT, "w-crashed", w.queue.keys.dead)
    assert [e.entry_id for e in crashed.read_new(10, block_ms=None)] == [eid]  # delivery 1, never acknowledged
    for delivery in range(2, MAX_DELIVERIES + 1):
        time.sleep(CLAIM_IDLE_MS / 1000 + 0.1)  # idle long enough to be reclaimed
        got = w.book.next_entries(4)
        assert got == [Entry(eid, data)], delivery
        assert w.tasks.deliveries(eid) == delivery
        # ... and this worker dies too before acknowledging it: the entry stays pending.
    time.sleep(CLAIM_IDLE_MS / 1000 + 0.1)
    assert w.book.next_entries(4) == []  # delivery MAX_DELIVERIES + 1: dead-lettered, not handed out
    dead = [d for d in read_dead_letters(w.queue.client, w.queue.keys.dead) if d["entry_id"] == eid]
    assert len(dead) == 1
    assert dead[0]["reason"] == f"task delivered more than {MAX_DELIVERIES} times"
    assert dead[0]["source"] == w.queue.keys.tasks and dead[0]["data"] == data and dead[0]["consumer"] == "w-live"
    assert w.tasks.length() == 0 and w.tasks.pending_count() == 0  # gone from the stream and the pending list


def test_max_task_deliveries_applies_to_a_restarted_workers_own_tasks(worker):
    """A worker restarted under the same id (a Kubernetes pod name, `eopd run`'s w0) takes back its
    own unacknowledged tasks: those delivered more than max_task_deliveries times are dead-lettered
    with the reason instead of being handed out again; the others resume."""
    w = worker
    pid = w.tasks.add(task(2000))
    same = StreamQueue(w.queue.client, w.queue.keys.tasks, GROUP_ROLLOUT, w.worker_id, w.queue.keys.dead)
    assert [e.entry_id for e in same.read_new(10, block_ms=None)] == [pid]  # delivery 1
    for _ in range(MAX_DELIVERIES):  # the worker dies on it, restarts and takes it back, dies ...
        same.read_pending(100)
    assert w.tasks.deliveries(pid) > MAX_DELIVERIES
    fid = w.tasks.add(task(2001))
    assert [e.entry_id for e in same.read_new(10, block_ms=None)] == [fid]  # delivered once, then a restart
    w.book.resumed.clear()
    w.book.resume_pending()  # what setup() does after a restart (without loading the model again)
    resumed = [e.entry_id for e in w.book.resumed]
    w.book.resumed.clear()
    assert pid not in resumed and fid in resumed
    dead = [d for d in read_dead_letters(w.queue.client, w.queue.keys.dead) if d["entry_id"] == pid]
    assert len(dead) == 1 and dead[0]["reason"] == f"task delivered more than {MAX_DELIVERIES} times"
    w.tasks.ack([fid])


def test_dead_letter_maxlen_bounds_the_dead_letter_stream(worker):
    """Many poison tasks dead-lettered through the worker's queue (maxlen from the config): the
    dead-letter stream never holds more than dead_letter_maxlen plus one radix-tree node (Redis trims
    `MAXLEN ~` by whole nodes, `stream-node-max-entries`, 100 by default), and keeps the newest."""
    w = worker
    assert w.tasks.dead_maxlen == DEAD_MAXLEN
    node = int(w.queue.client.config_get("stream-node-max-entries")["stream-node-max-entries"])
    bound = DEAD_MAXLEN + node
    longest = 0
    total = 5 * bound
    for i in range(total):
        eid = w.tasks.add(b"poison %d" % i)
        w.tasks.dead_letter(Entry(eid, b"poison %d" % i), f"poison {i}")
        longest = max(longest, int(w.queue.client.xlen(w.queue.keys.dead)))
    assert longest <= bound, f"the dead-letter stream grew to {longest} (maxlen {DEAD_MAXLEN} ~, node size {node})"
    dead = read_dead_letters(w.queue.client, w.queue.keys.dead)
    assert DEAD_MAXLEN <= len(dead) <= bound
    assert dead[-1]["reason"] == f"poison {total - 1}" and dead[-1]["data"] == b"poison %d" % (total - 1)
    assert w.tasks.length() == 0


def test_teacher_max_in_flight_bounds_unanswered_requests(worker, monkeypatch):
    """The real worker loop (`RolloutWorker.run`: sample, score on teacher.streams ScoreStreams to the
    real teacher, publish) over 8 tasks x 2 samples, one sequence per request (16 requests): every
    time the worker's teacher client puts a request on the wire, the requests on the wire and not
    yet answered (built, not yet resolved, over all streams) are at most teacher.max_in_flight, and
    the bound is reached (pipelining)."""
    from eopd_teacher.client import stream as teacher_stream

    w = worker
    assert w.cfg.teacher.streams >= 2  # spread over several streams, bounded in total
    live = [0]
    outstanding: list[int] = []
    build, resolved = teacher_stream.build_request, teacher_stream._StreamRun._resolved

    def counting_build(*args, **kwargs):
        live[0] += 1
        outstanding.append(live[0])  # includes the request being put on the wire
        return build(*args, **kwargs)

    def counting_resolved(self, lane, rid):
        live[0] -= 1
        return resolved(self, lane, rid)

    monkeypatch.setattr(teacher_stream, "build_request", counting_build)
    monkeypatch.setattr(teacher_stream._StreamRun, "_resolved", counting_resolved)
    for seq in range(8):
        w.tasks.add(task(seq))
    w.queue.client.set(w.queue.keys.done, b"1")  # the worker stops once the tasks are done
    try:
        assert asyncio.run(asyncio.wait_for(w.run(), 300)) == 0
    finally:
        w.queue.client.delete(w.queue.keys.done)
    assert w.published == 16 and w.rollouts.length() == 16
    assert w.tasks.length() == 0 and w.tasks.pending_count() == 0  # every task acknowledged
    assert len(outstanding) == 16
    assert max(outstanding) == MAX_IN_FLIGHT, outstanding


def test_teacher_retry_timeout_gives_up(worker):
    """teacher.retry_timeout_s is the budget of the worker's teacher client (`AsyncTeacherClient`,
    made from the config as in `RolloutWorker.run`): with nothing listening, the worker's stream
    retries UNAVAILABLE with backoff and gives up with the status once the budget is spent."""
    from eopd_teacher.client import AsyncTeacherClient, ScoreBatch

    cfg = worker.cfg.teacher.model_copy(update={"target": f"127.0.0.1:{free_port()}", "retry_timeout_s": 2.0})

    async def go():
        async with AsyncTeacherClient(cfg.target, timeout=cfg.timeout_s, retry_timeout=cfg.retry_timeout_s) as client:
            async for _ in client.score_stream([ScoreBatch("r", [("s", [1, 2, 3], 1)])], max_in_flight=cfg.max_in_flight):
                pass

    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(go())
    elapsed = time.monotonic() - started
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert 1.5 <= elapsed < 10, elapsed


def test_teacher_ready_timeout_s_bounds_the_wait_at_start(worker):
    """teacher.ready_timeout_s: a worker whose teacher never comes up stops waiting after it."""
    cfg = worker.cfg.model_copy(update={"teacher": worker.cfg.teacher.model_copy(update={
        "target": f"127.0.0.1:{free_port()}", "ready_timeout_s": 1.0, "retry_timeout_s": 4.0})})
    with make_worker(cfg, "w-no-teacher") as w:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="not reachable"):
            asyncio.run(w.run())  # waits for the teacher before it needs anything setup() loads
        elapsed = time.monotonic() - started
    assert elapsed < 3, f"gave up after {elapsed:.1f}s with ready_timeout_s=1 (retry_timeout_s=4)"


def test_poison_tasks_are_dead_lettered_by_the_worker_loop(worker):
    """`RolloutWorker.run` on an undecodable task, a task naming a prompt that does not exist and a
    good task: the two poison tasks go to the dead-letter stream with their reasons (and leave the
    tasks stream), the good one is done, and the worker finishes normally."""
    w = worker
    before = w.published
    undecodable = b"\xff\xfe not a PromptTask"
    missing = encode_task(PromptTask(task_seq=2000, prompt_index=999, num_samples=2, min_policy_version=0))
    ids = {w.tasks.add(undecodable): "undecodable", w.tasks.add(missing): "missing", w.tasks.add(task(2001)): "good"}
    w.queue.client.set(w.queue.keys.done, b"1")
    try:
        assert asyncio.run(asyncio.wait_for(w.run(), 300)) == 0
    finally:
        w.queue.client.delete(w.queue.keys.done)
    dead = {d["entry_id"]: d for d in read_dead_letters(w.queue.client, w.queue.keys.dead) if d["entry_id"] in ids}
    assert {ids[i] for i in dead} == {"undecodable", "missing"}
    by_kind = {ids[i]: d for i, d in dead.items()}
    assert by_kind["undecodable"]["reason"].startswith("undecodable PromptTask"), by_kind["undecodable"]["reason"]
    assert by_kind["undecodable"]["data"] == undecodable
    assert by_kind["missing"]["reason"] == "PromptTask t2000: prompt_index 999 outside the 32 prompts"
    assert w.published - before == 2
    assert w.tasks.length() == 0 and w.tasks.pending_count() == 0


def test_unloadable_announced_weights_are_retried_not_fatal(worker, tmp_path):
    """The worker's reload (`VersionTracker.ensure`, as before every task batch) on announced files that
    cannot be loaded, fixed later: a missing file (sync mode: the worker waits, weights untouched,
    then loads it once it appears) and a file whose bytes do not match the announced sha256 (async
    mode: the worker keeps sampling with the version it holds, then loads the new one once fixed).
    The failures are counted; nothing raises."""
    import torch
    from eopd_trainer.queue.announce import announce
    from eopd_trainer.queue.weights import save_weights

    w = worker
    wdir = w.cfg.weights_dir  # announced files outside the run's weights directory are refused (test_queue_bounds.py)
    model = w.sampler.model
    original = {k: v.clone() for k, v in model.state_dict().items()}
    norm = "model.norm.weight"

    def publish(version: int, shift: float):
        with torch.no_grad():
            model.model.norm.weight.add_(shift)
        pv = save_weights(model, wdir, version=version, iteration=version)
        model.load_state_dict(original)  # the worker still holds the old weights
        return pv

    async def waits_then_loads(min_version: int, fix) -> bool:
        job = asyncio.ensure_future(w.versions.ensure(min_version))
        await asyncio.sleep(1.5)
        assert not job.done(), "versions.ensure returned before the file was fixed"
        assert torch.equal(model.state_dict()[norm], original[norm])  # untouched meanwhile
        fix()
        return await asyncio.wait_for(job, 30)

    failures = w.metrics.reload_failures._value.get
    saved_mode, before = w.versions.mode, failures()
    try:
        # 1. sync mode, the announced file is missing (pruned / not yet visible): wait, then load.
        pv1 = publish(1, 0.5)
        hidden = tmp_path / "elsewhere"
        (wdir / "v000001.safetensors").rename(hidden)
        announce(w.queue.client, w.queue.keys.policy, pv1)
        assert asyncio.run(waits_then_loads(1, lambda: hidden.rename(wdir / "v000001.safetensors")))
        assert w.versions.version == 1 and failures() - before >= 2  # retried (backoff), not given up
        torch.testing.assert_close(model.state_dict()[norm], original[norm] + 0.5)
        v1_norm = model.state_dict()[norm].clone()

        # 2. async mode, v2's bytes do not match its sha256: keep sampling with v1, load v2 once fixed.
        w.versions.mode = "async"  # the run's mode (cfg.mode), as setup() gives it
        model.load_state_dict({**original, norm: v1_norm})
        original = {k: v.clone() for k, v in model.state_dict().items()}
        pv2 = publish(2, 0.25)
        path = wdir / "v000002.safetensors"
        good = path.read_bytes()
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0xFF
        path.write_bytes(bytes(bad))
        announce(w.queue.client, w.queue.keys.policy, pv2)
        mid = failures()
        assert asyncio.run(asyncio.wait_for(w.versions.ensure(1), 10))  # v1 satisfies the tasks: no wait
        assert w.versions.version == 1 and failures() == mid + 1
        assert torch.equal(model.state_dict()[norm], v1_norm)
        path.write_bytes(good)
        assert asyncio.run(asyncio.wait_for(w.versions.ensure(2), 30))
        assert w.versions.version == 2
        torch.testing.assert_close(model.state_dict()[norm], v1_norm + 0.25)
    finally:
        w.versions.mode = saved_mode
        w.queue.client.delete(w.queue.keys.policy)


def test_a_request_the_teacher_rejects_dead_letters_only_its_task(worker, tmp_path):
    """A real teacher whose max_tokens_per_request (GetModelInfo) fits every sequence of the run
    but one: the long prompt's task. `RolloutWorker.run` over 6 tasks x 2 samples: the teacher
    rejects that sequence's requests (RESOURCE_EXHAUSTED, not retryable); the task goes to the
    dead-letter stream with the teacher's code and message naming both its rollouts, every other
    task is scored, published and acknowledged, and the worker finishes normally (returns 0)."""
    import json

    from eopd_trainer.data import render_prompt

    from tests.procs import running_teacher

    prompts = [f"What is {a} + {a + 3}?" for a in range(5)] + [" ".join(["Think about this long question."] * 40)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    d, ro = worker.cfg.data, worker.cfg.rollout
    lengths = [len(render_prompt(worker.tokenizer, p, suffix=d.suffix, chat_template=d.chat_template,
                                 max_length=d.max_prompt_length)) for p in prompts]
    limit = max(lengths[:-1]) + ro.max_response_length  # every short sequence fits, alone or not
    assert lengths[-1] + 1 > limit, lengths
    with running_teacher("tiny-random", "--max-batch-wait-ms", "20", "--max-tokens-per-request", str(limit)) as teacher:
        cfg = load_config(TINY, [
            f"run_dir={tmp_path / 'run'}", f"queue.redis_url={worker.cfg.queue.redis_url}", "queue.namespace=rejects",
            f"teacher.target={teacher.target}", f"data.train_files=[{data}]", "teacher.sequences_per_request=2",
            "queue.block_ms=50", "teacher.retry_timeout_s=20",
        ])
        with make_worker(cfg, "w-rejects") as w:
            w.setup()
            ids = {w.tasks.add(encode_task(PromptTask(task_seq=i, prompt_index=i, num_samples=2, min_policy_version=0))): i
                   for i in range(len(prompts))}
            w.queue.client.set(w.queue.keys.done, b"1")
            assert asyncio.run(asyncio.wait_for(w.run(), 300)) == 0
            dead = [x for x in read_dead_letters(w.queue.client, w.queue.keys.dead) if x["entry_id"] in ids]
            assert [ids[x["entry_id"]] for x in dead] == [5], dead
            reason = dead[0]["reason"]
            assert "t5-s0" in reason and "t5-s1" in reason and "not scored: teacher rejected request" in reason, reason
            assert "(RESOURCE_EXHAUSTED)" in reason and f"exceed the limit of {limit} per request" in reason, reason
            assert dead[0]["source"] == w.queue.keys.tasks
            assert w.published == 10 and w.rollouts.length() == 10
            assert w.tasks.length() == 0 and w.tasks.pending_count() == 0  # all acknowledged or dead-lettered
            assert w.metrics.unscored.labels("RESOURCE_EXHAUSTED")._value.get() == 2
