"""Batched generation on the transformers engine (`engines/batched_generation.py`): the prompts and
samples of one call decoded together give what one prompt at a time gave (greedy: identical ids in
fp32; seeded: the same draws), rows stop on their own, the statistics are Score's, the steps are
bounded and a cancelled or closed generation stops at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eopd_teacher.engines.sampling import sample_next, sample_seed
from eopd_teacher.engines.transformers_engine import TransformersEngine
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.types import GenerateItem, GenerationCancelled, ScoreItem

PROMPTS = [[1, 5, 7, 9, 11], [3, 4], list(range(100, 140)), [42]]


def _engine(model: str, **kw) -> TransformersEngine:
    eng = TransformersEngine(TeacherSettings(model=model, chunk_size=7, compile_statistics=False, **kw).engine_settings())
    eng.load()
    return eng


@pytest.fixture(scope="module")
def tiny():
    # Small prefill chunks and a 1 ms decode budget: every path of the steps is taken.
    eng = _engine("tiny-random", prefill_chunk_tokens=24, generate_step_ms=1.0)
    yield eng
    eng.shutdown()


def _item(i: int, prompt, **kw) -> GenerateItem:
    d = dict(num_samples=1, max_new_tokens=8, temperature=0.0, top_p=1.0, stop_token_ids=(), seed=None, top_k=4,
             score_temperature=1.0, index=i)
    return GenerateItem(f"p{i}", np.asarray(prompt, dtype=np.int64), **(d | kw))


@torch.inference_mode()
def _one_at_a_time(eng: TransformersEngine, item: GenerateItem) -> list[list[int]]:
    """The engine's generation before batching (one prompt, its samples together, no padding), as
    a reference: one prefill, the cache repeated per sample, one decode step per token."""
    model, rows = eng._lm.model, item.num_samples
    gens = [torch.Generator().manual_seed(sample_seed(item.seed, item.index, j)) for j in range(rows)] if item.temperature > 0 else None
    stop = torch.tensor(sorted(eng._eos_ids | set(item.stop_token_ids)))
    out = model(input_ids=torch.from_numpy(item.token_ids).view(1, -1), use_cache=True, logits_to_keep=1)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    key = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
    if rows > 1:
        cache.batch_repeat_interleave(rows)
    logits = out.logits[:, -1].expand(rows, -1)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    stopped = torch.zeros(rows, dtype=torch.bool)
    for t in range(item.max_new_tokens):
        nxt = sample_next(logits, item.temperature, item.top_p, gens)
        for j in range(rows):
            if not stopped[j]:
                tokens[j].append(int(nxt[j]))
        stopped |= torch.isin(nxt, stop)
        if bool(stopped.all()) or t + 1 == item.max_new_tokens:
            break
        out = model(input_ids=nxt.view(rows, 1), use_cache=True, logits_to_keep=1, **{key: cache})
        logits = out.logits[:, -1]
    return tokens


def _ids(gens) -> list[list[int]]:
    return [g.token_ids.tolist() for g in gens]


def test_greedy_batched_equals_one_at_a_time(tiny):
    items = [_item(i, p, num_samples=2 if i == 1 else 1) for i, p in enumerate(PROMPTS)]
    batched = tiny.generate(items)
    assert [(g.prompt_id, g.sample_index) for g in batched] == [(it.prompt_id, j) for it in items for j in range(it.num_samples)]
    assert _ids(batched) == [ids for it in items for ids in _one_at_a_time(tiny, it)]
    assert all(g.finish_reason == "length" and len(g.token_ids) == 8 for g in batched)


def test_seeded_samples_do_not_depend_on_the_batch(tiny):
    """Each row draws from its own generator at its own temperature and top-p: a prompt's samples
    are those it draws alone and those of the unbatched engine; rows of other kinds (greedy, other
    temperatures) beside them change nothing."""
    items = [_item(0, PROMPTS[0], num_samples=3, temperature=1.0, seed=11),
             _item(1, PROMPTS[1], num_samples=2, temperature=0.7, top_p=0.9, seed=11),
             _item(2, PROMPTS[2], num_samples=1),
             _item(3, PROMPTS[3], num_samples=2, temperature=1.3, seed=5, max_new_tokens=7)]
    batched = tiny.generate(items)
    assert _ids(batched) == _ids(tiny.generate(items)), "the same request gives the same tokens"
    assert _ids(batched) == [ids for it in items for ids in _one_at_a_time(tiny, it)]
    for it in items:
        assert _ids(tiny.generate([it])) == [g.token_ids.tolist() for g in batched if g.prompt_id == it.prompt_id]
    assert len({tuple(ids) for ids in _ids(batched[:3])}) == 3, "samples of one prompt are drawn independently"


def test_rows_stop_on_their_own(tiny):
    """Per-row stop ids and max_new_tokens: a row ends at its own stop id (kept) or limit while the
    others go on; the stop of one row does not stop another."""
    (alone,) = _one_at_a_time(tiny, _item(0, PROMPTS[0]))
    stop_id = alone[3]
    assert stop_id not in alone[:3]
    items = [_item(0, PROMPTS[0], stop_token_ids=(stop_id,)), _item(1, PROMPTS[1], max_new_tokens=2),
             _item(2, PROMPTS[2], max_new_tokens=9), _item(3, PROMPTS[3], num_samples=2, temperature=1.0, seed=3,
                                                        max_new_tokens=5)]
    gens = tiny.generate(items)
    assert gens[0].token_ids.tolist() == alone[:4] and gens[0].finish_reason == "stop"
    assert [len(g.token_ids) for g in gens[1:]] == [2, 9, 5, 5]
    assert all(g.finish_reason == "length" for g in gens[1:])
    assert _ids(gens[1:]) == [ids for it in items[1:] for ids in _one_at_a_time(tiny, it)]


def test_statistics_are_those_of_a_direct_score(tiny):
    items = [_item(i, p, num_samples=2, temperature=1.0, seed=7, top_k=5, score_temperature=1.5) for i, p in enumerate(PROMPTS)]
    for g, it in zip(tiny.generate(items), [it for it in items for _ in range(2)]):
        (s,) = tiny.score([ScoreItem("x", np.concatenate([it.token_ids, g.token_ids]), len(it.token_ids), 5, 1.5)])
        assert g.scores.token_logprobs.shape == (len(g.token_ids),) and g.scores.seq_id == it.prompt_id
        np.testing.assert_allclose(g.scores.token_logprobs, s.token_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(g.scores.entropies, s.entropies, atol=1e-4, rtol=0)
        np.testing.assert_allclose(g.scores.topk_logprobs, s.topk_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_array_equal(g.scores.topk_ids, s.topk_ids)


def test_steps_are_bounded_and_give_the_same_answer(tiny):
    """With a 1 ms decode budget and 24-token prefill chunks, a generation takes many steps (None
    between them), and its answer is that of one uninterrupted run."""
    items = [_item(i, p, num_samples=2, temperature=0.8, seed=2, max_new_tokens=16) for i, p in enumerate(PROMPTS)]
    outs = list(tiny.generate_steps(items))
    assert all(o is None for o in outs[:-1]) and len(outs) > 5
    assert _ids(outs[-1]) == [ids for it in items for ids in _one_at_a_time(tiny, it)]


def test_cancellation_mid_batch_stops_at_once(tiny):
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) > 5

    items = [_item(i, p, num_samples=3, max_new_tokens=100) for i, p in enumerate(PROMPTS)]
    with pytest.raises(GenerationCancelled, match="stopped after 5 tokens: its caller went away"):
        tiny.generate(items, cancelled=cancelled)
    assert len(polls) == 6
    # A stepped generation closed between two steps (its caller went away) frees the engine.
    steps = tiny.generate_steps(items)
    assert next(steps) is None
    steps.close()
    short = _item(0, PROMPTS[0], max_new_tokens=3)
    assert _ids(tiny.generate([short])) == _one_at_a_time(tiny, short)
