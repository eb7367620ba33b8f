"""The service boundary of Generate: `GenerateRequest` -> `GenerateItem`s (every field validated,
errors naming the field and the prompt), `Generation` <-> `GenerateResponse`.

Score's boundary is `convert.py`; the shared rules (id lengths, temperature range, the answer-size
bound, the error types) are imported from there, not repeated.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from eopd.v1 import teacher_pb2 as pb

from .convert import (
    MAX_ID_CHARS,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    InvalidRequest,
    RequestTooLarge,
    check_item_id,
    response_bytes_bound,
    scores_from_pb,
    scores_to_pb,
    temperature_in_range,
    vocab_ids,
)
from .types import GenerateItem, Generation, ModelInfo

# Bytes of a GenerateResponse beyond its SequenceScores: <= 5-byte varint per generated id, the
# sample index, the finish reason and the field headers.
_GENERATED_ID_BYTES = 5
_GENERATE_OVERHEAD_BYTES = 64


class GenerateNotServed(Exception):
    """The engine cannot generate (ModelInfo.max_new_tokens == 0): UNIMPLEMENTED."""


def generate_response_bytes_bound(max_new_tokens: int, top_k: int, id_bytes: int) -> int:
    """An upper bound of one serialized GenerateResponse with `max_new_tokens` generated positions
    at `top_k` (`id_bytes`: UTF-8 bytes of the request id and the prompt id)."""
    return (response_bytes_bound(max_new_tokens, top_k, 1, id_bytes=id_bytes)
            + _GENERATED_ID_BYTES * max_new_tokens + _GENERATE_OVERHEAD_BYTES)


def _sampling_fields(req: pb.GenerateRequest, info: ModelInfo, where: str) -> dict:
    """The request-wide fields, validated (defaults applied): num_samples, max_new_tokens,
    temperature, top_p, stop_token_ids, seed, top_k, score_temperature."""
    num_samples = req.num_samples or 1
    if num_samples > info.max_generate_samples:
        raise InvalidRequest(f"num_samples: {req.num_samples} exceeds the server's maximum {info.max_generate_samples}{where}")
    if req.max_new_tokens < 1:
        raise InvalidRequest(f"max_new_tokens: required, at least 1{where}")
    if req.max_new_tokens > info.max_new_tokens:
        raise InvalidRequest(f"max_new_tokens: {req.max_new_tokens} exceeds the server's maximum {info.max_new_tokens}{where}")
    temperature = float(req.temperature)
    if not (temperature == 0.0 or temperature_in_range(temperature)):
        raise InvalidRequest(
            f"temperature: {req.temperature} must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]{where}"
        )
    top_p = float(req.top_p) or 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidRequest(f"top_p: {req.top_p} must be 0 (meaning 1.0, off) or in (0, 1]{where}")
    stop = vocab_ids(req.stop_token_ids, info.vocab_size, "stop_token_ids", where)
    top_k = req.top_k or info.default_top_k
    if top_k > info.max_top_k:
        raise InvalidRequest(f"top_k: {req.top_k} exceeds the maximum {info.max_top_k}{where}")
    score_temperature = float(req.score_temperature) or 1.0
    if not temperature_in_range(score_temperature):
        raise InvalidRequest(
            f"score_temperature: {req.score_temperature} must be 0 (meaning 1.0) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]{where}"
        )
    return dict(
        num_samples=int(num_samples), max_new_tokens=int(req.max_new_tokens), temperature=temperature, top_p=top_p,
        stop_token_ids=tuple(dict.fromkeys(int(t) for t in stop)), seed=int(req.seed) if req.HasField("seed") else None,
        top_k=int(top_k), score_temperature=score_temperature,
    )


def generate_items_from_request(
    req: pb.GenerateRequest, info: ModelInfo, *, max_response_bytes: int | None = None
) -> list[GenerateItem]:
    """Validates `req` against the served model and the limits; returns one item per prompt (in
    request order, `index` = the prompt's position). Raises GenerateNotServed when the engine cannot
    generate, InvalidRequest naming the field (and the prompt id), RequestTooLarge when the request
    is over a per-request limit: prompts, tokens ((prompt + max_new_tokens) x num_samples over all
    prompts, what the engine holds), or an answer that could exceed `max_response_bytes`."""
    if info.max_new_tokens == 0:
        raise GenerateNotServed(f"Generate is not served by this teacher (engine {info.engine!r} does not generate)")
    rid = req.request_id
    where = f" (request_id {rid!r})" if rid else ""
    if len(rid) > MAX_ID_CHARS:
        raise InvalidRequest(f"request_id: longer than {MAX_ID_CHARS} characters")
    if not req.prompts:
        raise InvalidRequest(f"prompts: at least one prompt is required{where}")
    if len(req.prompts) > info.max_sequences_per_request:
        raise RequestTooLarge(
            f"prompts: {len(req.prompts)} prompts exceed the limit of {info.max_sequences_per_request} per request{where}"
        )
    fields = _sampling_fields(req, info, where)
    max_new, samples = fields["max_new_tokens"], fields["num_samples"]
    total = sum(len(p.token_ids) + max_new for p in req.prompts) * samples
    if total > info.max_tokens_per_request:
        raise RequestTooLarge(
            f"prompts: (prompt tokens + max_new_tokens {max_new}) x num_samples {samples} = {total} tokens exceed the limit "
            f"of {info.max_tokens_per_request} per request{where}"
        )
    seen: set[str] = set()
    items = []
    for i, prompt in enumerate(req.prompts):
        field = f"prompts[{i}]"
        pid = prompt.id
        check_item_id(pid, seen, field, "prompt", where)
        n = len(prompt.token_ids)
        if n == 0:
            raise InvalidRequest(f"{field}.token_ids: empty prompt, id {pid!r}{where}")
        if n + max_new > info.max_context_length:
            raise InvalidRequest(
                f"{field}.token_ids: {n} prompt tokens + max_new_tokens {max_new} exceed the model's context of "
                f"{info.max_context_length}, id {pid!r}{where}"
            )
        ids = vocab_ids(prompt.token_ids, info.vocab_size, f"{field}.token_ids", f" of {field} (id {pid!r}){where}")
        if max_response_bytes is not None:
            bound = generate_response_bytes_bound(max_new, fields["top_k"], len(rid.encode()) + len(pid.encode()))
            if bound > max_response_bytes:
                raise RequestTooLarge(
                    f"max_new_tokens: {max_new} positions at top_k {fields['top_k']} make an answer of up to {bound} bytes, "
                    f"over the server's message limit of {max_response_bytes} bytes{where}"
                )
        items.append(GenerateItem(prompt_id=pid, token_ids=ids, index=i, **fields))
    return items


def generation_to_pb(request_id: str, g: Generation) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        request_id=request_id,
        prompt_id=g.prompt_id,
        sample_index=g.sample_index,
        token_ids=g.token_ids.tolist(),
        finish_reason=g.finish_reason,
        scores=scores_to_pb(g.scores),
    )


def generation_from_pb(r: pb.GenerateResponse) -> Generation:
    """Decodes one answer (`token_ids [n]` int64; the statistics as `convert.scores_from_pb`)."""
    return Generation(
        prompt_id=r.prompt_id,
        sample_index=int(r.sample_index),
        token_ids=np.asarray(r.token_ids, dtype=np.int64),
        finish_reason=r.finish_reason,
        scores=dataclasses.replace(scores_from_pb(r.scores), candidate_logprobs=None),  # Generate asks for none
    )

