"""Generate's pure parts: sampling against a float64 reference, request validation, the batcher's
jobs beside scoring batches, the served bounds."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from eopd.v1 import teacher_pb2 as pb
from eopd_teacher.serving.batcher import DynamicBatcher, Overloaded
from eopd_teacher.convert import generation_from_pb, generation_to_pb
from eopd_teacher.engines.sampling import nucleus_probs, sample_next, sample_seed
from eopd_teacher.serving.service import generate_jobs, generate_tokens
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.serving.state import served_info
from eopd_teacher.serving.status import DeadlinePassed, status_of
from eopd_teacher.types import EngineInfo, Generation, GenerationCancelled, ModelInfo, ScoreItem, SequenceScores
from eopd_teacher.validation import GenerateNotServed, InvalidRequest, RequestTooLarge
from tests.teacher.wire import generate_items_from_request

INFO = ModelInfo("m", "r", vocab_size=100, max_context_length=50, dtype="float32", engine="transformers", default_top_k=16,
                 max_top_k=20, tokenizer_fingerprint="f", max_sequences_per_request=4, max_tokens_per_request=400,
                 max_new_tokens=30, max_generate_samples=4)


def _nucleus_reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """float64, one row at a time: the smallest prefix of the descending order whose mass reaches top_p."""
    out = np.zeros_like(logits, dtype=np.float64)
    for b, row in enumerate(logits.astype(np.float64)):
        p = np.exp(row / temperature - (row / temperature).max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += p[i]
            if mass >= top_p:
                break
        out[b, kept] = p[kept] / p[kept].sum()
    return out


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (2.0, 0.5), (1.0, 1e-3)])
def test_nucleus_probs_match_reference(temperature, top_p):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    got = nucleus_probs(logits, temperature, top_p)
    assert got.shape == (5, 300) and got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), _nucleus_reference(logits.numpy(), temperature, top_p), atol=1e-6)


def test_sample_next_greedy_and_per_row_generators():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    assert sample_next(logits, 0.0, 1.0, None).tolist() == logits.argmax(-1).tolist()
    gens = lambda: [torch.Generator().manual_seed(sample_seed(9, 0, j)) for j in range(4)]  # noqa: E731
    a = sample_next(logits, 1.0, 1.0, gens())
    # Row 2 alone, with its own generator, draws what it drew beside the others.
    assert sample_next(logits[2:3], 1.0, 1.0, gens()[2:3]).tolist() == a[2:3].tolist()
    assert a.dtype == torch.int64 and a.shape == (4,)
    # Draws follow the distribution: 4000 draws of one row against its probabilities.
    g = torch.Generator().manual_seed(3)
    probs = nucleus_probs(logits[:1], 1.0, 0.8)[0]
    draws = torch.cat([sample_next(logits[:1], 1.0, 0.8, [g]) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=50).double() / 4000
    assert set(draws.tolist()) <= set(torch.nonzero(probs).ravel().tolist())
    assert (freq - probs.double()).abs().max() < 0.03


def test_sample_seed():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3) and 0 <= sample_seed(1, 2, 3) < 2**63
    assert len({sample_seed(1, 2, 3), sample_seed(1, 3, 2), sample_seed(2, 2, 3), sample_seed(1, 2, 4)}) == 4
    assert sample_seed(None, 0, 0) != sample_seed(None, 0, 0)


def _req(**kw) -> pb.GenerateRequest:
    prompts = kw.pop("prompts", [pb.Prompt(id="p", token_ids=[1, 2, 3])])
    return pb.GenerateRequest(prompts=prompts, **({"request_id": "r", "max_new_tokens": 5} | kw))


def test_valid_request_defaults_and_fields():
    (item,) = generate_items_from_request(_req(), INFO)
    assert (item.num_samples, item.temperature, item.top_p, item.top_k, item.score_temperature, item.seed) == (1, 0.0, 1.0, 16, 1.0, None)
    items = generate_items_from_request(_req(prompts=[pb.Prompt(id="a", token_ids=[1]), pb.Prompt(id="b", token_ids=[2, 3])],
                                             num_samples=3, temperature=0.5, top_p=0.9, top_k=4, score_temperature=2.0, seed=0,
                                             stop_token_ids=[7, 7, 8]), INFO)
    assert [(it.prompt_id, it.index, it.token_ids.tolist()) for it in items] == [("a", 0, [1]), ("b", 1, [2, 3])]
    it = items[1]
    assert (it.num_samples, it.temperature, it.top_p, it.top_k, it.score_temperature, it.seed, it.stop_token_ids) == \
           (3, 0.5, pytest.approx(0.9), 4, 2.0, 0, (7, 8))


@pytest.mark.parametrize("request_, error, match", [
    (_req(prompts=[pb.Prompt(id="p", token_ids=[1] * 46)]), InvalidRequest, r"prompts\[0\]\.token_ids: 46 prompt tokens \+ max_new_tokens 5 exceed"),
    (_req(prompts=[pb.Prompt(id=str(i), token_ids=[1]) for i in range(5)]), RequestTooLarge, r"^prompts: 5 prompts exceed the limit of 4"),
    (_req(prompts=[pb.Prompt(id=str(i), token_ids=[1] * 40) for i in range(3)], max_new_tokens=10, num_samples=4), RequestTooLarge,
     r"^prompts: \(prompt tokens \+ max_new_tokens 10\) x num_samples 4 = 600 tokens exceed the limit of 400"),
    (_req(max_new_tokens=31), InvalidRequest, r"^max_new_tokens: 31 exceeds"),
    (_req(num_samples=5), InvalidRequest, r"^num_samples: 5 exceeds the server's maximum 4"),
    (_req(temperature=float("inf")), InvalidRequest, r"^temperature: inf"),
    (_req(top_p=float("nan")), InvalidRequest, r"^top_p: nan"),
    (_req(stop_token_ids=[100]), InvalidRequest, r"^stop_token_ids\[0\]: token id 100 is outside the vocabulary \[0, 100\)"),
    (_req(score_temperature=float("nan")), InvalidRequest, r"^score_temperature: nan"),
    (_req(request_id="x" * 257), InvalidRequest, r"^request_id: longer than 256"),
    (_req(prompts=[pb.Prompt(id="x" * 257, token_ids=[1])]), InvalidRequest, r"prompts\[0\]\.id: longer than 256"),
])
def test_invalid_requests(request_, error, match):
    with pytest.raises(error, match=match):
        generate_items_from_request(request_, INFO)


def test_answer_size_bound_and_not_served():
    with pytest.raises(RequestTooLarge, match=r"^max_new_tokens: 30 positions at top_k 20 make an answer of up to \d+ bytes"):
        generate_items_from_request(_req(max_new_tokens=30, top_k=20), INFO, max_response_bytes=4096)
    assert generate_items_from_request(_req(max_new_tokens=30, top_k=20), INFO, max_response_bytes=1 << 20)
    with pytest.raises(GenerateNotServed, match="not served"):
        generate_items_from_request(_req(), ModelInfo(**(INFO.__dict__ | {"max_new_tokens": 0})))


def test_generate_statuses():
    assert status_of(GenerateNotServed("x")) == grpc.StatusCode.UNIMPLEMENTED
    assert status_of(DeadlinePassed("x")) == status_of(GenerationCancelled("x")) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_generation_round_trip():
    s = SequenceScores("p", np.array([-0.5, -1.0], np.float32), np.array([1.0, 2.0], np.float32),
                       np.array([[3, 4], [5, 6]], np.int32), np.array([[-0.1, -2.0], [-0.3, -1.5]], np.float32))
    back = generation_from_pb(generation_to_pb("r", Generation("p", 1, np.array([7, 8]), "stop", s)))
    assert (back.prompt_id, back.sample_index, back.token_ids.tolist(), back.finish_reason) == ("p", 1, [7, 8], "stop")
    np.testing.assert_array_equal(back.scores.topk_ids, s.topk_ids) and np.testing.assert_array_equal(back.scores.entropies, s.entropies)
    assert back.scores.candidate_logprobs is None


def test_generate_jobs_split_by_tokens():
    items = generate_items_from_request(_req(prompts=[pb.Prompt(id=str(i), token_ids=[1] * (i + 1)) for i in range(4)],
                                             num_samples=2), INFO)
    assert [generate_tokens(it) for it in items] == [12, 14, 16, 18]
    assert [[it.prompt_id for it in job] for job in generate_jobs(items, 30)] == [["0", "1"], ["2"], ["3"]]
    assert [[it.prompt_id for it in job] for job in generate_jobs(items, 1)] == [["0"], ["1"], ["2"], ["3"]]


def test_served_info_generate_bounds():
    engine = EngineInfo("m", "r", 100, 50, "float32", "transformers", "f")
    settings = TeacherSettings(max_new_tokens=100, max_generate_samples=3)
    assert (served_info(engine, settings).max_new_tokens, served_info(engine, settings).max_generate_samples) == (0, 0)
    info = served_info(engine, settings, can_generate=True)
    assert (info.max_new_tokens, info.max_generate_samples) == (49, 3)


def test_batcher_jobs_take_turns_with_scoring_and_never_overlap():
    """Jobs and scoring batches share the one worker thread (never two at once) and alternate
    when both wait; a job withdrawn before it starts never runs; jobs count against the queue."""
    events: list[str] = []
    running = threading.Lock()

    def engine_step(name: str, seconds: float = 0.02):
        assert running.acquire(blocking=False), "two engine calls at once"
        try:
            events.append(name)
            time.sleep(seconds)
        finally:
            running.release()

    def score(items):
        engine_step("score")
        return [it.seq_id for it in items]

    async def run():
        b = DynamicBatcher(score, max_batch_tokens=4, max_wait_s=0.0, max_queue_tokens=100)
        b.start()
        item = lambda i: ScoreItem(f"s{i}", np.arange(4), 1, 1, 1.0)  # noqa: E731 - one per batch
        scores = [asyncio.ensure_future(b.submit([item(i)], "c")) for i in range(3)]
        jobs = [asyncio.ensure_future(b.submit_job(lambda i=i: engine_step(f"job{i}") or i, 10)) for i in range(3)]
        withdrawn = asyncio.ensure_future(b.submit_job(lambda: engine_step("withdrawn"), 10))
        await asyncio.sleep(0)
        withdrawn.cancel()
        assert await asyncio.gather(*jobs) == [0, 1, 2]
        assert [r[0] for r in await asyncio.gather(*scores)] == ["s0", "s1", "s2"]
        running_job = asyncio.ensure_future(b.submit_job(lambda: engine_step("slow", 0.3), 60))
        await asyncio.sleep(0.05)  # started: no longer waiting
        waiting_job = asyncio.ensure_future(b.submit_job(lambda: None, 60))
        await asyncio.sleep(0)
        assert b.queued_tokens == 60
        with pytest.raises(Overloaded, match="60 tokens waiting, request adds 60, limit 100"):
            await b.submit_job(lambda: None, 60)
        await running_job
        await waiting_job
        await b.close()

    asyncio.run(run())
    assert "withdrawn" not in events
    first = events[:6]
    assert sorted(first) == ["job0", "job1", "job2", "score", "score", "score"]
    assert all(a != b for a, b in zip(first, first[1:])), f"jobs and batches alternate: {first}"


def test_stepped_job_takes_turns_with_scoring_and_is_closed_when_its_caller_goes():
    """A stepped job (`submit_job(..., steps=True)`, the engine's `generate_steps`) runs one step per
    turn: a scoring batch submitted while it runs goes between two of its steps, not after it; a
    stepped job whose caller is cancelled is closed at its next turn (its state freed), and the
    queue is free again."""
    events: list[str] = []
    closed: list[str] = []

    def steps(name: str, n: int):
        try:
            for i in range(n):
                time.sleep(0.01)
                events.append(f"{name}{i}")
                yield None
            yield name
        finally:
            closed.append(name)

    def score(items):
        events.append("score")
        return [it.seq_id for it in items]

    async def run():
        b = DynamicBatcher(score, max_batch_tokens=4, max_wait_s=0.0, max_queue_tokens=100)
        b.start()
        job = asyncio.ensure_future(b.submit_job(lambda: steps("g", 30), 10, steps=True))
        while "g2" not in events:
            await asyncio.sleep(0.005)
        assert await b.submit([ScoreItem("s", np.arange(4), 1, 1, 1.0)], "other") == ["s"]
        assert await job == "g"
        abandoned = asyncio.ensure_future(b.submit_job(lambda: steps("a", 10_000), 10, steps=True))
        while "a2" not in events:
            await asyncio.sleep(0.005)
        abandoned.cancel()
        while "a" not in closed:
            await asyncio.sleep(0.005)
        assert b.idle and b.queued_tokens == 0
        await b.close()

    asyncio.run(run())
    assert events.index("score") < events.index("g29"), "the scoring batch waited for the whole job"
    assert closed == ["g", "a"] and len([e for e in events if e.startswith("a")]) < 10_000
