"""Exact next-token statistics from final hidden states: the pure core of the teacher.

For scored positions with final hidden states `h [n, d]`, the output projection `W [V, d]`
(optional bias `[V]`), target tokens `y [n]`, per-position inverse temperatures `s [n]` and a `k`:

    z      = (h @ W.T + b) * s[:, None]            # [n, V] logits, temperature applied
    lse    = logsumexp(z, -1)                       # [n]
    logp   = z - lse                                # full-vocabulary log-softmax
    token_logprobs[i] = logp[i, y[i]]               # [n]
    entropies[i]      = -sum_v p[i, v] logp[i, v]   # [n], exact: over the whole vocabulary
    topk_ids, topk_logprobs = top-k of logp[i]      # [n, k], descending
    candidate_logprobs[i, j] = logp[i, c[i, j]]     # [n, m], optional candidates c (-1: NaN)

Everything after the projection is float32 whatever the weights' dtype. Positions are processed
in chunks of `chunk_size` rows (never a `[batch, seq, V]` tensor). Per chunk, besides the
projection output `[chunk_size, V]` (in the weights' dtype), the eager reduction keeps at most two
float32 blocks of `EAGER_BLOCK_ELEMENTS` alive (rows of the shifted logits and their exponentials;
everything else is done in place on them). The per-chunk reduction can run under `torch.compile`, which fuses the
log-softmax, entropy and gather into one pass over the logits (the eager version reads the
`[chunk, V]` block about five times). `ChunkStats` picks the compiled path and falls back to the
eager one, once and with a warning, when compiling fails (e.g. no C++ compiler on the machine).
The top-k is taken from the raw logits in their own dtype; on a GPU in two stages
(`blocked_topk_indices`: block maxima, then the top-k of the best blocks), the same values as
`torch.topk` without its multi-pass select over the whole vocabulary.

`device_statistics` leaves the answer on the device with no synchronisation between chunks (the
engines copy it with `host_copy.to_host`, asynchronously); `token_statistics` returns it on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

StatsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class TokenStatistics:
    """Per-position statistics (on the CPU from `token_statistics`, on the engine's device from
    `device_statistics`): `token_logprobs [n]`, `entropies [n]` float32, `topk_ids [n, k]` int32 and `topk_logprobs [n, k]` float32 (k = the largest k asked for), and
    `candidate_logprobs [n, m]` float32 (m = 0 when no candidates were asked; NaN at -1 filler)."""

    token_logprobs: torch.Tensor
    entropies: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    candidate_logprobs: torch.Tensor | None = None


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
    # Two float32 [c, V] blocks at most: `zs` (a copy, so the caller's logits stay untouched) and
    # `e`; every other step is in place on them.
    zs = raw_logits.to(torch.float32, copy=True).mul_(inv_temperature.unsqueeze(-1))
    zmax = zs.amax(dim=-1, keepdim=True)
    zs.sub_(zmax)  # <= 0: shifting first keeps the entropy free of cancellation against lse
    token_z = zs.gather(-1, targets.unsqueeze(-1))  # before the clamp below: -inf stays -inf
    # -inf (a masked entry) -> the most negative float: exp is still 0 and 0 * zs is 0, not NaN.
    zs.clamp_(min=torch.finfo(torch.float32).min)
    e = zs.exp()
    sum_e = e.sum(dim=-1, keepdim=True)
    log_sum = sum_e.log()
    # H = log(sum e) - E_p[zs].
    mean_zs = e.mul_(zs).sum(dim=-1, keepdim=True) / sum_e
    token_lp = token_z - log_sum
    return (zmax + log_sum).squeeze(-1), token_lp.squeeze(-1), (log_sum - mean_zs).squeeze(-1)


_compiled: StatsFn | None = None


def compiled_chunk_stats() -> StatsFn:
    """`_chunk_stats` under torch.compile (compiled once per process, dynamic shapes): one fused
    pass over the logits instead of about five."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_chunk_stats, dynamic=True, fullgraph=True)
    return _compiled


# Elements of one float32 block of the eager reduction: its rows go `EAGER_BLOCK_ELEMENTS // V` at
# a time (at least one), so the eager path never holds a [chunk, V] float32 copy of the logits,
# only two [rows, V] blocks (64 MiB each; smaller blocks measured slower on the CPU).
EAGER_BLOCK_ELEMENTS = 1 << 24


