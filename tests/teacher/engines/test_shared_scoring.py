"""The transformers engine's shared prefill (`share_prefill`, `eopd_common.shared_prefill`): a batch
whose sequences share a chat template and repeat each prompt for two responses scores as without
sharing, in float32, on tiny-random and SmolLM2-135M: top-k ids equal, log-probs, entropies,
candidates and hidden states within max(1e-5, 3 x the unshared pass's own batch noise) (the CPU
kernels' reduction order, as tests/teacher/engines/test_chunked_prefill.py); with a chunked-prefill
step size the batch runs as groups whose shared work fits a step each, with the same numbers."""

from __future__ import annotations

import numpy as np
import pytest

from eopd_common.shared_prefill import work_tokens
from eopd_teacher.engines.transformers_engine import TransformersEngine
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.types import ScoreItem

ATOL = 1e-5


def _engine(model: str, share: bool, chunk_tokens: int = 0) -> TransformersEngine:
    eng = TransformersEngine(TeacherSettings(model=model, dtype="float32", compile_statistics=False, chunk_size=7,
                                             prefill_chunk_tokens=chunk_tokens, share_prefill=share).engine_settings())
    eng.load()
    return eng


def _items(vocab: int, questions: int = 3) -> list[ScoreItem]:
    """A 20-token template, `questions` prompts of ragged length, two responses each (ragged), mixed
    top-k, temperatures, candidates and hidden states."""
    rng = np.random.default_rng(5)
    template = rng.integers(3, vocab, 20)
    out = []
    for q in range(questions):
        prompt = np.concatenate([template, rng.integers(3, vocab, 3 + 4 * q)])
        for sample in range(2):
            response = rng.integers(3, vocab, 4 + 5 * sample + q)
            ids = np.concatenate([prompt, response]).astype(np.int64)
            cand = rng.integers(-1, vocab, (len(response), 3)).astype(np.int64) if q == 1 else None
            out.append(ScoreItem(f"q{q}s{sample}", ids, len(prompt), (16, 3, 8)[q], (1.0, 0.7, 1.3)[sample],
                                 cand, hidden_dtype="float32" if sample else ""))
    return out


def _check_equal(got, want, tol):
    for a, b in zip(want, got, strict=True):
        assert a.seq_id == b.seq_id
        np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
        for field in ("token_logprobs", "entropies", "topk_logprobs"):
            np.testing.assert_allclose(getattr(b, field), getattr(a, field), atol=tol, rtol=0, err_msg=field)
        if a.candidate_logprobs is None:
            assert b.candidate_logprobs is None
        else:
            np.testing.assert_allclose(b.candidate_logprobs, a.candidate_logprobs, atol=tol, rtol=0, equal_nan=True)
        assert (a.hidden_states is None) == (b.hidden_states is None)
        if a.hidden_states is not None:
            np.testing.assert_allclose(np.frombuffer(b.hidden_states, np.float32),
                                       np.frombuffer(a.hidden_states, np.float32), atol=10 * tol, rtol=1e-5)


@pytest.mark.parametrize("model", ["tiny-random", "smollm2-135m"])
def test_shared_scoring_equals_unshared(model):
    plain, shared = _engine(model, share=False), _engine(model, share=True)
    items = _items(plain.info.vocab_size)
    want = plain.score(items)
    noise = max(float(np.abs(alone.token_logprobs - a.token_logprobs).max())
                for a, alone in zip(want, (plain.score([it])[0] for it in items)))
    tol = ATOL if model == "tiny-random" else max(ATOL, 3 * noise)
    print(f"{model}: unshared alone vs batch {noise:.2e}, tolerance {tol:.2e}")
    assert shared._share_groups(items) == [list(range(len(items)))]  # the shared path, one group
    _check_equal(shared.score(items), want, tol)


def test_chunked_prefill_steps_are_groups_sharing_their_tokens():
    """With a step size, the batch runs as consecutive groups whose shared work fits a step each: one
    step when the whole batch's fits, several below it; the plain chunked steps when one item alone
    exceeds a step. The same numbers every way."""
    items = _items(1000)
    prompts = [it.token_ids[: it.score_from].tolist() for it in items]
    responses = [it.token_ids[it.score_from :].tolist() for it in items]
    plain_tokens, shared_tokens = work_tokens(prompts, responses)
    assert shared_tokens < plain_tokens
    largest_alone = max(work_tokens([p], [r])[1] for p, r in zip(prompts, responses))
    want = _engine("tiny-random", share=False).score(items)
    for chunk, steps_wanted in ((shared_tokens, 1), (largest_alone + 20, "several"), (largest_alone - 1, None)):
        eng = _engine("tiny-random", share=True, chunk_tokens=chunk)
        groups = eng._share_groups(items)
        steps, out = 0, None
        for out in eng.score_steps(items):
            steps += 1
        if steps_wanted is None:  # the plain pass's chunked steps
            assert groups is None and steps > 1
        else:
            assert steps == len(groups) and [i for g in groups for i in g] == list(range(len(items)))
            assert steps == 1 if steps_wanted == 1 else 1 < steps < len(items)  # groups, not one item a step
        _check_equal(out, want, ATOL)
