"""vLLM's `/v1/completions` shapes for scoring, as pure functions: the request model (the fields
vLLM accepts that eopd can honour, validated with the field named), the scoring plan of one prompt,
and the answer built from eopd's `SequenceScores`. No I/O here: the route is `openai_compat.py`;
the answer of `max_tokens` > 1 (teacher generation) is `openai_generation.py`.

The answer is vLLM's (`choices[i].prompt_logprobs`: `null` first, then per position a dict keyed
by the token id as a string, `{logprob, rank, decoded_token}`, the prompt's token plus the top-k),
with one extension per choice: `prompt_entropies`, the exact full-vocabulary entropy per position
(`null` first), which vLLM clients ignore.

Two documented differences from vLLM: the one completion token of `max_tokens: 1` is the
teacher's most likely next token (greedy, whatever the sampling fields say; `max_tokens` > 1
samples, through the Generate path); and the `rank` of a
prompt token outside the top-k is `k + 1`, a lower bound (eopd computes ranks within the top-k;
vLLM counts the whole vocabulary). Every log-prob below -9999 (-inf included) is sent as -9999.0,
as vLLM clamps them, since JSON has no infinity.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..types import SequenceScores
from .openai_logprobs import Decoder, logprob_entries, logprobs_object, lp_clamped, prompt_logprobs

# An estimate of one prompt-logprob entry's JSON bytes besides its decoded token (key, logprob,
# rank, field names), used to refuse before scoring an answer over the server's message limit.
JSON_ENTRY_BYTES = 72  # measured ~69 on SmolLM2 (bench_openai_compat: 1922 B per scored token at k = 20)
PENALTY_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


class CompletionRequest(BaseModel):
    """The fields of vLLM's CompletionRequest that scoring uses or can ignore safely. Any other
    field (logit_bias, guided decoding, suffix, ...) is refused (400 naming it) rather than
    silently ignored, since it would change what vLLM returns."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = Field(16, description="0: score; 1: score + the greedy next token; > 1: generate (Generate)")
    echo: bool = False
    temperature: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    add_special_tokens: bool = True
    return_token_ids: bool = False
    # Sampling fields: with max_tokens > 1 honoured (openai_generation.sampling); with 0 or 1 accepted and
    # ignored (they do not change the greedy completion token).
    user: str | None = None
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Penalties change vLLM's processed log-probs: only their neutral values are accepted.
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0


class CompatError(Exception):
    """A request eopd answers with an error in vLLM's shape: HTTP status, the field, a message."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 413: "RequestEntityTooLargeError",
               415: "UnsupportedMediaTypeError", 429: "TooManyRequestsError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """vLLM's ErrorResponse: `{"error": {"message", "type", "param", "code"}}`, code = HTTP status."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"), "param": param, "code": status}}


def validation_error(exc) -> CompatError:
    """A pydantic ValidationError as a 400 naming the first wrong field (`prompt[2][5]`)."""
    err = max(exc.errors(), key=lambda e: len(e["loc"]))  # the union member that got furthest
    loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in {"str", "int"}))]
    param = loc[0] + "".join(f"[{x}]" for x in loc[1:]) if loc else None
    if err["type"] == "extra_forbidden":
        return CompatError(400, f"{param}: not supported by eopd-teacher's /v1/completions (it scores; see docs/teacher.md)", param)
    return CompatError(400, f"{param}: {err['msg']}", param)


