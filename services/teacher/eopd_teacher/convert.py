"""The service boundary: protobuf <-> core types, with the validation of every request field.

Validation errors name the field (`sequences[3].score_from`) and the sequence id, so a client
can find the culprit; a request is validated whole before any of it is queued.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from eopd.v1 import teacher_pb2 as pb

from .types import ModelInfo, ScoreItem, SequenceScores

MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
MAX_ID_CHARS = 256
# Trailing metadata on a RESOURCE_EXHAUSTED that retrying cannot cure (the request itself is over a
# per-request limit): `eopd-retryable: 0`.
NOT_RETRYABLE_KEY = "eopd-retryable"
# Request metadata of a ScoreStream client that wants the end of the stream announced in band
# (ScoreResponse.ending) before the status, and half-closes when it is (see teacher.proto).
STREAM_ENDING_KEY = "eopd-stream-ending"


class InvalidRequest(ValueError):
    """A request field is wrong: INVALID_ARGUMENT."""


class RequestTooLarge(ValueError):
    """A request exceeds a per-request size limit: RESOURCE_EXHAUSTED, and never worth retrying as
    is (the server marks it with trailing metadata `eopd-retryable: 0`; split the request)."""


def response_bytes_bound(num_scored: int, top_k: int, num_sequences: int, num_candidate_values: int = 0, *,
                         id_bytes: int | None = None) -> int:
    """An upper bound of the serialized ScoreResponse for these many scored positions: per position
    4 + 4 bytes (log-prob, entropy) and top_k x (<= 5-byte varint id + 4-byte log-prob), packed;
    4 bytes per candidate log-prob (`num_candidate_values` = sum of n * m); per sequence the field
    headers, top_k and num_candidates (<= 80 bytes); the ids' bytes. `id_bytes` is the UTF-8
    length of the request id and of every sequence id together, as they travel (an id of 256 emoji
    is 1,024 bytes, not 256); default: every id at its largest, MAX_ID_CHARS 4-byte characters."""
    if id_bytes is None:
        id_bytes = (num_sequences + 1) * MAX_ID_CHARS * 4
    return num_scored * (8 + 9 * top_k) + 4 * num_candidate_values + num_sequences * 80 + id_bytes + 16


def utf8_id_bytes(request_id: str, sequence_ids: Iterable[str]) -> int:
    """The UTF-8 bytes of a request's ids (request id and sequence ids), what the answer repeats."""
    return len(request_id.encode()) + sum(len(sid.encode()) for sid in sequence_ids)


def check_item_id(item_id: str, seen: set[str], field: str, kind: str, where: str) -> None:
    """A sequence's or prompt's id: non-empty, at most MAX_ID_CHARS, unique within its request
    (`seen`, updated). `field` is e.g. "sequences[3]", `kind` "sequence" or "prompt"."""
    if not item_id:
        raise InvalidRequest(f"{field}.id: must be non-empty{where}")
    if len(item_id) > MAX_ID_CHARS:
        raise InvalidRequest(f"{field}.id: longer than {MAX_ID_CHARS} characters{where}")
    if item_id in seen:
        raise InvalidRequest(f"{field}.id: duplicate {kind} id {item_id!r}{where}")
    seen.add(item_id)


def vocab_ids(values, vocab_size: int, name: str, suffix: str, low: int = 0) -> np.ndarray:
    """`values` as int64 token ids, each in [low, vocab_size) (low -1: -1 is filler). Raises
    InvalidRequest naming the first id outside, as `{name}[j]`, with `suffix` (what it belongs to)."""
    ids = np.asarray(values, dtype=np.int64)
    bad = np.flatnonzero((ids < low) | (ids >= vocab_size))
    if bad.size:
        j = int(bad[0])
        raise InvalidRequest(f"{name}[{j}]: token id {int(ids[j])} is outside the vocabulary [0, {vocab_size}){suffix}")
    return ids


def temperature_in_range(temperature: float) -> bool:
    """[MIN_TEMPERATURE, MAX_TEMPERATURE], compared in float32, the type of the field on the wire:
    1e-4 sent as a float32 arrives as 9.99999974e-05, which the documented minimum must admit."""
    low, high = float(np.float32(MIN_TEMPERATURE)), float(np.float32(MAX_TEMPERATURE))
    return math.isfinite(temperature) and low <= temperature <= high


