"""bench/bench_hidden_precision.py: the per-token comparison against a naive reference and autograd
(pure tensors), and its quick mode end to end (tiny-random models, the real prepare, sampler and
teacher engine)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench.bench_hidden_precision import main, summarise, token_comparison


def _logits(n=5, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(n, v, generator=g)


def test_token_comparison_matches_a_naive_reference_and_autograd():
    q, p32 = _logits(seed=0), _logits(seed=1)
    p16 = p32 + 0.05 * _logits(seed=2)
    tokens = torch.tensor([0, 3, 10, 4, 7])
    got = token_comparison(q, p32, p16, tokens)
    for i in range(q.shape[0]):
        lq, l32, l16 = (torch.log_softmax(x[i].double(), -1).tolist() for x in (q, p32, p16))
        kl = sum(math.exp(a) * (a - b) for a, b in zip(l32, l16))
        rkl16 = sum(math.exp(a) * (a - b) for a, b in zip(lq, l16))
        assert got["kl_32_16"][i].item() == pytest.approx(kl, rel=1e-9, abs=1e-12)
        assert got["rkl16"][i].item() == pytest.approx(rkl16, rel=1e-9)
        assert got["dlogp"][i].item() == pytest.approx(abs(l16[tokens[i]] - l32[tokens[i]]), abs=1e-12)
    z = q.double().clone().requires_grad_(True)
    lz = torch.log_softmax(z, -1)
    (lz.exp() * (lz - torch.log_softmax(p16.double(), -1))).sum().backward()
    torch.testing.assert_close(got["grad16"], z.grad)


def test_the_same_distribution_changes_nothing():
    q, p = _logits(seed=3), _logits(seed=4)
    s = summarise([token_comparison(q, p, p.clone(), torch.zeros(5, dtype=torch.long))])
    assert s["tokens"] == 5 and s["dlogp_max"] == 0 and s["kl_32_16_max"] == 0
    assert s["grad_rel_diff"] == 0 and s["grad_cosine"] == pytest.approx(1.0)


@pytest.mark.integration
def test_quick_mode_scores_real_samples_both_ways(tmp_path):
    out = tmp_path / "hp.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["problems"] == 4 and data["samples"] > 0 and data["tokens"] > 0
    assert 0 < data["dlogp_max"] < 0.1  # bf16's 8-bit mantissa: |z| 2^-9 a logit (docs/teacher.md)
    assert 0 <= data["kl_32_16_mean"] <= data["kl_32_16_max"] < 1e-2
    assert 0.99 < data["grad_cosine"] <= 1.0 + 1e-9
