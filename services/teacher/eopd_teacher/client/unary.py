"""The two clients: `TeacherClient` (blocking) and `AsyncTeacherClient` (asyncio). Their unary
calls retry here (`CallPlan`); their `score_stream` methods delegate to `sync_stream.py`
(blocking) and `stream.py` (asyncio)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import grpc

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc

from ..convert import generation_from_pb, head_from_pb, info_from_pb, scores_from_pb
from ..types import Generation, ModelInfo, SequenceScores
from . import stream, sync_stream
from .channel import CallPlan, ChannelClient, StreamTransport
from .requests import RequestFailed, ScoreBatch, build_generate_request, build_request
from .stream import StallReport

if TYPE_CHECKING:  # torch: a client-only install imports the client without it (only output_head() needs it)
    from eopd_common.output_head import OutputHead


def _in_request_order(request: pb.GenerateRequest, answers: list[pb.GenerateResponse]) -> list[Generation]:
    """Generate's answers (sent in any order) by prompt in request order, then sample index."""
    rank = {p.id: i for i, p in enumerate(request.prompts)}
    return [generation_from_pb(r) for r in sorted(answers, key=lambda r: (rank.get(r.prompt_id, len(rank)), r.sample_index))]


class TeacherClient(ChannelClient):
    """Blocking client. Thread-safe; use as a context manager or call close()."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._connect()

    def _connect(self) -> None:
        """Opens the channel and its stub."""
        if self._credentials is not None:
            self._channel = grpc.secure_channel(self.target, self._credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.TeacherServiceStub(self._channel)

    def _transport(self) -> StreamTransport:
        """What `sync_stream` needs of this client."""
        return StreamTransport(self.target, self.metadata, self.timeout, self.retry_timeout, self.retryable,
                               lambda *a, **kw: self._stub.ScoreStream(*a, **kw), self.should_retry)

    def __enter__(self) -> TeacherClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, fn, request, timeout: float | None, retry_timeout: float | None = None):
        plan = CallPlan(self, timeout, retry_timeout)
        while True:
            try:
                return fn(request, timeout=plan.attempt_timeout(), metadata=self.metadata)
            except grpc.RpcError as err:
                delay = plan.retry_delay(err)
                if delay is None:
                    raise
                time.sleep(delay)

    def info(self, timeout: float | None = None, retry_timeout: float | None = None) -> ModelInfo:
        """The served model. `retry_timeout` overrides the client's retry budget (0: one attempt)."""
        return info_from_pb(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, retry_timeout))

    def wait_ready(self, timeout: float = 120.0) -> ModelInfo:
        """Blocks until the server answers GetModelInfo (model loaded), or raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return info_from_pb(self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5, metadata=self.metadata))
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"teacher at {self.target} not ready after {timeout}s: {err.details()}") from err
                time.sleep(0.2)

    def score(
        self, sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "", timeout: float | None = None,
        hidden_states: str = "",
    ) -> list[SequenceScores]:
        """Scores sequences (SequenceInput, (id, token_ids, score_from) or dicts), in order;
        `hidden_states` ("bfloat16", "float32") asks for the final hidden states too."""
        req = build_request(sequences, top_k=top_k, temperature=temperature, request_id=request_id,
                            hidden_states=hidden_states)
        resp = self._call(self._stub.Score, req, timeout)
        return [scores_from_pb(r) for r in resp.results]

    def output_head(self, timeout: float | None = None) -> OutputHead:
        """The teacher's output head (GetOutputHead), its size and fingerprint checked (ValueError
        otherwise). Retried, the whole stream, as unary calls are."""
        return head_from_pb(self._call(lambda r, **kw: list(self._stub.GetOutputHead(r, **kw)),
                                       pb.GetOutputHeadRequest(), timeout))

    def generate(
        self, prompts, *, num_samples: int = 1, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        stop_token_ids: Iterable[int] = (), seed: int | None = None, top_k: int = 0, score_temperature: float = 1.0,
        request_id: str = "", timeout: float | None = None, hidden_states: str = "",
    ) -> list[Generation]:
        """Samples `num_samples` responses per prompt (a list of token-id lists, ids "0", "1", ...,
        or a dict {prompt id: token ids}); returns them by prompt, then sample index, each with
        the statistics Score gives at its positions (at `score_temperature`). temperature 0 is
        greedy. Retried (the whole call) as unary calls are."""
        req = build_generate_request(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, stop_token_ids=stop_token_ids, seed=seed, top_k=top_k,
                                     score_temperature=score_temperature, request_id=request_id,
                                     hidden_states=hidden_states)
        answers = self._call(lambda r, **kw: list(self._stub.Generate(r, **kw)), req, timeout)
        return _in_request_order(req, answers)

    def score_stream(
        self, batches: Iterable[ScoreBatch], timeout: float | None = None, *, on_error: str = "raise"
    ) -> Iterator[tuple[str, list[SequenceScores] | RequestFailed]]:
        """Pipelines requests on one stream; yields (request_id, scores) as answers arrive (in any
        order). A request that fails on its own (answered in band) raises `RequestFailed`
        (`on_error="raise"`, default) or is yielded as (request_id, RequestFailed) (`on_error="yield"`)
        and the stream goes on. Submitting a request_id already in flight raises ValueError. No
        re-sending here (in-band retryable errors are reported like the others, and no stall is
        watched for): use AsyncTeacherClient.score_stream for that."""
        return sync_stream.sync_score_stream(self._transport(), batches, timeout, on_error)


class AsyncTeacherClient(ChannelClient):
    """asyncio client; create and use it inside one running event loop."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._connect()

    def _connect(self) -> None:
        """Opens the channel and its stub (the one place an asyncio channel is made)."""
        if self._credentials is not None:
            self._channel = grpc.aio.secure_channel(self.target, self._credentials, options=self._options)
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.TeacherServiceStub(self._channel)

    async def _reconnect(self) -> None:
        """Replaces the channel with a new one (same options and credentials, its own
        connections: a stalled one is not reused) and closes the old one within 5 s, its errors
        suppressed; calls still running on the old channel end (CANCELLED)."""
        old = self._channel
        self._connect()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.close(), 5)

    def _transport(self) -> StreamTransport:
        """What `stream` needs of this client: ScoreStream calls open on the channel of the moment
        (`reconnect` replaces it)."""
        return StreamTransport(self.target, self.metadata, self.timeout, self.retry_timeout, self.retryable,
                               lambda *a, **kw: self._stub.ScoreStream(*a, **kw), self.should_retry, self._reconnect)

    async def __aenter__(self) -> AsyncTeacherClient:
        return self

    async def wait_connected(self, timeout: float) -> None:
        """Returns once the channel is connected (TimeoutError after `timeout` s): a load test's
        clients connect before its clock starts."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout)

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, fn, request, timeout: float | None, retry_timeout: float | None = None):
        plan = CallPlan(self, timeout, retry_timeout)
        while True:
            try:
                return await fn(request, timeout=plan.attempt_timeout(), metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                delay = plan.retry_delay(err)
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    async def info(self, timeout: float | None = None, retry_timeout: float | None = None) -> ModelInfo:
        """The served model. `retry_timeout` overrides the client's retry budget (0: one attempt)."""
        return info_from_pb(await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, retry_timeout))

    async def score(
        self, sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "", timeout: float | None = None,
        hidden_states: str = "",
    ) -> list[SequenceScores]:
        req = build_request(sequences, top_k=top_k, temperature=temperature, request_id=request_id,
                            hidden_states=hidden_states)
        resp = await self._call(self._stub.Score, req, timeout)
        return [scores_from_pb(r) for r in resp.results]

    async def output_head(self, timeout: float | None = None) -> OutputHead:
        """As `TeacherClient.output_head`."""

        async def collect(r, **kw) -> list[pb.OutputHeadChunk]:
            return [chunk async for chunk in self._stub.GetOutputHead(r, **kw)]

        return head_from_pb(await self._call(collect, pb.GetOutputHeadRequest(), timeout))

    async def generate(
        self, prompts, *, num_samples: int = 1, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        stop_token_ids: Iterable[int] = (), seed: int | None = None, top_k: int = 0, score_temperature: float = 1.0,
        request_id: str = "", timeout: float | None = None, hidden_states: str = "",
    ) -> list[Generation]:
        """As `TeacherClient.generate`."""
        req = build_generate_request(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, stop_token_ids=stop_token_ids, seed=seed, top_k=top_k,
                                     score_temperature=score_temperature, request_id=request_id,
                                     hidden_states=hidden_states)

        async def collect(r, **kw) -> list[pb.GenerateResponse]:
            return [answer async for answer in self._stub.Generate(r, **kw)]

        return _in_request_order(req, await self._call(collect, req, timeout))

    def score_stream(
        self,
        batches: AsyncIterable[ScoreBatch] | Iterable[ScoreBatch],
        *,
        max_in_flight: int = 16,
        timeout: float | None = None,
        streams: int = 1,
        on_error: str = "raise",
        stall_timeout_s: float | None = None,
        give_up_s: float | None = None,
        on_stall: Callable[[StallReport], None] | None = None,
    ) -> AsyncIterator[tuple[str, list[SequenceScores] | RequestFailed]]:
        """Pipelines requests (at most `max_in_flight` unanswered, over all streams) and yields
        (request_id, scores) as answers arrive. Request ids must be unique among the unanswered
        ones (empty ones are filled in): submitting an id already in flight raises ValueError.

        `streams` ScoreStream calls are opened on the channel and requests are spread over them
        (each new request goes to the stream with the fewest unanswered); with a multi-address or
        `dns:///` target and round_robin, gRPC places the calls on different replicas.

        A request that fails on its own is answered in band (`ScoreResponse.error`). A retryable
        one is re-sent on its stream after a backoff (until `retry_timeout`); otherwise, with
        `on_error="raise"` (default) `RequestFailed` is raised (after the answers that arrived
        before it), with `on_error="yield"` `(request_id, RequestFailed)` is yielded in place of
        the scores and the stream goes on.

        When a stream breaks with a retryable status, its unanswered requests are re-sent on a new
        stream after a backoff; each request_id is yielded exactly once. A stream-level status that
        is not retried (e.g. UNAUTHENTICATED) is raised as grpc.aio.AioRpcError. A broken stream
        never cancels the source: the source is read by one task, apart from the streams, and may
        be any iterable or async iterable (an async generator included).

        Stalls (a path that goes silent without an error: a dead middlebox, a partitioned link, a
        hung teacher): with `stall_timeout_s` set, when requests are written and unanswered and
        nothing at all has come from the teacher for `stall_timeout_s` (counted from its last
        message, or from the oldest outstanding write if later; answers are stamped on arrival, so
        a slow consumer never looks like a stall), `on_stall(StallReport)` is called, the client
        moves to a new channel (`_reconnect`: the old one is closed, and calls other tasks still
        run on it end with CANCELLED) and every unanswered request is re-sent on new streams; each
        request_id is still yielded exactly once. With `give_up_s` (which needs `stall_timeout_s`)
        a stall after `give_up_s` without a word from the teacher raises `StreamStalled` (a
        RuntimeError). None (the defaults): no stall is watched for.

        `timeout` is a deadline in seconds for the whole call, re-sends included (None, the
        default, means none: a producer may keep its streams open for as long as it runs; the
        client's `timeout` applies to unary calls only). When it passes, the streams end with
        `DEADLINE_EXCEEDED` (or with the retryable error that broke a stream, if the deadline has
        already passed when that happens)."""
        return stream.score_stream(self._transport(), batches, max_in_flight=max_in_flight, timeout=timeout, streams=streams,
                                   on_error=on_error, stall_timeout_s=stall_timeout_s, give_up_s=give_up_s,
                                   on_stall=on_stall)
