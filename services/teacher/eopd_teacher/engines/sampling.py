"""Next-token sampling as pure tensor functions: temperature, nucleus (top-p) filtering, a draw per
row from that row's own generator, and the seeds of those generators.

Each row has its own `torch.Generator` (seeded from the request's seed, the prompt's index in the
request and the sample's index: `sample_seed`), so a sample's tokens do not depend on which other
rows are drawn beside it.
"""

from __future__ import annotations

import numpy as np
import torch


def sample_seed(seed: int | None, prompt_index: int, sample_index: int) -> int:
    """The 63-bit seed of sample `sample_index` of prompt `prompt_index`: a hash of (seed,
    prompt_index, sample_index) (numpy's SeedSequence), fresh OS entropy when `seed` is None."""
    entropy = None if seed is None else [int(seed), int(prompt_index), int(sample_index)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """`logits [B, V]` -> `probs [B, V]` float32: softmax(logits / temperature), restricted to the
    smallest set of most probable tokens whose probability reaches `top_p` (the most probable token
    always kept; ties at the boundary broken by the sort), renormalised. `top_p >= 1` keeps all."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # probability of the tokens ranked above each one
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_next(
    logits: torch.Tensor, temperature: float, top_p: float, generators: list[torch.Generator] | None
) -> torch.Tensor:
    """The next token of each row, `[B]` int64 on the CPU: the argmax when `temperature == 0`
    (lowest id on ties), else one draw per row from `nucleus_probs` by inverse CDF: row b takes one
    uniform u from `generators[b]` (CPU generators) and the first token whose cumulative
    probability (float64) exceeds u times the row's total, so a token of probability 0 is never
    drawn. One uniform per draw, where `torch.multinomial` draws one exponential per vocabulary
    entry (17 ms a draw at 49k entries on a loaded CPU, the largest cost of a decode step)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1).cpu()
    assert generators is not None and len(generators) == logits.shape[0], "one generator per row"
    cdf = nucleus_probs(logits, temperature, top_p).cpu().double().cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp_(max=cdf.shape[-1] - 1)


def sample_rows(
    logits: torch.Tensor, temperatures: list[float], top_ps: list[float], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """`sample_next` with a temperature, top-p and generator per row (`[B]` int64 on the CPU): the
    rows of each (temperature, top_p) are drawn together as `sample_next` draws them (greedy rows
    take the argmax and need no generator), so a row's token is the one it draws in a batch of its
    own kind."""
    groups: dict[tuple[float, float], list[int]] = {}
    for b, key in enumerate(zip(temperatures, top_ps)):
        groups.setdefault(key, []).append(b)
    if len(groups) == 1:
        ((temperature, top_p),) = groups
        return sample_next(logits, temperature, top_p, generators if temperature > 0 else None)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    for (temperature, top_p), rows in groups.items():
        idx = torch.tensor(rows)
        out[idx] = sample_next(logits[idx.to(logits.device)], temperature, top_p,
                               [generators[b] for b in rows] if temperature > 0 else None)
    return out
