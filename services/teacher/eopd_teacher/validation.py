"""Admission of a request, on core types: every field validated against the served model and the
limits, the whole request before any of it is queued; returns the engine's items.

The messages name the field the way the caller's front end shows it (`FieldNames`): on gRPC
`sequences[3].token_ids[5]: ... of sequences[3] (id 'x')`, on the HTTP API (`/v1/completions`)
`prompt[3][5]: ... of prompt[3]`. No protobuf here: the gRPC shapes are `convert.py`'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from eopd_common.hidden_wire import HIDDEN_DTYPES, hidden_bytes_per_token

from .types import GenerateItem, GenerateRequest, ModelInfo, ScoreItem, ScoreRequest, ScoreSequence

MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
MAX_ID_CHARS = 256
# Bytes of a GenerateResponse beyond its SequenceScores: <= 5-byte varint per generated id, the
# sample index, the finish reason and the field headers.
_GENERATED_ID_BYTES = 5
_GENERATE_OVERHEAD_BYTES = 64
# Bytes of a SequenceScores' hidden-state fields beyond the packed values: the output head's
# fingerprint (64 hex characters), the dtype, the size and the field headers.
_HIDDEN_OVERHEAD_BYTES = 96


class InvalidRequest(ValueError):
    """A request field is wrong: INVALID_ARGUMENT."""


class RequestTooLarge(ValueError):
    """A request exceeds a per-request size limit: RESOURCE_EXHAUSTED, and never worth retrying as
    is (the server marks it with trailing metadata `eopd-retryable: 0`; split the request)."""


class GenerateNotServed(Exception):
    """The engine cannot generate (ModelInfo.max_new_tokens == 0): UNIMPLEMENTED."""


class FieldNames:
    """How one front end names a request's fields in error messages.

    `items`: the list of sequences or prompts ("sequences", "prompts"; the HTTP API's "prompt").
    `nested`: an item has named fields (`sequences[3].token_ids`, and its id is quoted in the
    message); not nested, the item is its token ids (`prompt[3]`, `prompt[3][5]`, no id).
    `positions`: item i is shown as `items[positions[i]]` (the HTTP route scores a subset of its
    prompts); None: as `items[i]`. `renamed`: request-wide fields under the front end's names
    (`max_new_tokens` -> `max_tokens`)."""

    def __init__(self, items: str, *, nested: bool = True, positions: list[int] | None = None,
                 renamed: Mapping[str, str] | None = None):
        self.items = items
        self.nested = nested
        self.positions = positions
        self.renamed = dict(renamed or {})

    def field(self, name: str) -> str:
        """A request-wide field (`top_k`)."""
        return self.renamed.get(name, name)

    def item(self, i: int) -> str:
        """Item i (`sequences[3]`)."""
        return f"{self.items}[{i if self.positions is None else self.positions[i]}]"

    def token_ids(self, i: int) -> str:
        """Item i's token ids (`sequences[3].token_ids`; not nested: `prompt[3]`)."""
        return f"{self.item(i)}.token_ids" if self.nested else self.item(i)

    def label(self, i: int, item_id: str) -> str:
        """Item i with its id, what a message is about (`sequences[3] (id 'x')`; `prompt[3]`)."""
        return f"{self.item(i)} (id {item_id!r})" if self.nested else self.item(i)

    def id_note(self, item_id: str) -> str:
        """The id after a message on an item's token ids (`, id 'x'`; not nested: nothing)."""
        return f", id {item_id!r}" if self.nested else ""


SCORE_FIELDS = FieldNames("sequences")  # the gRPC ScoreRequest's (`sequences[3].token_ids`)
GENERATE_FIELDS = FieldNames("prompts")  # the gRPC GenerateRequest's (`prompts[3].token_ids`)


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


def generate_response_bytes_bound(max_new_tokens: int, top_k: int, id_bytes: int) -> int:
    """An upper bound of one serialized GenerateResponse with `max_new_tokens` generated positions
    at `top_k` (`id_bytes`: UTF-8 bytes of the request id and the prompt id)."""
    return (response_bytes_bound(max_new_tokens, top_k, 1, id_bytes=id_bytes)
            + _GENERATED_ID_BYTES * max_new_tokens + _GENERATE_OVERHEAD_BYTES)


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


def _request_frame(rid: str, count: int, noun: str, info: ModelInfo, names: FieldNames) -> str:
    """Checks a request's id and its number of items (`noun`: sequence or prompt) against the limits;
    returns the " (request_id ...)" suffix of its error messages."""
    where = f" (request_id {rid!r})" if rid else ""
    if len(rid) > MAX_ID_CHARS:
        raise InvalidRequest(f"request_id: longer than {MAX_ID_CHARS} characters")
    if not count:
        raise InvalidRequest(f"{names.items}: at least one {noun} is required{where}")
    if count > info.max_sequences_per_request:
        raise RequestTooLarge(f"{names.items}: {count} {noun}s exceed the limit of {info.max_sequences_per_request} "
                              f"per request{where}")
    return where


def score_items(req: ScoreRequest, info: ModelInfo, names: FieldNames = SCORE_FIELDS, *, require_request_id: bool = False,
                max_response_bytes: int | None = None) -> list[ScoreItem]:
    """Validates `req` against the served model and the limits; returns one item per sequence.
    `max_response_bytes` (the server's message limit) refuses, before any scoring, a request whose
    answer could not be sent."""
    rid = req.request_id
    if require_request_id and not rid:
        raise InvalidRequest("request_id: must be non-empty on ScoreStream (responses are matched by it)")
    where = _request_frame(rid, len(req.sequences), "sequence", info, names)
    top_k_name = names.field("top_k")
    top_k = req.top_k or info.default_top_k
    if top_k > info.max_top_k:
        raise InvalidRequest(f"{top_k_name}: {req.top_k} exceeds the maximum {info.max_top_k}{where}")
    temperature = req.temperature or 1.0
    if not temperature_in_range(temperature):
        raise InvalidRequest(
            f"temperature: {req.temperature} must be 0 (meaning 1.0) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]{where}"
        )
    total = sum(len(s.token_ids) for s in req.sequences)
    if total > info.max_tokens_per_request:
        raise RequestTooLarge(f"{names.items}: {total} tokens exceed the limit of {info.max_tokens_per_request} per request{where}")
    hidden = _hidden_dtype(req.hidden_states, info, where)
    seen: set[str] = set()
    items = []
    for i, seq in enumerate(req.sequences):
        field = names.item(i)
        sid = seq.id
        check_item_id(sid, seen, field, "sequence", where)
        n = len(seq.token_ids)
        label = f"{names.label(i, sid)}{where}"
        tokens = names.token_ids(i)
        if n == 0:
            raise InvalidRequest(f"{tokens}: empty sequence{names.id_note(sid)}{where}")
        if n > info.max_context_length:
            raise InvalidRequest(f"{tokens}: {n} tokens exceed the model's context of {info.max_context_length}{names.id_note(sid)}{where}")
        ids = vocab_ids(seq.token_ids, info.vocab_size, tokens, f" of {label}")
        if n < 2:
            raise InvalidRequest(f"{tokens}: {n} token; a sequence needs at least 2 (context and a scored token), {label}")
        if not 1 <= seq.score_from < n:
            raise InvalidRequest(f"{field}.score_from: {seq.score_from} must be in [1, {n - 1}] for {n} tokens, {label}")
        candidates = _candidates(seq, n - int(seq.score_from), info, field, label)
        items.append(ScoreItem(sid, ids, int(seq.score_from), int(top_k), float(temperature), candidates, hidden))
    if max_response_bytes is not None:
        scored = sum(it.num_scored for it in items)
        bound = response_bytes_bound(scored, top_k, len(items), sum(it.num_scored * it.num_candidates for it in items),
                                     id_bytes=utf8_id_bytes(rid, (it.seq_id for it in items)))
        if hidden:
            bound += scored * hidden_bytes_per_token(info.hidden_size, hidden) + len(items) * _HIDDEN_OVERHEAD_BYTES
        if bound > max_response_bytes:
            raise RequestTooLarge(
                f"{names.items}: {scored} scored positions at {top_k_name} {top_k} make an answer of up to {bound} bytes, over the "
                f"server's message limit of {max_response_bytes} bytes{where}; split the request"
            )
    return items


def _hidden_dtype(value: str, info: ModelInfo, where: str) -> str:
    """The validated `hidden_states` dtype ("" for none). Raises InvalidRequest naming the field
    for an unknown value or an engine that cannot return hidden states."""
    if not value:
        return ""
    if value not in HIDDEN_DTYPES:
        raise InvalidRequest(f"hidden_states: {value!r} is not one of {list(HIDDEN_DTYPES)}{where}")
    if not info.output_head_fingerprint:
        raise InvalidRequest(f"hidden_states: not served by this teacher (engine {info.engine!r} cannot return its final "
                             f"hidden states); ask for the top-k only{where}")
    return value


def _candidates(seq: ScoreSequence, num_scored: int, info: ModelInfo, field: str, label: str) -> np.ndarray | None:
    """The validated `[n, m]` int64 candidate ids of `seq` (-1 filler), or None when it asks for
    none. Raises InvalidRequest naming `{field}.num_candidates` / `{field}.candidate_ids[j]`."""
    m = int(seq.num_candidates)
    given = () if seq.candidate_ids is None else seq.candidate_ids
    got = len(given)
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
    ids = vocab_ids(given, info.vocab_size, f"{field}.candidate_ids", f" (-1 is filler) of {label}", low=-1)
    return ids.reshape(num_scored, m)


def _sampling_fields(req: GenerateRequest, info: ModelInfo, names: FieldNames, where: str) -> dict:
    """The request-wide fields, validated (defaults applied): num_samples, max_new_tokens,
    temperature, top_p, stop_token_ids, seed, top_k, score_temperature."""
    f = names.field
    num_samples = req.num_samples or 1
    if num_samples > info.max_generate_samples:
        raise InvalidRequest(f"{f('num_samples')}: {req.num_samples} exceeds the server's maximum {info.max_generate_samples}{where}")
    if req.max_new_tokens < 1:
        raise InvalidRequest(f"{f('max_new_tokens')}: required, at least 1{where}")
    if req.max_new_tokens > info.max_new_tokens:
        raise InvalidRequest(f"{f('max_new_tokens')}: {req.max_new_tokens} exceeds the server's maximum {info.max_new_tokens}{where}")
    temperature = float(req.temperature)
    if not (temperature == 0.0 or temperature_in_range(temperature)):
        raise InvalidRequest(
            f"{f('temperature')}: {req.temperature} must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]{where}"
        )
    top_p = float(req.top_p) or 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"{f('top_p')}: {req.top_p} must be 0 (meaning 1.0, off) or in (0, 1]{where}")
    stop = vocab_ids(list(req.stop_token_ids), info.vocab_size, f("stop_token_ids"), where)
    top_k = req.top_k or info.default_top_k
    if top_k > info.max_top_k:
        raise InvalidRequest(f"{f('top_k')}: {req.top_k} exceeds the maximum {info.max_top_k}{where}")
    score_temperature = float(req.score_temperature) or 1.0
    if not temperature_in_range(score_temperature):
        raise InvalidRequest(
            f"{f('score_temperature')}: {req.score_temperature} must be 0 (meaning 1.0) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]{where}"
        )
    return dict(
        num_samples=int(num_samples), max_new_tokens=int(req.max_new_tokens), temperature=temperature, top_p=top_p,
        stop_token_ids=tuple(dict.fromkeys(int(t) for t in stop)), seed=None if req.seed is None else int(req.seed),
        top_k=int(top_k), score_temperature=score_temperature,
        hidden_dtype=_hidden_dtype(req.hidden_states, info, where),
    )


