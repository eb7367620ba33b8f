"""Exact next-token statistics from final hidden states: the pure core of the teacher.

For scored positions with final hidden states `h [n, d]`, the output projection `W [V, d]`
(optional bias `[V]`), target tokens `y [n]`, per-position inverse temperatures `s [n]` and a `k`:

    z      = (h @ W.T + b) * s[:, None]            # [n, V] logits, temperature applied
    lse    = logsumexp(z, -1)                       # [n]
    logp   = z - lse                                # full-vocabulary log-softmax
    token_logprobs[i] = logp[i, y[i]]               # [n]
    entropies[i]      = -sum_v p[i, v] logp[i, v]   # [n], exact: over the whole vocabulary
    topk_ids, topk_logprobs = top-k of logp[i]      # [n, k], descending

Everything after the projection is float32 whatever the weights' dtype. Positions are processed
in chunks of `chunk_size` rows, so at most one `[chunk_size, V]` float32 block is alive at a time
(never a `[batch, seq, V]` tensor). The per-chunk reduction can run under `torch.compile`, which
fuses the log-softmax, entropy and gather into one pass over the logits (the eager version
reads the `[chunk, V]` block about five times).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

StatsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class TokenStatistics:
    """Per-position statistics (CPU tensors): `token_logprobs [n]`, `entropies [n]` float32,
    `topk_ids [n, k]` int64 and `topk_logprobs [n, k]` float32 (k = the largest k asked for)."""

    token_logprobs: torch.Tensor
    entropies: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor


def _chunk_stats(
    raw_logits: torch.Tensor, inv_temperature: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass over a chunk of logits.

    Args:
        raw_logits: `[c, V]` projection output in any float dtype (temperature not applied).
        inv_temperature: `[c]` float32.
        targets: `[c]` int64.

    Returns:
        `lse [c]`, `token_logprob [c]`, `entropy [c]`, float32, temperature applied.
    """
    z = raw_logits.float() * inv_temperature.unsqueeze(-1)
    zmax = z.amax(dim=-1, keepdim=True)
    zs = z - zmax  # <= 0: shifting first keeps the entropy free of cancellation against lse
    e = zs.exp()
    sum_e = e.sum(dim=-1, keepdim=True)
    log_sum = sum_e.log()
    # H = log(sum e) - E_p[zs]; e * zs is 0 where e underflows (zs may be -inf for masked entries).
    mean_zs = torch.where(e > 0, e * zs, torch.zeros_like(zs)).sum(dim=-1, keepdim=True) / sum_e
    token_lp = zs.gather(-1, targets.unsqueeze(-1)) - log_sum
    return (zmax + log_sum).squeeze(-1), token_lp.squeeze(-1), (log_sum - mean_zs).squeeze(-1)


_compiled: StatsFn | None = None


def compiled_chunk_stats() -> StatsFn:
    """`_chunk_stats` under torch.compile (compiled once per process, dynamic shapes): one fused
    pass over the logits instead of about five."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_chunk_stats, dynamic=True, fullgraph=True)
    return _compiled


def eager_chunk_stats() -> StatsFn:
    return _chunk_stats


def token_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_k: int,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    projection_dtype: torch.dtype | None = None,
    stats_fn: StatsFn | None = None,
) -> TokenStatistics:
    """Exact statistics at `n` positions (see the module docstring).

    Args:
        hidden: `[n, d]` final hidden states at the positions that predict `targets`.
        weight: `[V, d]` output projection (`lm_head.weight`).
        targets: `[n]` int token ids whose log-probabilities are wanted.
        inv_temperature: `[n]` float, 1 / temperature per position.
        top_k: k >= 1 (at most V).
        bias: optional `[V]` output bias.
        chunk_size: rows per projection chunk.
        projection_dtype: dtype of the projection matmul; None uses the weights' dtype (the logits
            are cast to float32 right after). float32 gives bit-for-bit fp32 statistics for
            low-precision weights at about 3x the projection cost on CPUs with bf16 matmul units.
        stats_fn: the per-chunk reduction: `eager_chunk_stats()` (default) or `compiled_chunk_stats()`.

    Returns:
        TokenStatistics on the CPU.
    """
    stats_fn = stats_fn or _chunk_stats
    n = hidden.shape[0]
    vocab = weight.shape[0]
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k} must be in [1, {vocab}]")
    if targets.shape != (n,) or inv_temperature.shape != (n,):
        raise ValueError(f"targets {tuple(targets.shape)} and inv_temperature {tuple(inv_temperature.shape)} must be [{n}]")
    w = weight if projection_dtype is None else weight.to(projection_dtype)
    b = None if bias is None else bias.to(w.dtype)
    out_lp = torch.empty(n, dtype=torch.float32)
    out_ent = torch.empty(n, dtype=torch.float32)
    out_ids = torch.empty(n, top_k, dtype=torch.int64)
    out_tlp = torch.empty(n, top_k, dtype=torch.float32)
    targets = targets.to(device=hidden.device, dtype=torch.int64)
    inv_temperature = inv_temperature.to(device=hidden.device, dtype=torch.float32)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        h = hidden[start:stop].to(w.dtype)
        raw = torch.nn.functional.linear(h, w, b)
        inv_t = inv_temperature[start:stop]
        lse, token_lp, entropy = stats_fn(raw, inv_t, targets[start:stop])
        # A positive temperature keeps the order, and float() is exact: the top-k of the raw
        # logits (in their own dtype, cheaper) are the top-k of the scaled float32 ones.
        top_ids = torch.topk(raw, top_k, dim=-1, sorted=True).indices
        top_z = raw.gather(-1, top_ids).float() * inv_t.unsqueeze(-1)
        out_lp[start:stop] = token_lp.cpu()
        out_ent[start:stop] = entropy.cpu()
        out_ids[start:stop] = top_ids.cpu()
        out_tlp[start:stop] = (top_z - lse.unsqueeze(-1)).cpu()
        del raw
    return TokenStatistics(out_lp, out_ent, out_ids, out_tlp)