def _blocked_chunk_stats(
    raw_logits: torch.Tensor, inv_temperature: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_chunk_stats` over blocks of rows (`EAGER_BLOCK_ELEMENTS`), the same numbers: each row's
    statistics depend on that row alone."""
    c, vocab = raw_logits.shape
    rows = max(1, EAGER_BLOCK_ELEMENTS // max(vocab, 1))
    if c <= rows:
        return _chunk_stats(raw_logits, inv_temperature, targets)
    parts = [_chunk_stats(raw_logits[r : r + rows], inv_temperature[r : r + rows], targets[r : r + rows])
             for r in range(0, c, rows)]
    return tuple(torch.cat(xs) for xs in zip(*parts))  # type: ignore[return-value]


def eager_chunk_stats() -> StatsFn:
    """The eager reduction, in blocks of rows (`_blocked_chunk_stats`)."""
    return _blocked_chunk_stats


# The top-k in two stages (`blocked_topk_indices`): per block of TOPK_BLOCK logits its maximum, the
# k blocks with the largest maxima, then the top-k of their k * TOPK_BLOCK logits.
TOPK_BLOCK = 64


def blocked_topk_indices(raw: torch.Tensor, k: int, block: int = TOPK_BLOCK) -> torch.Tensor:
    """The indices `[c, k]` of the k largest of each row of `raw [c, V]`, descending: the values
    are exactly `torch.topk`'s (which of two equal logits is named may differ). The k largest lie in
    the k blocks with the largest maxima (a block holding one of them has a maximum at least as
    large, and at most k - 1 blocks can beat it), so one read of the logits for the block maxima
    and a top-k over `k * block` candidates replace a top-k over the whole vocabulary (a multi-pass
    radix select on a GPU). Falls back to `torch.topk` when V is not a multiple of `block` or has
    fewer than 4k blocks."""
    c, vocab = raw.shape
    blocks = vocab // block
    if vocab % block or blocks < 4 * k:
        return torch.topk(raw, k, dim=-1, sorted=True).indices
    top_blocks = torch.topk(raw.view(c, blocks, block).amax(-1), k, dim=-1, sorted=False).indices  # [c, k]
    cand = (top_blocks.unsqueeze(-1) * block + torch.arange(block, device=raw.device)).view(c, k * block)
    best = torch.topk(raw.gather(-1, cand), k, dim=-1, sorted=True).indices
    return cand.gather(-1, best)


def topk_indices(raw: torch.Tensor, k: int) -> torch.Tensor:
    """The statistics' top-k: `blocked_topk_indices` on a GPU; `torch.topk` on the CPU, where the
    two-stage form measured no faster (block maxima of bf16 logits are slow there)."""
    if raw.device.type == "cuda":
        return blocked_topk_indices(raw, k)
    return torch.topk(raw, k, dim=-1, sorted=True).indices


def _compile_failure(exc: BaseException) -> bool:
    """True for an error of torch.compile itself (no C++ compiler, a failing inductor build), as
    opposed to an error of the computation (which the eager path would raise just the same)."""
    from torch._dynamo.exc import TorchDynamoException

    return isinstance(exc, TorchDynamoException) or type(exc).__module__.startswith("torch._inductor")


class ChunkStats:
    """The per-chunk reduction an engine uses, with the path it takes: "compiled" (torch.compile)
    or "eager". Asked to compile, it starts on the compiled path; the first time compiling fails
    (at warm-up or on a later recompile, e.g. InvalidCxxCompiler on a machine without g++), it logs
    one warning and serves on the eager path from then on (same numbers, slower)."""

    def __init__(self, compile: bool):
        self.path = "compiled" if compile else "eager"
        self.fallback_reason: str | None = None
        self._compiled = compiled_chunk_stats() if compile else None

    def __call__(self, raw_logits: torch.Tensor, inv_temperature: torch.Tensor, targets: torch.Tensor):
        if self.path == "compiled":
            try:
                return self._compiled(raw_logits, inv_temperature, targets)
            except Exception as exc:
                if not _compile_failure(exc):
                    raise
                first_line = (str(exc).strip().splitlines() or [""])[0]
                self.fallback_reason = f"{type(exc).__name__}: {first_line}"
                self.path = "eager"
                log.warning(
                    "torch.compile of the statistics failed (%s); serving with the eager statistics path "
                    "(same numbers, slower). Install a C++ compiler (g++) or set compile_statistics=false "
                    "to silence this.", self.fallback_reason,
                )
        return _blocked_chunk_stats(raw_logits, inv_temperature, targets)


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
    candidates: torch.Tensor | None = None,
) -> TokenStatistics:
    """Exact statistics at `n` positions (see the module docstring), on the CPU:
    `device_statistics(...)` copied to the host (synchronously; `host_copy.to_host` copies
    asynchronously).

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
        stats_fn: the per-chunk reduction: `eager_chunk_stats()` (default), `compiled_chunk_stats()` or a
            `ChunkStats`.
        candidates: optional `[n, m]` int ids whose log-probs are wanted at each position (-1:
            filler, answered NaN); gathered from the same chunk's logits as the top-k, after the
            reduction (which is unchanged).

    Returns:
        TokenStatistics on the CPU.
    """
    stats = device_statistics(hidden, weight, targets, inv_temperature, top_k, bias=bias, chunk_size=chunk_size,
                              projection_dtype=projection_dtype, stats_fn=stats_fn, candidates=candidates)
    return TokenStatistics(*(t.cpu() for t in (stats.token_logprobs, stats.entropies, stats.topk_ids,
                                                 stats.topk_logprobs, stats.candidate_logprobs)))


def device_statistics(
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
    candidates: torch.Tensor | None = None,
) -> TokenStatistics:
    """`token_statistics` left on `hidden`'s device: nothing waits for the device (no copy to the
    host, no synchronisation between chunks), so on a GPU the call returns once the work is queued
    and the caller copies only what it sends (`host_copy.to_host`). `topk_ids` are int32 (what
    the wire carries: half the bytes of int64 to copy). Arguments as `token_statistics`."""
    stats_fn = stats_fn or _blocked_chunk_stats
    n = hidden.shape[0]
    vocab = weight.shape[0]
    dev = hidden.device
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k={top_k} must be in [1, {vocab}]")
    if targets.shape != (n,) or inv_temperature.shape != (n,):
        raise ValueError(f"targets {tuple(targets.shape)} and inv_temperature {tuple(inv_temperature.shape)} must be [{n}]")
    w = weight if projection_dtype is None else weight.to(projection_dtype)
    b = None if bias is None else bias.to(w.dtype)
    out_lp = torch.empty(n, dtype=torch.float32, device=dev)
    out_ent = torch.empty(n, dtype=torch.float32, device=dev)
    out_ids = torch.empty(n, top_k, dtype=torch.int32, device=dev)
    out_tlp = torch.empty(n, top_k, dtype=torch.float32, device=dev)
    m = 0 if candidates is None else int(candidates.shape[1])
    if candidates is not None and tuple(candidates.shape) != (n, m):
        raise ValueError(f"candidates {tuple(candidates.shape)} must be [{n}, m]")
    out_clp = torch.empty(n, m, dtype=torch.float32, device=dev)
    if m:
        candidates = candidates.to(device=dev, dtype=torch.int64, non_blocking=True)
    targets = targets.to(device=dev, dtype=torch.int64, non_blocking=True)
    inv_temperature = inv_temperature.to(device=dev, dtype=torch.float32, non_blocking=True)
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        h = hidden[start:stop].to(w.dtype)
        raw = torch.nn.functional.linear(h, w, b)
        inv_t = inv_temperature[start:stop]
        lse, token_lp, entropy = stats_fn(raw, inv_t, targets[start:stop])
        # A positive temperature keeps the order, and float() is exact: the top-k of the raw
        # logits (in their own dtype, cheaper) are the top-k of the scaled float32 ones.
        top_ids = topk_indices(raw, top_k)
        top_z = raw.gather(-1, top_ids).float() * inv_t.unsqueeze(-1)
        out_lp[start:stop] = token_lp
        out_ent[start:stop] = entropy
        out_ids[start:stop] = top_ids
        out_tlp[start:stop] = top_z - lse.unsqueeze(-1)
        if m:
            out_clp[start:stop] = _candidate_logprobs(raw, candidates[start:stop], inv_t, lse)
        del raw
    return TokenStatistics(out_lp, out_ent, out_ids, out_tlp, out_clp)


def _candidate_logprobs(raw: torch.Tensor, cand: torch.Tensor, inv_t: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """`[c, m]` log-probs of the candidate ids `cand [c, m]` (-1 filler -> NaN) from a chunk's raw
    logits `[c, V]`, inverse temperatures `[c]` and the chunk's float32 log-normaliser `lse [c]`."""
    filler = cand < 0
    z = raw.gather(-1, cand.clamp(min=0)).float() * inv_t.unsqueeze(-1)
    return (z - lse.unsqueeze(-1)).masked_fill_(filler, float("nan"))