def generate_items(req: GenerateRequest, info: ModelInfo, names: FieldNames = GENERATE_FIELDS, *,
                   max_response_bytes: int | None = None) -> list[GenerateItem]:
    """Validates `req` against the served model and the limits; returns one item per prompt (in
    request order, `index` = the prompt's position). Raises GenerateNotServed when the engine cannot
    generate, InvalidRequest naming the field (and the prompt id), RequestTooLarge when the request
    is over a per-request limit: prompts, tokens ((prompt + max_new_tokens) x num_samples over all
    prompts, what the engine holds), or an answer that could exceed `max_response_bytes`."""
    if info.max_new_tokens == 0:
        raise GenerateNotServed(f"Generate is not served by this teacher (engine {info.engine!r} does not generate)")
    f = names.field
    rid = req.request_id
    where = _request_frame(rid, len(req.prompts), "prompt", info, names)
    fields = _sampling_fields(req, info, names, where)
    max_new, samples = fields["max_new_tokens"], fields["num_samples"]
    total = sum(len(p.token_ids) + max_new for p in req.prompts) * samples
    if total > info.max_tokens_per_request:
        raise RequestTooLarge(
            f"{names.items}: (prompt tokens + {f('max_new_tokens')} {max_new}) x {f('num_samples')} {samples} = {total} tokens "
            f"exceed the limit of {info.max_tokens_per_request} per request{where}"
        )
    seen: set[str] = set()
    items = []
    for i, prompt in enumerate(req.prompts):
        field = names.item(i)
        tokens = names.token_ids(i)
        pid = prompt.id
        check_item_id(pid, seen, field, "prompt", where)
        n = len(prompt.token_ids)
        if n == 0:
            raise InvalidRequest(f"{tokens}: empty prompt{names.id_note(pid)}{where}")
        if n + max_new > info.max_context_length:
            raise InvalidRequest(
                f"{tokens}: {n} prompt tokens + {f('max_new_tokens')} {max_new} exceed the model's context of "
                f"{info.max_context_length}{names.id_note(pid)}{where}"
            )
        ids = vocab_ids(prompt.token_ids, info.vocab_size, tokens, f" of {names.label(i, pid)}{where}")
        if max_response_bytes is not None:
            bound = generate_response_bytes_bound(max_new, fields["top_k"], len(rid.encode()) + len(pid.encode()))
            if fields["hidden_dtype"]:
                bound += max_new * hidden_bytes_per_token(info.hidden_size, fields["hidden_dtype"]) + _HIDDEN_OVERHEAD_BYTES
            if bound > max_response_bytes:
                raise RequestTooLarge(
                    f"{f('max_new_tokens')}: {max_new} positions at {f('top_k')} {fields['top_k']} make an answer of up to "
                    f"{bound} bytes, over the server's message limit of {max_response_bytes} bytes{where}"
                )
        items.append(GenerateItem(prompt_id=pid, token_ids=ids, index=i, **fields))
    return items
