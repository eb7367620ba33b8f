"""A plain reference for the teacher's statistics: full-vocabulary fp32 log-softmax, no chunking."""

from __future__ import annotations

import numpy as np
import torch


def reference_scores(model, token_ids: list[int], score_from: int, top_k: int, temperature: float = 1.0):
    """(token_logprobs [n], entropies [n], topk_ids [n, k], topk_logprobs [n, k]) as numpy, from
    model(input_ids).logits in float32 (model weights cast to float32 by the caller)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].double()  # [L, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(score_from - 1, len(token_ids) - 1)
    tgt = torch.tensor(token_ids[score_from:])
    lp = logp[pos, tgt]
    ent = -(logp[pos].exp() * logp[pos]).sum(-1)
    tv, ti = logp[pos].topk(top_k, dim=-1)
    return lp.numpy(), ent.numpy(), ti.numpy(), tv.numpy()


def assert_topk_match(ids_a: np.ndarray, lp_a: np.ndarray, ids_b: np.ndarray, lp_b: np.ndarray, atol: float = 1e-4) -> None:
    """Top-k ids equal except where the log-probs tie (within atol); log-probs equal to atol."""
    np.testing.assert_allclose(lp_a, lp_b, atol=atol, rtol=0)
    mismatch = ids_a != ids_b
    if mismatch.any():
        # A swapped pair must be a tie: the values at the mismatching slots agree within atol.
        assert np.all(np.abs(lp_a[mismatch] - lp_b[mismatch]) < atol), "top-k ids differ at non-tied positions"
