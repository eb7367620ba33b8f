"""The pure statistics core against a plain full-vocabulary reference."""

from __future__ import annotations

import pytest
import torch

from eopd_teacher.stats import compiled_chunk_stats, eager_chunk_stats, token_statistics


def _reference(h, w, b, targets, inv_t, k):
    logits = (h.double() @ w.double().T + (0 if b is None else b.double())) * inv_t.double()[:, None]
    logp = torch.log_softmax(logits, -1)
    tv, ti = logp.topk(k, -1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1), ti, tv


@pytest.fixture(scope="module")
def problem():
    g = torch.Generator().manual_seed(0)
    n, d, v = 37, 24, 503
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.7
    b = torch.randn(v, generator=g) * 0.1
    targets = torch.randint(0, v, (n,), generator=g)
    inv_t = 1.0 / torch.empty(n).uniform_(0.3, 2.0, generator=g)
    return h, w, b, targets, inv_t


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
@pytest.mark.parametrize("use_bias", [False, True])
def test_matches_reference_fp32(problem, chunk, use_bias):
    h, w, b, targets, inv_t = problem
    b = b if use_bias else None
    out = token_statistics(h, w, targets, inv_t, 7, bias=b, chunk_size=chunk)
    lp, ent, ti, tv = _reference(h, w, b, targets, inv_t, 7)
    torch.testing.assert_close(out.token_logprobs.double(), lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies.double(), ent, atol=1e-4, rtol=0)
    assert torch.equal(out.topk_ids, ti)
    torch.testing.assert_close(out.topk_logprobs.double(), tv, atol=1e-4, rtol=0)
    assert out.token_logprobs.dtype == torch.float32 and out.topk_ids.shape == (h.shape[0], 7)


def test_compiled_equals_eager(problem):
    h, w, _, targets, inv_t = problem
    a = token_statistics(h, w, targets, inv_t, 4, chunk_size=16, stats_fn=eager_chunk_stats())
    c = token_statistics(h, w, targets, inv_t, 4, chunk_size=16, stats_fn=compiled_chunk_stats())
    torch.testing.assert_close(a.token_logprobs, c.token_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.entropies, c.entropies, atol=1e-5, rtol=0)
    assert torch.equal(a.topk_ids, c.topk_ids)


def test_bf16_weights_give_fp32_statistics_of_the_bf16_logits(problem):
    h, w, _, targets, inv_t = problem
    hb, wb = h.bfloat16(), w.bfloat16()
    out = token_statistics(hb, wb, targets, inv_t, 5)
    assert out.entropies.dtype == torch.float32
    # The reference sees exactly the logits the bf16 projection produced, upcast.
    logits = torch.nn.functional.linear(hb, wb).double() * inv_t.double()[:, None]
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.token_logprobs.double(), logp.gather(1, targets[:, None]).squeeze(1), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies.double(), -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=0)
    # fp32 projection of bf16 weights: the statistics of the fp32 logits instead.
    out32 = token_statistics(hb, wb, targets, inv_t, 5, projection_dtype=torch.float32)
    lp, ent, _, _ = _reference(hb.float(), wb.float(), None, targets, inv_t, 5)
    torch.testing.assert_close(out32.entropies.double(), ent, atol=1e-4, rtol=0)


def test_entropy_is_exact_not_topk_estimate():
    # A flat distribution over V has entropy log V; a top-k estimate would give at most log k.
    v = 1000
    out = token_statistics(torch.zeros(1, 4), torch.zeros(v, 4), torch.tensor([3]), torch.ones(1), 16)
    assert abs(out.entropies.item() - torch.log(torch.tensor(float(v))).item()) < 1e-4
    assert abs(out.token_logprobs.item() + torch.log(torch.tensor(float(v))).item()) < 1e-4


def test_masked_vocabulary_entries_do_not_poison_entropy():
    w = torch.eye(4)
    b = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")])
    out = token_statistics(torch.zeros(1, 4), w, torch.tensor([0]), torch.ones(1), 2, bias=b)
    assert torch.isfinite(out.entropies).all()
    assert abs(out.entropies.item() - torch.log(torch.tensor(2.0)).item()) < 1e-6


def test_rejects_bad_shapes_and_k():
    h, w = torch.zeros(3, 4), torch.zeros(10, 4)
    with pytest.raises(ValueError, match="top_k"):
        token_statistics(h, w, torch.zeros(3, dtype=torch.long), torch.ones(3), 11)
    with pytest.raises(ValueError, match="must be"):
        token_statistics(h, w, torch.zeros(2, dtype=torch.long), torch.ones(3), 2)