def items_from_request(
    req: pb.ScoreRequest, info: ModelInfo, *, require_request_id: bool = False, max_response_bytes: int | None = None
) -> list[ScoreItem]:
    """Validates `req` against the served model and the limits; returns one item per sequence.
    `max_response_bytes` (the server's message limit) refuses, before any scoring, a request whose
    answer could not be sent."""
    rid = req.request_id
    where = f" (request_id {rid!r})" if rid else ""
    if require_request_id and not rid:
        raise InvalidRequest("request_id: must be non-empty on ScoreStream (responses are matched by it)")
    if len(rid) > MAX_ID_CHARS:
        raise InvalidRequest(f"request_id: longer than {MAX_ID_CHARS} characters")
    if not req.sequences:
        raise InvalidRequest(f"sequences: at least one sequence is required{where}")
    if len(req.sequences) > info.max_sequences_per_request:
        raise RequestTooLarge(
            f"sequences: {len(req.sequences)} sequences exceed the limit of {info.max_sequences_per_request} per request{where}"
        )
    top_k = req.top_k or info.default_top_k
    if top_k > info.max_top_k:
        raise InvalidRequest(f"top_k: {req.top_k} exceeds the maximum {info.max_top_k}{where}")
    temperature = req.temperature or 1.0
    if not temperature_in_range(temperature):
        raise InvalidRequest(
            f"temperature: {req.temperature} must be 0 (meaning 1.0) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]{where}"
        )
    total = sum(len(s.token_ids) for s in req.sequences)
    if total > info.max_tokens_per_request:
        raise RequestTooLarge(f"sequences: {total} tokens exceed the limit of {info.max_tokens_per_request} per request{where}")
    seen: set[str] = set()
    items = []
    for i, seq in enumerate(req.sequences):
        field = f"sequences[{i}]"
        sid = seq.id
        check_item_id(sid, seen, field, "sequence", where)
        n = len(seq.token_ids)
        label = f"{field} (id {sid!r}){where}"
        if n == 0:
            raise InvalidRequest(f"{field}.token_ids: empty sequence, id {sid!r}{where}")
        if n > info.max_context_length:
            raise InvalidRequest(f"{field}.token_ids: {n} tokens exceed the model's context of {info.max_context_length}, id {sid!r}{where}")
        ids = vocab_ids(seq.token_ids, info.vocab_size, f"{field}.token_ids", f" of {label}")
        if n < 2:
            raise InvalidRequest(f"{field}.token_ids: {n} token; a sequence needs at least 2 (context and a scored token), {label}")
        if not 1 <= seq.score_from < n:
            raise InvalidRequest(f"{field}.score_from: {seq.score_from} must be in [1, {n - 1}] for {n} tokens, {label}")
        candidates = candidates_from_sequence(seq, n - int(seq.score_from), info, field, label)
        items.append(ScoreItem(sid, ids, int(seq.score_from), int(top_k), float(temperature), candidates))
    if max_response_bytes is not None:
        scored = sum(it.num_scored for it in items)
        bound = response_bytes_bound(scored, top_k, len(items), sum(it.num_scored * it.num_candidates for it in items),
                                     id_bytes=utf8_id_bytes(rid, (it.seq_id for it in items)))
        if bound > max_response_bytes:
            raise RequestTooLarge(
                f"sequences: {scored} scored positions at top_k {top_k} make an answer of up to {bound} bytes, over the "
                f"server's message limit of {max_response_bytes} bytes{where}; split the request"
            )
    return items


def candidates_from_sequence(seq: pb.Sequence, num_scored: int, info: ModelInfo, field: str, label: str) -> np.ndarray | None:
    """The validated `[n, m]` int64 candidate ids of `seq` (-1 filler), or None when it asks for
    none. Raises InvalidRequest naming `{field}.num_candidates` / `{field}.candidate_ids[j]`."""
    m = int(seq.num_candidates)
    got = len(seq.candidate_ids)
    if m == 0:
        if got:
            raise InvalidRequest(f"{field}.candidate_ids: {got} ids given but num_candidates is 0, {label}")
        return None
    if m > info.max_candidates:
        raise InvalidRequest(f"{field}.num_candidates: {m} exceeds the server's maximum {info.max_candidates}, {label}")
    if got != num_scored * m:
        raise InvalidRequest(
            f"{field}.candidate_ids: {got} ids, expected {num_scored} scored positions x num_candidates {m} = "
            f"{num_scored * m} (row-major [n, m], -1 as filler), {label}"
        )
    ids = vocab_ids(seq.candidate_ids, info.vocab_size, f"{field}.candidate_ids", f" (-1 is filler) of {label}", low=-1)
    return ids.reshape(num_scored, m)


def scores_to_pb(s: SequenceScores) -> pb.SequenceScores:
    out = pb.SequenceScores(
        id=s.seq_id,
        top_k=s.top_k,
        token_logprobs=s.token_logprobs.tolist(),
        entropies=s.entropies.tolist(),
        topk_ids=s.topk_ids.ravel().tolist(),
        topk_logprobs=s.topk_logprobs.ravel().tolist(),
    )
    if s.candidate_logprobs is not None and s.candidate_logprobs.shape[1]:
        out.num_candidates = int(s.candidate_logprobs.shape[1])
        out.candidate_logprobs.extend(s.candidate_logprobs.ravel().tolist())
    return out


def scores_from_pb(r: pb.SequenceScores) -> SequenceScores:
    """Decodes one result into numpy arrays (`[n]`, `[n, k]`; `candidate_logprobs [n, m]`, m = 0 when
    none were asked)."""
    k = max(int(r.top_k), 1)
    lp = np.asarray(r.token_logprobs, dtype=np.float32)
    return SequenceScores(
        seq_id=r.id,
        token_logprobs=lp,
        entropies=np.asarray(r.entropies, dtype=np.float32),
        topk_ids=np.asarray(r.topk_ids, dtype=np.int32).reshape(-1, k),
        topk_logprobs=np.asarray(r.topk_logprobs, dtype=np.float32).reshape(-1, k),
        candidate_logprobs=np.asarray(r.candidate_logprobs, dtype=np.float32).reshape(lp.shape[0], int(r.num_candidates)),
    )


def info_to_pb(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(**info.__dict__)


def info_from_pb(m: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(**{f: getattr(m, f) for f in ModelInfo.__dataclass_fields__})
