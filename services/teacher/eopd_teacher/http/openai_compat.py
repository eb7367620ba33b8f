"""vLLM-compatible scoring on the teacher's HTTP side: `POST /v1/completions`, `GET /v1/models`
and `GET /health`, for trainers that speak vLLM's OpenAI server (TRL's
`VLLMClient.get_sequence_logprobs`, verl's teacher pool).

One scoring path: a request becomes the core `ScoreRequest` the gRPC front end's requests become
too, served by the same `TeacherService` (the same validation, per-request and per-client limits,
batcher, engine and metrics); only the JSON shapes differ (`openai_format.py`). `max_tokens` > 1
becomes a core `GenerateRequest` served by the service's `generate` (the prompts' own log-probs,
when asked, by a ScoreRequest first), answered in vLLM's shape (`openai_generation.py`). The
validation's messages name the request's fields as vLLM's (`prompt[3]`, `max_tokens`): the
`FieldNames` below. Auth is the HTTP app's bearer token. Errors are
in vLLM's shape (`{"error": {"message", "type", "param", "code"}}`) with the field named: 400
for a wrong field, 404 for another model, 413 over a per-request limit, 429 when overloaded, 503
while loading or draining.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..serving.service import CLIENT_ID_HEADER, TeacherService, client_from
from ..serving.status import describe
from ..types import GeneratePrompt, GenerateRequest, Generation, ScoreRequest, ScoreSequence, SequenceScores
from ..validation import FieldNames, RequestTooLarge
from . import json_in
from .admission import Admission, peer_address, peer_share_key, until_disconnected
from .json_out import answer_bytes
from .openai_format import (
    CompatError,
    CompletionRequest,
    Decoder,
    Plan,
    RequestLimits,
    answer_too_large,
    completion_response,
    error_body,
    json_bytes_estimate,
    plan,
    prompt_counts,
    scored_tokens,
    validation_error,
)
from .openai_generation import Sampling, generation_response, sampling

log = logging.getLogger("eopd_teacher")

METHOD = "/v1/completions"
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 499,
}
# The service's fields under the vLLM request's names: a prompt is its token ids (`prompt[3][5]`);
# scoring's top-k is `prompt_logprobs`, Generate's `logprobs`.
_SCORE_RENAMED = {"top_k": "prompt_logprobs"}
_GENERATE_NAMES = FieldNames("prompt", nested=False, renamed={
    "max_new_tokens": "max_tokens", "num_samples": "n", "score_temperature": "temperature", "top_k": "logprobs"})
BODY_BYTES_PER_TOKEN = 16  # a token id as JSON takes at most 7 bytes ("49151, "); text a few bytes a token
_PARAM = re.compile(r"^([a-z_]+(?:\[\d+\])*)")


def body_limit(max_message_bytes: int, max_tokens_per_request: int) -> int:
    """The largest request body read: what the admissible tokens need as JSON (BODY_BYTES_PER_TOKEN
    each, at least 1 MiB for text prompts), never over the message limit; the body is parsed into
    Python objects, so it is kept near what a request may hold."""
    return min(max_message_bytes, max(BODY_BYTES_PER_TOKEN * max_tokens_per_request, 1 << 20))


def _compat_error(exc: BaseException) -> CompatError:
    """The service's exception as a vLLM-shaped error (its message already names vLLM's fields):
    status mapped (a per-request limit: 413, not retryable as is; overload: 429), the field named
    in `param` when the message starts with it."""
    code, message = describe(exc)
    status = 413 if isinstance(exc, RequestTooLarge) else HTTP_STATUS.get(code, 500)
    m = _PARAM.match(message)
    param = m.group(1) if m and status in (400, 413) and (":" in message[: m.end() + 1]) else None
    return CompatError(status, message, param)


def _f32(x: float) -> float:
    """`x` rounded to float32, as a float field of the gRPC wire carries it (the service's floats are
    float32 values, so both front ends compute the same statistics)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def parse_request(raw: bytes, limits: RequestLimits | None = None) -> CompletionRequest:
    """The body as a CompletionRequest; 400 naming the problem for anything the parser cannot take
    (not JSON, not UTF-8, nested too deep, not an object, a wrong field). With `limits`, the prompt
    count and the token ids given are checked (413) before the fields are validated."""
    try:
        data = json_in.loads(raw)
    except json_in.TooDeep:
        raise CompatError(400, "body: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CompatError(400, f"body: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CompatError(400, "body: must be a JSON object")
    if limits is not None:
        prompt_counts(data.get("prompt"), limits)
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


class CompletionsRoute:
    """The handlers: JSON <-> core types around the teacher's service. What costs CPU in
    proportion to the request (parsing, tokenizing, building and encoding the answer) runs in a
    worker thread (`asyncio.to_thread`), never on the event loop every other client shares."""

    def __init__(self, service: TeacherService):
        self.service = service
        self.state = service.state
        self._decoder: Decoder | None = None
        self.admission = Admission(service.state)

    def _tokenizer(self):
        return self.state.engine.tokenizer

    def decoder(self) -> Decoder:
        if self._decoder is None:
            self._decoder = Decoder(self._tokenizer())
        return self._decoder

    def _tokenize(self):
        tok = self._tokenizer()
        if tok is None:
            return None
        return lambda text, special: tok(text, add_special_tokens=special)["input_ids"]

    def _finish(self, code: str, started: float) -> None:
        m = self.state.metrics
        m.requests.labels(METHOD, code).inc()
        if code != "OK":
            m.errors.labels(code).inc()
        m.latency.labels(METHOD).observe(time.perf_counter() - started)

    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        s = self.state.settings
        try:
            async with self.admission.admitted(request, body_limit(s.max_message_bytes, s.max_tokens_per_request)) as raw:
                body = await until_disconnected(request, self._complete(request, raw))
        except CompatError as exc:
            code = {400: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED",
                    503: "UNAVAILABLE", 499: "CANCELLED"}.get(exc.status, "INTERNAL")
            self._finish(code, started)
            return JSONResponse(error_body(exc.status, str(exc), exc.param), status_code=exc.status)
        self._finish("OK", started)
        return Response(body, media_type="application/json")

    async def _complete(self, request: Request, raw: bytes) -> bytes:
        s = self.state.settings
        limits = RequestLimits(s.max_sequences_per_request, s.max_tokens_per_request, s.max_message_bytes)
        req = await asyncio.to_thread(parse_request, raw, limits)
        try:
            info, _ = self.state.check_ready()
        except Exception as exc:  # noqa: BLE001 - loading / draining: 503
            raise _compat_error(exc) from None
        p = await asyncio.to_thread(plan, req, served_model=info.model_name, max_top_k=info.max_top_k,
                                    vocab_size=info.vocab_size, tokenize=self._tokenize(),
                                    max_new_tokens=info.max_new_tokens, limits=limits)
        sample = sampling(req, info.vocab_size) if p.sample else None
        estimate = json_bytes_estimate(p)
        if estimate > s.max_message_bytes:
            raise answer_too_large(estimate, s.max_message_bytes)
        scores = await self._score(request, p, req.echo)
        fingerprint = f"eopd-{info.server_version}"
        if sample is None:
            return await asyncio.to_thread(
                lambda: answer_bytes(completion_response(req, p, scores, info.model_name, self.decoder(), fingerprint)))
        generations = await self._generate(request, p, sample)
        text_of, eos_id = self._text_of(req.skip_special_tokens), self._eos_id()
        return await asyncio.to_thread(lambda: answer_bytes(generation_response(
            req, p, scores, generations, info.model_name, self.decoder(), text_of, eos_id, fingerprint)))

    def _text_of(self, skip_special_tokens: bool):
        """A completion's text as vLLM's detokenizer gives it: the served tokenizer's decode of the
        ids (special tokens skipped as the request says); without a tokenizer, the per-token join."""
        tok = self._tokenizer()
        if tok is None:
            decode = self.decoder()
            return lambda ids: "".join(decode(t) or "" for t in ids)
        return lambda ids: tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def _share(self, request: Request) -> str:
        """Whose share of the global limits the request counts against (`admission.peer_share_key`)."""
        return peer_share_key(request, self.service.state.identities)

    def _eos_id(self) -> int | None:
        return getattr(self._tokenizer(), "eos_token_id", None)

    async def _generate(self, request: Request, p: Plan, sample: Sampling) -> list[list[Generation]]:
        """The n completions of every prompt of `p`, by the service's `generate` (its validation,
        limits, engine and metrics), grouped by prompt in sample order."""
        try:
            req = GenerateRequest(
                prompts=[GeneratePrompt(str(i), np.asarray(ids, dtype=np.int64)) for i, ids in enumerate(p.prompts)],
                num_samples=p.n, max_new_tokens=p.max_tokens, temperature=_f32(sample.temperature), top_p=_f32(sample.top_p),
                stop_token_ids=tuple(sample.stop_token_ids), seed=sample.seed, top_k=max(p.logprobs_k or 0, 1),
                score_temperature=_f32(p.temperature))
            generations = self.service.generate(req, _client(request), _GENERATE_NAMES, share_key=self._share(request))
            answers = [g async for g in generations]
        except Exception as exc:  # noqa: BLE001 - every failure is answered in vLLM's shape
            err = _compat_error(exc)
            if err.status == 500:
                log.error("/v1/completions (generation) failed: %s", err, exc_info=exc)
            raise err from None
        out: list[list[Generation]] = [[] for _ in p.prompts]
        for g in sorted(answers, key=lambda g: (int(g.prompt_id), g.sample_index)):
            out[int(g.prompt_id)].append(g)
        return out

    async def _score(self, request: Request, p: Plan, echo: bool) -> list[SequenceScores | None]:
        """Scores every prompt of `p` that needs it, by the service's `score`; the validation names
        each by its position in the request (`prompt[3]`), not among those scored."""
        wanted = p.generate or p.prompt_k is not None or (p.logprobs_k is not None and echo)
        seqs = scored_tokens(p)
        index = [i for i, ids in enumerate(seqs) if wanted and len(ids) >= 2]
        if not index:
            return [None] * len(seqs)
        req = ScoreRequest(sequences=[ScoreSequence(str(i), seqs[i], 1) for i in index], top_k=p.top_k,
                           temperature=_f32(p.temperature))
        names = FieldNames("prompt", nested=False, positions=index, renamed=_SCORE_RENAMED)
        try:
            results = await self.service.score(req, _client(request), names, share_key=self._share(request))
        except Exception as exc:  # noqa: BLE001 - every failure is answered in vLLM's shape
            err = _compat_error(exc)
            if err.status == 500:
                log.error("/v1/completions failed: %s", err, exc_info=exc)
            raise err from None
        out: list[SequenceScores | None] = [None] * len(seqs)
        for i, r in zip(index, results, strict=True):
            out[i] = r
        return out


def _client(request: Request) -> str:
    """Who a request is from, for per-client limits, as on gRPC: the x-eopd-client header, else
    the peer address."""
    return client_from(request.headers.get(CLIENT_ID_HEADER), peer_address(request))


def create_router(service: TeacherService) -> APIRouter:
    """`POST /v1/completions`, `GET /v1/models`, `GET /health` (vLLM's liveness: 200 once ready)."""
    router = APIRouter()
    route = CompletionsRoute(service)
    state = service.state
    router.add_api_route(METHOD, route.completions, methods=["POST"], include_in_schema=False)

    @router.get("/v1/models", responses={503: {"description": "the model is still loading (vLLM's error shape)"}})
    async def models() -> JSONResponse:
        info = state.info
        if info is None:
            return JSONResponse(error_body(503, "the model is still loading; retry shortly"), status_code=503)
        card = {"id": info.model_name, "object": "model", "created": int(time.time()), "owned_by": "eopd",
                "root": info.model_name, "parent": None, "max_model_len": info.max_context_length, "permission": []}
        return JSONResponse({"object": "list", "data": [card]})

    @router.get("/health", response_class=Response, responses={200: {"description": "requests are accepted"},
                                                                503: {"description": "loading, draining or engine unhealthy"}})
    async def health() -> Response:
        """vLLM's `/health`: 200 when requests are accepted, 503 otherwise (TRL's client polls it)."""
        return Response(status_code=200 if state.ready else 503)

    return router