@dataclass(frozen=True)
class Plan:
    """What to score for one request: per prompt its token ids, and the engine's top-k."""

    prompts: list[list[int]]
    generate: bool  # max_tokens == 1: one (greedy) completion token per prompt
    top_k: int  # what the engine computes (>= 1)
    prompt_k: int | None  # prompt_logprobs asked (None: not asked)
    logprobs_k: int | None
    temperature: float  # of the statistics (1.0 when the request's is 0 or absent)
    max_tokens: int = 0  # > 1: generated through the Generate path (openai_generation.py)
    n: int = 1  # completions per prompt (> 1 only with max_tokens > 1)

    @property
    def sample(self) -> bool:
        """max_tokens > 1: the teacher generates (vLLM's sampler where vLLM is the engine)."""
        return self.max_tokens > 1


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost, checked from its counts before any prompt is tokenized or scored
    (`early_limits`): prompts (max_sequences_per_request), token ids given (max_tokens_per_request)
    and the answer's estimated JSON size (max_message_bytes)."""

    max_prompts: int
    max_tokens: int
    max_answer_bytes: int


def plan(req: CompletionRequest, *, served_model: str, max_top_k: int, vocab_size: int, tokenize,
         max_new_tokens: int = 0, limits: RequestLimits | None = None) -> Plan:
    """Validates the fields eopd checks beyond their types (in vLLM's terms, the field named), the
    prompts' token ids in the vocabulary (even when nothing is scored), and with `limits` the
    request's size from its counts before any text is tokenized (`early_limits`); the other
    token-level checks (context, per-request limits) are the gRPC path's. `max_new_tokens` is the
    server's Generate bound (ModelInfo.max_new_tokens; 0: Generate not served, so `max_tokens` > 1
    is refused)."""
    if req.model is not None and req.model != served_model:
        raise CompatError(404, f"model: the model `{req.model}` does not exist (this server serves `{served_model}`)", "model")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # vLLM's default
    if max_tokens < 0:
        raise CompatError(400, f"max_tokens: {max_tokens} must be >= 0", "max_tokens")
    if max_tokens > 1 and max_new_tokens <= 0:
        raise CompatError(400, f"max_tokens: {max_tokens}; this teacher does not serve generation (its engine cannot "
                               "generate, or max_new_tokens is 0): use 0 or 1 (1: the greedy next token)", "max_tokens")
    if req.n < 1 or (req.n != 1 and max_tokens <= 1):
        raise CompatError(400, f"n: {req.n} completions per prompt; must be 1 unless max_tokens > 1", "n")
    if req.best_of not in (None, 1):
        raise CompatError(400, f"best_of: {req.best_of}; must be 1 or absent", "best_of")
    if req.stream:
        raise CompatError(400, "stream: streaming is not supported by eopd-teacher's /v1/completions", "stream")
    for name, neutral in PENALTY_NEUTRAL.items():
        value = getattr(req, name)
        if value is not None and value != neutral:
            raise CompatError(400, f"{name}: {value}; only {neutral} is supported (penalties change the log-probs)", name)
    temperature = 1.0 if req.temperature in (None, 0) else req.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise CompatError(400, f"temperature: {req.temperature} must be >= 0", "temperature")
    ks = {}
    for name in ("prompt_logprobs", "logprobs"):
        value = getattr(req, name)
        if value == -1:
            value = vocab_size  # vLLM: -1 means the whole vocabulary
        if value is not None and value < 0:
            raise CompatError(400, f"{name}: {getattr(req, name)} must be >= 0 (or -1: the whole vocabulary)", name)
        if value is not None and value > max_top_k:
            raise CompatError(400, f"{name}: {value} exceeds this server's maximum {max_top_k} (its max_top_k)", name)
        ks[name] = value
    if req.echo and ks["prompt_logprobs"] is None:  # as vLLM: the echoed prompt's log-probs are prompt log-probs
        ks["prompt_logprobs"] = ks["logprobs"]
    if limits is not None:
        early_limits(req, limits, ks["prompt_logprobs"], ks["logprobs"], max_tokens)
    prompts = prompt_ids(req, tokenize, vocab_size)
    return Plan(prompts, max_tokens == 1, max(ks["prompt_logprobs"] or 0, ks["logprobs"] or 0, 1),
                ks["prompt_logprobs"], ks["logprobs"], float(temperature), max_tokens, req.n)


