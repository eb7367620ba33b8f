"""Chunked prefill: one batch scored in steps of at most `chunk_tokens` padded tokens each, the KV
cache (`past_key_values`) carried from step to step, so the batcher can serve other clients' batches
between the steps of a long one (docs/teacher.md, "Fair queuing"; issue 17, section 4).

The batch is right-padded to `[B, W]` as in `TransformersEngine._score`; step j runs the decoder on
columns `[j*c, (j+1)*c)` (c = max(1, chunk_tokens // B)) with the attention mask of every column so
far and the cache of the columns before, which is the same causal computation as one pass over all
W columns. The statistics of the scored positions whose predicting hidden state (position t - 1)
lies in the step's columns are computed from that step's hidden states (`stats.token_statistics`)
and written into the batch's flat outputs, so no `[B, W, d]` hidden state is kept; after the last
step they are split per sequence. Numbers equal the unchunked ones to float32 rounding
(tests/teacher/engines/test_chunked_prefill.py: within 1e-5 on tiny-random and SmolLM2-135M).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
from transformers import DynamicCache

from ..settings import EngineSettings
from ..stats import StatsFn, TokenStatistics, token_statistics
from ..types import ScoreItem, SequenceScores
from .base import ItemHidden, flat_targets, split_scores


def score_in_steps(
    decoder: torch.nn.Module,
    head: torch.nn.Module,
    items: list[ScoreItem],
    *,
    chunk_tokens: int,
    settings: EngineSettings,
    stats_fn: StatsFn,
    logit_factor: float,
    device: str,
    head_fingerprint: str = "",
) -> Iterator[list[SequenceScores] | None]:
    """A generator: each `next()` runs one step (at most `chunk_tokens` padded tokens, at least one
    column) and yields None, except the last, which yields the batch's scores (in item order).
    Call it under `torch.inference_mode()`; the cache lives in the generator between steps. Items
    that ask for hidden states get the scored positions' rows, kept on the host between steps."""
    lengths = [it.num_tokens for it in items]
    batch, width = len(items), max(lengths)
    ids = torch.zeros((batch, width), dtype=torch.long)
    attn = torch.zeros((batch, width), dtype=torch.long)
    for row, it in enumerate(items):
        ids[row, : it.num_tokens] = torch.from_numpy(it.token_ids)
        attn[row, : it.num_tokens] = 1
    ids, attn = ids.to(device), attn.to(device)
    # Per scored position (item order): the row and column of its predicting hidden state.
    rows = torch.cat([torch.full((it.num_scored,), r, dtype=torch.long) for r, it in enumerate(items)])
    cols = torch.cat([torch.arange(it.score_from - 1, it.num_tokens - 1) for it in items])
    targets, inv_t, candidates = flat_targets(items, logit_factor)
    n, k = targets.shape[0], max(it.top_k for it in items)
    m = 0 if candidates is None else candidates.shape[1]
    out_lp, out_ent = torch.empty(n), torch.empty(n)
    out_ids, out_tlp = torch.empty(n, k, dtype=torch.int32), torch.empty(n, k)
    weight, bias = head.weight, getattr(head, "bias", None)
    out_clp = torch.empty(n, m)
    out_h = torch.empty(n, weight.shape[1], dtype=weight.dtype) if any(it.hidden_dtype for it in items) else None
    step = max(1, chunk_tokens // batch)
    cache = DynamicCache()
    # transformers >= 5.2x names the cache argument `cache`, earlier releases (the vLLM venv's 5.19) `past_key_values`.
    cache_key = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    for start in range(0, width, step):
        stop = min(start + step, width)
        hidden = decoder(input_ids=ids[:, start:stop], attention_mask=attn[:, :stop], use_cache=True,
                         **{cache_key: cache}).last_hidden_state  # [B, stop - start, d]
        sel = torch.nonzero((cols >= start) & (cols < stop)).squeeze(-1)
        if sel.numel():
            h = hidden[rows[sel].to(device), (cols[sel] - start).to(device)]
            st = token_statistics(
                h, weight, targets[sel], inv_t[sel], k, bias=bias, chunk_size=settings.chunk_size,
                projection_dtype=torch.float32 if settings.fp32_projection else None, stats_fn=stats_fn,
                candidates=None if candidates is None else candidates[sel],
            )
            out_lp[sel], out_ent[sel], out_ids[sel], out_tlp[sel] = st.token_logprobs, st.entropies, st.topk_ids, st.topk_logprobs
            if m:
                out_clp[sel] = st.candidate_logprobs
            if out_h is not None:
                out_h[sel] = h.to(device="cpu", dtype=out_h.dtype)
        del hidden
        if stop < width:
            yield None
    hidden = None if out_h is None else ItemHidden.of(items, out_h, head_fingerprint)
    yield split_scores(items, TokenStatistics(out_lp, out_ent, out_ids, out_tlp, out_clp), hidden)
