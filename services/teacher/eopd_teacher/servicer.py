"""`eopd.v1.TeacherService`: validate, queue on the batcher, convert back. The ScoreStream loop
itself is `stream_session.StreamSession`; Generate's jobs are `generate_jobs`."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc

from .batcher import DynamicBatcher, Overloaded
from .convert import STREAM_ENDING_KEY, info_to_pb, items_from_request, scores_to_pb
from .convert_generate import generate_items_from_request, generation_to_pb
from .state import ServerState
from .status import DeadlinePassed, NotReady, describe
from .stream_session import StreamSession
from .types import GenerateItem, Generation

log = logging.getLogger("eopd_teacher")


def wants_stream_ending(context: grpc.aio.ServicerContext) -> bool:
    return any(k == STREAM_ENDING_KEY and v == "1" for k, v in context.invocation_metadata() or ())


CLIENT_ID_HEADER = "x-eopd-client"


def client_key(context: grpc.aio.ServicerContext) -> str:
    """Who a request is from, for per-client limits and the batcher's fair queuing: the
    x-eopd-client metadata, else the peer address without its port."""
    given = next((v for k, v in context.invocation_metadata() or () if k == CLIENT_ID_HEADER and v), None)
    return client_from(given, (context.peer() or "unknown").rsplit(":", 1)[0])


def client_from(given: str | None, peer: str) -> str:
    """The client key of both front ends (gRPC, HTTP): `id:<x-eopd-client>` (at most 128
    characters) when the caller names itself, else its peer address without the port."""
    return f"id:{given}"[:128] if given else peer


def generate_tokens(item: GenerateItem) -> int:
    """What generating `item` holds: (prompt + max_new_tokens) x num_samples tokens."""
    return (len(item.token_ids) + item.max_new_tokens) * item.num_samples


def generate_jobs(items: list[GenerateItem], max_tokens: int) -> Iterator[list[GenerateItem]]:
    """Consecutive runs of `items` of at most `max_tokens` (`generate_tokens`) each, at least one
    item per run: one engine job each, so a large request leaves the engine to scoring batches
    between its jobs, its answers are sent as each job ends, and what is not yet started is
    withdrawn when the caller goes away."""
    job: list[GenerateItem] = []
    used = 0
    for item in items:
        tokens = generate_tokens(item)
        if job and used + tokens > max_tokens:
            yield job
            job, used = [], 0
        job.append(item)
        used += tokens
    if job:
        yield job


class TeacherServicer(pb_grpc.TeacherServiceServicer):
    """Short delegations: validate, queue on the batcher, convert back."""

    def __init__(self, state: ServerState):
        self.state = state

    @contextlib.contextmanager
    def _in_flight(self, client: str, tokens: int) -> Iterator[None]:
        """Holds `tokens` of `client`'s per-client in-flight budget (Overloaded beyond it, unless
        the client has nothing else in flight) and the in-flight gauge while the body runs."""
        inflight = self.state.inflight_tokens
        limit = self.state.settings.max_inflight_tokens_per_client
        if inflight.get(client, 0) + tokens > limit and inflight.get(client, 0) > 0:
            raise Overloaded(f"client {client!r} has {inflight[client]} tokens in flight; this request adds {tokens}, limit {limit}")
        inflight[client] = inflight.get(client, 0) + tokens
        self.state.metrics.inflight.inc()
        try:
            yield
        finally:
            self.state.metrics.inflight.dec()
            inflight[client] -= tokens
            if inflight[client] <= 0:
                del inflight[client]

    async def _score(self, request: pb.ScoreRequest, client: str, *, stream: bool) -> pb.ScoreResponse:
        info, batcher = self.state.check_ready()
        items = items_from_request(request, info, require_request_id=stream, max_response_bytes=self.state.settings.max_message_bytes)
        with self._in_flight(client, sum(it.num_tokens for it in items)):
            results = await batcher.submit(items, client)
        m = self.state.metrics
        m.sequences.inc(len(items))
        m.tokens_scored.inc(sum(it.num_scored for it in items))
        return pb.ScoreResponse(request_id=request.request_id, results=[scores_to_pb(r) for r in results])

    def _in_band_error(self, request_id: str, exc: BaseException) -> pb.ScoreResponse:
        """The in-band answer of a ScoreStream request that failed on its own; counted like an RPC
        error (eopd_teacher_errors_total) and in eopd_teacher_stream_requests_total."""
        code, message = describe(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("ScoreStream request %r failed: %s", request_id, message, exc_info=exc)
        self.state.metrics.stream_requests.labels(code.name).inc()
        self.state.metrics.errors.labels(code.name).inc()
        return pb.ScoreResponse(request_id=request_id, error=pb.RequestError(code=code.value[0], message=message, retryable=False))

    async def score_request(self, request: pb.ScoreRequest, client: str) -> pb.ScoreResponse:
        """A unary Score from another front end (the HTTP `/v1/completions`, openai_compat.py):
        the same validation, limits, batcher and metrics as `Score`."""
        return await self._score(request, client, stream=False)

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        return await self._score(request, client_key(context), stream=False)

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        """Serves requests concurrently as they arrive (at most
        stream_session.MAX_INFLIGHT_PER_STREAM at once: beyond that, reading pauses and HTTP/2
        flow control pushes back on the client). A request that fails on its own (invalid, over a
        per-request limit, an engine error, a request_id already in flight) is answered in band
        (`ScoreResponse.error`) and the stream goes on. A stream-level failure (overload,
        draining) ends the stream with its error without waiting for the client to send more,
        after the requests already in flight are answered (and, for a client that asked with
        `eopd-stream-ending: 1`, after announcing the end and letting it half-close)."""
        if self.state.open_streams >= self.state.settings.max_streams:
            raise Overloaded(f"{self.state.open_streams} streams open, limit {self.state.settings.max_streams}; retry later")
        self.state.open_streams += 1
        try:
            session = StreamSession(self, client_key(context), announce=wants_stream_ending(context))
            async for response in session.responses(request_iterator):
                yield response
        finally:
            self.state.open_streams -= 1

    async def _generate(self, request: pb.GenerateRequest, client: str, deadline: float | None) -> AsyncIterator[pb.GenerateResponse]:
        """Validates the whole request, then runs its jobs (`generate_jobs`) one after another on
        the batcher and yields each generation as its job ends (prompt order, samples in order).
        `deadline` (time.monotonic(); None: none): no job starts after it."""
        info, batcher = self.state.check_ready()
        s = self.state.settings
        items = generate_items_from_request(request, info, max_response_bytes=s.max_message_bytes)
        m = self.state.metrics
        with self._in_flight(client, sum(generate_tokens(it) for it in items)):
            for job in generate_jobs(items, s.max_batch_tokens):
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlinePassed(f"the call's deadline passed before prompt {job[0].prompt_id!r} was generated")
                generations = await self._run_generate_job(batcher, job, deadline)
                m.generations.inc(len(generations))
                m.tokens_generated.inc(sum(len(g.token_ids) for g in generations))
                for g in generations:
                    yield generation_to_pb(request.request_id, g)

    async def _run_generate_job(self, batcher: DynamicBatcher, job: list[GenerateItem], deadline: float | None) -> list[Generation]:
        """One engine job on the batcher; the engine is told to stop (`cancelled`) once this call
        is cancelled or its deadline has passed, so an abandoned generation frees the engine."""
        gone = threading.Event()

        def cancelled() -> bool:
            return gone.is_set() or (deadline is not None and time.monotonic() >= deadline)

        engine = self.state.engine
        try:
            return await batcher.submit_job(functools.partial(engine.generate, job, cancelled=cancelled),
                                            sum(generate_tokens(it) for it in job))
        except BaseException:
            gone.set()
            raise

    async def generate_request(self, request: pb.GenerateRequest, client: str) -> list[pb.GenerateResponse]:
        """A Generate from another front end (the HTTP `/v1/completions`): the same validation,
        limits, batcher and metrics as `Generate`; every answer, in prompt then sample order."""
        return [r async for r in self._generate(request, client, None)]

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        async for response in self._generate(request, client_key(context), deadline):
            yield response

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self.state.info is None:
            raise NotReady("the model is still loading; retry shortly")
        return info_to_pb(self.state.info)
