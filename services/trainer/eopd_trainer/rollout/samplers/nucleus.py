"""Temperature and top-p (nucleus) filtering for `generate`, without sorting the vocabulary.

transformers' `TopPLogitsWarper` sorts all V logits of every row at every step (49k for SmolLM2:
~70 ms of a 32-row decode step of ~300 ms on a 2-core CPU). The nucleus is short (a few tokens to a
few hundred), so `Nucleus` takes the top `k` probabilities instead (`k` grown x4 until they hold
more than `top_p`), and keeps exactly the tokens transformers keeps: a token is dropped when the
tokens more probable than it already hold `top_p` of the mass (transformers: when the ascending
cumulative mass up to and including it is <= 1 - top_p, the same condition), the most probable one
always kept. The scores passed on are transformers' (scores / temperature, -inf where dropped), so
`generate` samples the same tokens from the same random numbers. The two can differ only where a
token's mass before it is within float rounding of `top_p`: transformers sums the whole sorted
vocabulary in fp32 (errors ~1e-6 to 1e-5 on flat rows), this the few candidates (tests: every
token kept differently lies within 1e-5 of the boundary).

Use: `generate(..., temperature=1.0, top_p=1.0, logits_processor=[..., Nucleus(T, p)])` (transformers then
adds no warper of its own; processors given run before its warpers, after any recorder of raw logits).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

FIRST_K = 64  # candidates tried first; most rows' nucleus at top-p 0.8 fits well inside
MARGIN = 1e-4  # the top-k mass must exceed top_p by this much: the boundary is never at the cut


class Nucleus(LogitsProcessor):
    """scores `[B, V]` -> scores / `temperature`, with -inf outside each row's top-`top_p` nucleus."""

    def __init__(self, temperature: float, top_p: float):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p = float(temperature), float(top_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        z = scores / self.temperature if self.temperature != 1.0 else scores
        if self.top_p >= 1.0:
            return z
        return z.masked_fill(~nucleus_mask(z, self.top_p), -float("inf"))


def nucleus_mask(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """`[B, V]` bool: the tokens of each row's top-`top_p` nucleus under softmax(z)."""
    probs = z.float().softmax(dim=-1)
    vocab = probs.shape[-1]
    k = min(FIRST_K, vocab)
    while True:
        top, idx = probs.topk(k, dim=-1, sorted=True)
        if k == vocab or bool((top.sum(-1) > top_p + MARGIN).all()):
            break
        k = min(4 * k, vocab)
    before = top.cumsum(-1) - top  # the mass of the tokens more probable than each
    keep = before < top_p
    keep[:, 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, idx, keep)
