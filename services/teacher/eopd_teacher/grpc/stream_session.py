"""One ScoreStream call: a reader task reads requests and starts one handler task per request;
handlers put their answers (results or an in-band error) on a queue that `responses` hands to
gRPC.

A slot (of MAX_INFLIGHT_PER_STREAM) is held from reading a request until its answer is handed to
gRPC, so a client that stops reading answers is pushed back on too. A handler meeting a
stream-level failure (or a broken request stream) marks the stream failed at once, so the error
does not wait for the client to send or close anything: requests read after it are dropped, the
requests already in flight are answered, then the stream ends with the first error. With
`announce`, a `StreamEnding` message goes first and the end waits (at most STREAM_ENDING_GRACE_S)
for the client to half-close. If the call itself ends (cancelled by the client, deadline), every
task is cancelled, which withdraws their sequences from the batcher.

Bytes in flight: each request's wire size is taken from the server-wide `ByteBudget`
(`max_inflight_request_bytes`) once it is read and given back when its handler task ends; while
the budget is full the reader does not ask gRPC for the next message (it stays with the client, HTTP/2 flow
control); a request read that does not fit waits for room (at most BUDGET_WAIT_S, then it is
answered in band with a retryable RESOURCE_EXHAUSTED). So a stream holds at most one message
outside the budget.

A stream with no request in flight and none received for `stream_idle_timeout_s` fails with
`StreamIdle` (UNAVAILABLE, a stream-level failure like the others: the client re-opens it), so idle
streams cannot hold every one of the server's `max_streams` slots for ever (issue 17, section 3).
A stream whose client has not taken an answer handed to gRPC for `stream_idle_timeout_s` (it
stopped reading: the answer waits on HTTP/2 flow control) fails with `StreamStalled`: its requests in
flight are withdrawn, their bytes given back, its answers not yet handed to gRPC dropped, and it
reads no more; the call ends with UNAVAILABLE as soon as the client takes the answer gRPC holds (or
when its connection closes). gRPC's asyncio server cannot reset one stream whose client does not read
(neither an abort nor cancelling the handler reaches such a client), so until then the stream still
costs the one answer gRPC holds: `on_stalled` is called once it is given up, and the servicer moves
its slot from `max_streams` to a pool of given-up streams of the same size and share (issue 49:
streams that take no answers no longer hold the slots other streams need, and what they hold stays
bounded). Each request's bytes count against the stream's client's share of the byte budget
(`client`, `shares.Identities`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from eopd.v1 import teacher_pb2 as pb

from ..serving.batcher import Overloaded
from ..serving.metrics import TeacherMetrics
from ..serving.resources import ByteBudget
from ..serving.status import STREAM_LEVEL, NotReady, describe
from ..validation import InvalidRequest

log = logging.getLogger("eopd_teacher")

# Requests of one stream served at once; beyond that, reading pauses.
MAX_INFLIGHT_PER_STREAM = 64

# How long a request read while the server's byte budget cannot hold it waits for room before it is
# refused in band (RESOURCE_EXHAUSTED, retryable).
BUDGET_WAIT_S = 30.0

# How long a ScoreStream that announced its end (StreamEnding) waits for the client to half-close.
STREAM_ENDING_GRACE_S = 5.0


class StreamIdle(NotReady):
    """The stream was idle for stream_idle_timeout_s: UNAVAILABLE (the client re-opens it)."""


class StreamStalled(StreamIdle):
    """The client took no answer for stream_idle_timeout_s: UNAVAILABLE."""


# Markers on the answer queue: the stream failed (first failure only), the reader is done.
_FAILED, _END = object(), object()


def in_band_error(metrics: TeacherMetrics, request_id: str, exc: BaseException) -> pb.ScoreResponse:
    """The in-band answer of a ScoreStream request that failed on its own; counted like an RPC
    error (eopd_teacher_errors_total) and in eopd_teacher_stream_requests_total."""
    code, message = describe(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("ScoreStream request %r failed: %s", request_id, message, exc_info=exc)
    metrics.stream_requests.labels(code.name).inc()
    metrics.errors.labels(code.name).inc()
    return pb.ScoreResponse(request_id=request_id, error=pb.RequestError(code=code.value[0], message=message, retryable=False))


def stream_ending(exc: BaseException, request_id: str = "") -> pb.ScoreResponse:
    """The in-band announcement that a ScoreStream ends with `exc` (met by `request_id`; empty for a
    stream refused as it opens)."""
    code, message = describe(exc)
    return pb.ScoreResponse(ending=pb.StreamEnding(request_id=request_id, code=code.value[0], message=message))


async def announced_refusal(exc: BaseException, requests: AsyncIterator[pb.ScoreRequest],
                            grace_s: float = STREAM_ENDING_GRACE_S) -> AsyncIterator[pb.ScoreResponse]:
    """A ScoreStream refused as it opens (`exc`: over `max_streams` or the client's share of it), for
    a client that asked with `eopd-stream-ending: 1`: the StreamEnding first, then what the client
    still sends is read and dropped until it half-closes (at most `grace_s`), so that no write of the
    client races the status the caller raises next (grpc/grpc#36066)."""
    yield stream_ending(exc)

    async def drain() -> None:
        async for _ in requests:
            pass

    with contextlib.suppress(Exception):  # the grace ran out, or the request stream broke: the status follows
        await asyncio.wait_for(drain(), grace_s)


class StreamSession:
    """The loop of one ScoreStream call: `score` answers one request (the servicer's Score for
    this call's client); `budget` is the server's request-byte budget; a stream idle for
    `idle_timeout_s` fails."""

    def __init__(self, score: Callable[[pb.ScoreRequest], Awaitable[pb.ScoreResponse]], metrics: TeacherMetrics,
                 budget: ByteBudget, idle_timeout_s: float, *, announce: bool = False, client: str | None = None,
                 on_stalled: Callable[[], None] | None = None):
        self._score = score
        self._on_stalled = on_stalled  # called once when the stream is given up (`_stalled`)
        self._client = client  # whose share of the byte budget this stream's requests count against
        self._metrics = metrics
        self._announce = announce
        self._out: asyncio.Queue = asyncio.Queue()
        self._slots = asyncio.Semaphore(MAX_INFLIGHT_PER_STREAM)
        self._failure: list[tuple[BaseException, str]] = []
        self._tasks: set[asyncio.Task] = set()
        self._inflight_ids: set[str] = set()  # request ids read and not yet answered
        self._read_all = asyncio.Event()  # the client half-closed (or its request stream broke)
        self._latency = metrics.latency.labels("ScoreStream")
        self._idle_timeout_s = idle_timeout_s
        self._last_active = time.monotonic()  # a request read or an answer handed to gRPC
        self._budget = budget
        self._waiting_room = False  # the reader waits for room in the byte budget (not idle)
        self._sending_since: float | None = None  # an answer handed to gRPC and not yet taken since then
        self._read_task: asyncio.Task | None = None
        self._stall_handled = False

    async def responses(self, request_iterator: AsyncIterator[pb.ScoreRequest]) -> AsyncIterator[pb.ScoreResponse]:
        """The answers, in the order they are ready; raises the stream's failure at its end."""
        self._read_task = read_task = asyncio.get_running_loop().create_task(self._read(request_iterator))
        idle_task = asyncio.get_running_loop().create_task(self._watch_idle())
        try:
            while (item := await self._out.get()) is not _END and item is not _FAILED:
                self._sending_since = time.monotonic()
                yield item
                self._sending_since = None
                self._last_active = time.monotonic()
                self._slots.release()
            if self._failure:
                async with contextlib.aclosing(self._after_failure()) as rest:
                    async for item in rest:
                        self._sending_since = time.monotonic()
                        yield item
                        self._sending_since = None
        finally:
            read_task.cancel()
            idle_task.cancel()
            self._cancel_all()

    async def _watch_idle(self) -> None:
        """Fails the stream once it has been idle (nothing in flight, nothing read) for the timeout;
        gives it up once an answer handed to gRPC has not been taken by the client for the timeout
        (`_stalled`), even after the stream failed or the client half-closed."""
        while not self._failure and not self._read_all.is_set():
            if self._stalled():
                return
            now = time.monotonic()
            left = self._last_active + self._idle_timeout_s - now
            if self._sending_since is not None:  # an answer is on its way to the client: `_stalled` decides
                await asyncio.sleep(max(0.01, self._sending_since + self._idle_timeout_s - now))
            elif left > 0:
                await asyncio.sleep(left)
            elif self._tasks or not self._out.empty() or self._waiting_room:
                self._last_active = time.monotonic()  # busy: not idle
            else:
                self._fail(StreamIdle(f"stream idle for {self._idle_timeout_s:g}s (no request in flight); "
                                      "closed by the server (stream_idle_timeout_s), re-open it to send more"), "")
                break
        while not self._stalled():  # failed or half-closed: answers may still wait on the client
            since = self._sending_since
            await asyncio.sleep(self._idle_timeout_s if since is None else max(0.01, since + self._idle_timeout_s - time.monotonic()))

    def _stalled(self) -> bool:
        """Whether the client has not taken an answer for the idle timeout; if so, the stream fails
        with StreamStalled: it reads no more, its requests in flight are withdrawn (their bytes given
        back), its answers not yet handed to gRPC are dropped (issue 33, section 2)."""
        since = self._sending_since
        if since is None or time.monotonic() - since < self._idle_timeout_s:
            return False
        if self._stall_handled:
            return True
        self._stall_handled = True
        log.warning("ScoreStream: the client took no answer for %gs (stream_idle_timeout_s); its work is withdrawn",
                    self._idle_timeout_s)
        if self._read_task is not None:
            self._read_task.cancel()
        self._cancel_all()
        while not self._out.empty():  # answers the client would not take
            self._out.get_nowait()
        self._failure.insert(0, (StreamStalled(
            f"the client took no answer for {self._idle_timeout_s:g}s; stream closed by the server "
            "(stream_idle_timeout_s), re-open it and read its answers"), ""))
        self._out.put_nowait(_FAILED)
        if self._on_stalled is not None:
            self._on_stalled()
        # Counted once its slot is freed: a scrape (another thread) never sees it given up yet still open.
        self._metrics.streams_stalled.inc()
        return True

    def _fail(self, exc: BaseException, request_id: str) -> None:
        self._failure.append((exc, request_id))
        if len(self._failure) == 1:
            self._out.put_nowait(_FAILED)

    def _answer_error(self, request_id: str, exc: BaseException, *, retryable: bool = False) -> None:
        """A request-level failure, answered in band (its slot is released once sent)."""
        answer = in_band_error(self._metrics, request_id, exc)
        answer.error.retryable = retryable
        self._out.put_nowait(answer)

    async def _handle(self, req: pb.ScoreRequest) -> None:
        started = time.perf_counter()
        try:
            response = await self._score(req)
        except STREAM_LEVEL as exc:  # load, draining, not ready: the stream's status
            self._slots.release()
            self._fail(exc, req.request_id)
            return
        except Exception as exc:  # noqa: BLE001 - this request's own failure: in band
            self._answer_error(req.request_id, exc)
            return
        finally:
            self._inflight_ids.discard(req.request_id)
        self._latency.observe(time.perf_counter() - started)
        self._metrics.stream_requests.labels("OK").inc()
        self._out.put_nowait(response)  # its slot is released once the answer is sent

    async def _take_budget(self, nbytes: int) -> bool:
        """Takes `nbytes` from the server's byte budget, waiting up to BUDGET_WAIT_S for room (the
        message already read is the one this stream holds outside the budget); False if none came."""
        deadline = time.monotonic() + BUDGET_WAIT_S
        self._waiting_room = True
        try:
            while not self._budget.try_take(nbytes, self._client):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._budget.wait_freed(), left)
            return True
        finally:
            self._waiting_room = False

    async def _read(self, request_iterator: AsyncIterator[pb.ScoreRequest]) -> None:
        loop = asyncio.get_running_loop()
        try:
            reader = aiter(request_iterator)
            while True:
                if not self._budget.has_room_for(self._client):  # full: leave the next message with the client
                    self._waiting_room = True
                    try:
                        await self._budget.wait_room(self._client)
                    finally:
                        self._waiting_room = False
                try:
                    req = await anext(reader)
                except StopAsyncIteration:
                    break
                self._last_active = time.monotonic()
                if self._failure:
                    continue  # the stream is ending: drop what arrives until the client half-closes
                await self._slots.acquire()
                if self._failure:
                    self._slots.release()
                    continue
                if req.request_id and req.request_id in self._inflight_ids:
                    self._answer_error(req.request_id, InvalidRequest(
                        f"request_id: {req.request_id!r} is already in flight on this stream; "
                        "request ids must be unique among the unanswered requests of a stream"))
                    continue
                nbytes = req.ByteSize()
                if not await self._take_budget(nbytes):
                    self._answer_error(req.request_id, Overloaded(self._budget.refused_message(
                        nbytes, self._client, what="this request", where=" on the server")),
                                       retryable=True)
                    continue
                if req.request_id:
                    self._inflight_ids.add(req.request_id)
                task = loop.create_task(self._handle(req))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                # A callback, not the handler's `finally`: a task cancelled before it starts runs none of it.
                task.add_done_callback(lambda _, n=nbytes: self._budget.give(n, self._client))
        except Exception as exc:  # noqa: BLE001 - a broken client stream
            self._fail(exc, "")
        finally:
            self._read_all.set()
        if self._tasks:  # asyncio.wait, not gather: cancelling the reader must not cancel these
            await asyncio.wait(set(self._tasks))
        self._out.put_nowait(_END)

    async def _after_failure(self) -> AsyncIterator[pb.ScoreResponse]:
        """The answers of the requests in flight before the failure, then (with `announce`) the
        StreamEnding and the wait for the half-close; then raises the first failure."""
        if self._tasks:  # in flight before the failure: answered before the error
            await asyncio.wait(set(self._tasks))
        while not self._out.empty():
            item = self._out.get_nowait()
            if isinstance(item, pb.ScoreResponse):
                yield item
        exc, request_id = self._failure[0]
        if self._announce and not self._read_all.is_set():
            yield stream_ending(exc, request_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._read_all.wait(), STREAM_ENDING_GRACE_S)
        raise exc

    def _cancel_all(self) -> None:
        for t in list(self._tasks):
            t.cancel()
