"""vLLM's per-token log-prob entries in `/v1/completions` answers, as pure functions over eopd's
`SequenceScores`: `prompt_logprobs` (keyed by token id, with rank and decoded token) and the OpenAI
`logprobs` object (keyed by decoded token), shared by the scoring answer (`openai_format.py`) and
the generation answer (`openai_generation.py`). Every log-prob below -9999 (-inf included) is sent
as -9999.0, as vLLM clamps them, since JSON has no infinity."""

from __future__ import annotations

import functools

from ..types import SequenceScores

LOGPROB_FLOOR = -9999.0


def lp_clamped(x: float) -> float:
    """`x`, or LOGPROB_FLOOR below it (-inf included)."""
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


DECODE_CACHE_SIZE = 1 << 17  # decoded tokens kept (a bounded LRU: ids a client sends cannot grow it for good)


class Decoder:
    """Token id -> decoded string as vLLM reports it (`tokenizer.decode([id])`), cached in a bounded
    LRU (thread-safe: answers are built in worker threads). The ids decoded are the engine's and
    the request's after validation (in the vocabulary)."""

    def __init__(self, tokenizer, cache_size: int = DECODE_CACHE_SIZE):
        self._tok = tokenizer
        self._decode = functools.lru_cache(maxsize=cache_size)(self._decode_one)

    def _decode_one(self, tid: int) -> str | None:
        return self._tok.decode([tid]) if self._tok is not None else None

    def __call__(self, tid: int) -> str | None:
        return self._decode(tid)

    def cached(self) -> int:
        """How many decoded tokens the cache holds now."""
        return self._decode.cache_info().currsize


def prompt_logprobs(ids: list[int], s: SequenceScores | None, k: int, decode: Decoder) -> tuple[list, list]:
    """vLLM's `prompt_logprobs` (null, then per position {id: {logprob, rank, decoded_token}}: the
    prompt's token and the top k) and eopd's `prompt_entropies` (null, then one float per position)."""
    out: list = [None]
    ent: list = [None]
    if s is None:
        return out, ent
    lps, ents = s.token_logprobs.tolist(), s.entropies.tolist()
    tids, tlps = s.topk_ids.tolist(), s.topk_logprobs.tolist()
    for t in range(1, len(ids)):
        row_ids, row_lps = tids[t - 1], tlps[t - 1]
        own = ids[t]
        rank = _rank(row_ids, own)
        d = {str(own): {"logprob": lp_clamped(lps[t - 1]), "rank": rank, "decoded_token": decode(own)}}
        for r in range(k):
            d.setdefault(str(row_ids[r]), {"logprob": lp_clamped(row_lps[r]), "rank": r + 1, "decoded_token": decode(row_ids[r])})
        out.append(d)
        ent.append(ents[t - 1])
    return out, ent


def logprob_entries(ids: list[int], s: SequenceScores | None, k: int, decode: Decoder, *,
                    first: bool) -> tuple[list, list, list]:
    """vLLM's per-token `logprobs` entries (`tokens`, `token_logprobs`, `top_logprobs`) of `ids`
    whose positions `s` scored: the token's own log-prob, then the top `k` (keyed by the decoded
    token, as vLLM: the token itself first). `first`: `ids[0]` has no score (a prompt's first
    token: `null` entries), `s` scores `ids[1:]`; else `s` scores every id. Rows of `s` beyond those
    ids (the filler position of `max_tokens: 1`) are not read."""
    tokens, token_lps, tops = [], [], []
    if first:
        tokens.append(decode(ids[0]))
        token_lps.append(None)
        tops.append(None)
    scored = ids[1:] if first else ids
    if s is None or not scored:
        return tokens, token_lps, tops
    n = len(scored)
    for tid, lp, row_ids, row_lps in zip(scored, s.token_logprobs[:n].tolist(), s.topk_ids[:n].tolist(),
                                         s.topk_logprobs[:n].tolist(), strict=True):
        tokens.append(decode(tid))
        token_lps.append(lp_clamped(lp))
        top = {decode(tid): lp_clamped(lp)}
        for r in range(k):
            top.setdefault(decode(row_ids[r]), lp_clamped(row_lps[r]))
        tops.append(top)
    return tokens, token_lps, tops


def logprobs_object(tokens: list, token_lps: list, tops: list) -> dict:
    """The OpenAI `logprobs` object, `text_offset` the running length of the decoded tokens."""
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok or "")
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def _rank(row_ids: list[int], own: int) -> int:
    """The 1-based rank of `own` in the top-k row; k + 1 (a lower bound) when it is not in it."""
    try:
        return row_ids.index(own) + 1
    except ValueError:
        return len(row_ids) + 1