def _prompt_list(req: CompletionRequest) -> list:
    """The request's prompts as a list (each a string or a list of ids); 400 when there is none."""
    p = req.prompt
    if isinstance(p, str):
        p = [p]
    if not p:
        raise CompatError(400, "prompt: at least one prompt is required", "prompt")
    return [p] if isinstance(p[0], int) else p


def in_vocab(ids: list[int], vocab_size: int, name: str) -> None:
    """400 naming the first id of `ids` outside [0, vocab_size), as `{name}[j]` (Python ints: ids
    beyond int64 are named too, not overflowed)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        j = next(j for j, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise CompatError(400, f"{name}[{j}]: token id {ids[j]} is outside the vocabulary [0, {vocab_size})", f"{name}[{j}]")


def prompt_ids(req: CompletionRequest, tokenize, vocab_size: int | None = None) -> list[list[int]]:
    """The prompt(s) as token id lists; text is tokenized with the teacher's tokenizer. Given ids
    are checked against `vocab_size` (400 naming `prompt[j]` or `prompt[i][j]`)."""
    flat = isinstance(req.prompt, list) and bool(req.prompt) and isinstance(req.prompt[0], int)
    out = []
    for i, one in enumerate(_prompt_list(req)):
        if isinstance(one, str):
            if tokenize is None:
                raise CompatError(400, f"prompt[{i}]: text prompts need the teacher's tokenizer; send token ids", f"prompt[{i}]")
            one = tokenize(one, req.add_special_tokens)
        elif vocab_size is not None:
            in_vocab(one, vocab_size, "prompt" if flat else f"prompt[{i}]")
        if not one:
            raise CompatError(400, f"prompt[{i}]: empty prompt", f"prompt[{i}]")
        out.append(list(one))
    return out


def early_limits(req: CompletionRequest, limits: RequestLimits, prompt_k: int | None, logprobs_k: int | None,
                 max_tokens: int) -> None:
    """Refuses (413, not retryable as is) from the request's counts alone, before any text is
    tokenized or anything scored: more prompts than `max_prompts`, more token ids than
    `max_tokens`, or an answer whose JSON would exceed `max_answer_bytes` by `json_bytes_estimate`
    over a lower bound of the positions (a text prompt counts one token), so nothing that would
    fit is refused here; the estimate over the tokenized prompts follows."""
    prompts = _prompt_list(req)
    prompt_counts(prompts, limits)
    lengths = [1 if isinstance(one, str) else len(one) for one in prompts]
    counts = Plan([], max_tokens == 1, 1, prompt_k, logprobs_k, 1.0, max_tokens, req.n)
    estimate = json_bytes_estimate(counts, lengths)
    if estimate > limits.max_answer_bytes:
        raise answer_too_large(estimate, limits.max_answer_bytes)


def prompt_counts(prompt, limits: RequestLimits) -> None:
    """413 for more prompts than `limits.max_prompts` or more token ids than `limits.max_tokens`
    in `prompt` (the request's field, parsed JSON or validated: a string, a list of ids, a list of
    strings or lists); anything else is left to the field validation."""
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int | bool):
        given = len(prompt) if isinstance(prompt, list) else 0
        count = 1
    else:
        count = len(prompt)
        if count > limits.max_prompts:
            raise CompatError(413, f"prompt: {count} prompts exceed the server's limit of {limits.max_prompts} per "
                                   "request (max_sequences_per_request)", "prompt")
        given = sum(len(one) for one in prompt if isinstance(one, list))
    if given > limits.max_tokens:
        raise CompatError(413, f"prompt: {given} token ids exceed the server's limit of {limits.max_tokens} per request "
                               "(max_tokens_per_request)", "prompt")


def answer_too_large(estimate: int, limit: int) -> CompatError:
    """413: the answer's estimated JSON size is over the server's message limit."""
    return CompatError(413, f"prompt: an answer of about {estimate} bytes of JSON would exceed the server's message limit "
                            f"of {limit} bytes; split the request or ask fewer log-probs", "prompt")


def json_bytes_estimate(p: Plan, lengths: list[int] | None = None) -> int:
    """An estimate of the JSON answer's size (entries x JSON_ENTRY_BYTES), to refuse before scoring;
    with max_tokens > 1, every one of the n completions at its longest. `lengths`: the prompts'
    lengths (default: those of `p.prompts`)."""
    copies, generated = (p.n, p.n * p.max_tokens) if p.sample else (1, int(p.generate))  # each choice repeats its prompt's
    positions = sum(n * copies + generated for n in (lengths if lengths is not None else map(len, p.prompts)))
    per_position = (p.prompt_k or 0) + (p.logprobs_k or 0) + 2
    return positions * per_position * JSON_ENTRY_BYTES


def completion_logprobs(ids: list[int], s: SequenceScores | None, p: Plan, echo: bool, decode: Decoder) -> dict | None:
    """The OpenAI `logprobs` object over the echoed prompt (if echo; its top entries, as vLLM's,
    are the prompt log-probs': `prompt_logprobs`, else `logprobs`) and the completion token."""
    if p.logprobs_k is None:
        return None
    k = p.logprobs_k
    tokens, token_lps, tops = [], [], []
    if echo:
        tokens, token_lps, tops = logprob_entries(ids, s, p.prompt_k or 0, decode, first=True)
    if p.generate:
        row_ids, row_lps = s.topk_ids[-1].tolist(), s.topk_logprobs[-1].tolist()
        tokens.append(decode(row_ids[0]))
        token_lps.append(lp_clamped(row_lps[0]))
        tops.append({decode(row_ids[r]): lp_clamped(row_lps[r]) for r in range(max(k, 1))} if k else {decode(row_ids[0]): lp_clamped(row_lps[0])})
    return logprobs_object(tokens, token_lps, tops)


def completion_response(req: CompletionRequest, p: Plan, scores: list[SequenceScores | None], served_model: str,
                        decode: Decoder, fingerprint: str = "eopd") -> dict:
    """vLLM's CompletionResponse for `p`'s prompts and their scores (None: nothing was scored)."""
    choices = []
    prompt_tokens = 0
    for i, (ids, s) in enumerate(zip(p.prompts, scores, strict=True)):
        prompt_tokens += len(ids)
        gen_id = int(s.topk_ids[-1, 0]) if p.generate and s is not None else None
        text = "".join(decode(t) or "" for t in ids) if req.echo else ""
        if gen_id is not None:
            text += decode(gen_id) or ""
        choice: dict = {"index": i, "text": text, "logprobs": completion_logprobs(ids, s, p, req.echo, decode),
                        "finish_reason": "length", "stop_reason": None}
        if p.prompt_k is not None:
            choice["prompt_logprobs"], choice["prompt_entropies"] = prompt_logprobs(ids, s, p.prompt_k, decode)
        choice["prompt_token_ids"] = ids if req.return_token_ids else None
        choice["token_ids"] = ([gen_id] if gen_id is not None else []) if req.return_token_ids else None
        choices.append(choice)
    return response_envelope(choices, prompt_tokens, len(choices) if p.generate else 0, served_model, fingerprint)


def response_envelope(choices: list[dict], prompt_tokens: int, completion_tokens: int, served_model: str,
                      fingerprint: str) -> dict:
    """vLLM's CompletionResponse around `choices`, with its usage counts."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served_model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                  "completion_tokens": completion_tokens, "prompt_tokens_details": None, "completion_tokens_details": None},
        "kv_transfer_params": None,
    }


def scored_tokens(p: Plan) -> list[np.ndarray]:
    """The token ids each prompt is scored as: the prompt, plus a filler token (id 0) when the
    next token is wanted (the last position's distribution is then the next-token one)."""
    return [np.asarray(ids + [0] if p.generate else ids, dtype=np.int64) for ids in p.prompts]
