"""Python clients of the teacher (sync and asyncio). Protobuf stays inside: callers pass token ids
and get numpy arrays back (`token_logprobs [n]`, `entropies [n]`, `topk_ids [n, k]`,
`topk_logprobs [n, k]`).

Targets are gRPC target strings: `host:port`, or `dns:///teacher-headless:50051` to balance over
every replica behind a headless Kubernetes Service (`load_balancing="round_robin"`, the default
for `dns:///` targets).

Security: `auth_token=` sends `authorization: Bearer <token>`; `tls_ca_file=` (server CA) turns on
TLS (`tls=True` alone trusts the system's roots; `tls_server_name=` overrides the name checked against
the server's certificate), and `tls_cert_file=`/`tls_key_file=` add a client certificate for mutual TLS. Every call
carries `x-eopd-client` (`client_id=`, default host-pid), the key of the server's per-client limits.

Retries: calls that fail with UNAVAILABLE (server restarting, draining or unreachable) or, when
`retry_overload` is set, RESOURCE_EXHAUSTED, are retried with exponential backoff and jitter until
`retry_timeout` seconds have passed; except a RESOURCE_EXHAUSTED that retrying cannot cure (the
request is over a per-request limit: trailing metadata `eopd-retryable: 0`, or over gRPC's message
size), which fails at once. `AsyncTeacherClient.score_stream` re-sends on a new stream
the requests that a broken stream left unanswered, so a producer loses nothing when a replica dies.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc

from .convert import NOT_RETRYABLE_KEY, STREAM_ENDING_KEY, info_from_pb, scores_from_pb
from .types import ModelInfo, SequenceScores

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# What grpcio's asyncio client reports, in place of the server's status, when one of its writes
# races the end of a stream (grpc/grpc#36066): the real status is lost. Our server announces the end
# of a stream first (StreamEnding), so this is left for a stream cut without warning (the teacher
# died mid-write): treated like UNAVAILABLE, i.e. the unanswered requests are re-sent, and a
# request that really fails is then reported with its own status.
LOST_STATUS_DETAILS = "Internal error from Core"


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class SequenceInput:
    """A sequence to score: positions [score_from, len(token_ids)) are scored."""

    id: str
    token_ids: Sequence[int] | np.ndarray
    score_from: int


@dataclass(frozen=True)
class ScoreBatch:
    """One request of a stream."""

    request_id: str
    sequences: Sequence[SequenceInput]
    top_k: int = 0
    temperature: float = 0.0


def _as_input(i: int, s) -> SequenceInput:
    if isinstance(s, SequenceInput):
        return s
    if isinstance(s, dict):
        return SequenceInput(str(s.get("id", i)), s["token_ids"], int(s["score_from"]))
    sid, ids, score_from = s
    return SequenceInput(str(sid), ids, int(score_from))


def build_request(sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "") -> pb.ScoreRequest:
    """A ScoreRequest from SequenceInput, (id, token_ids, score_from) tuples or dicts."""
    seqs = [_as_input(i, s) for i, s in enumerate(sequences)]
    return pb.ScoreRequest(
        request_id=request_id,
        top_k=top_k,
        temperature=temperature,
        sequences=[
            pb.Sequence(id=s.id, token_ids=np.asarray(s.token_ids, dtype=np.int64).tolist(), score_from=s.score_from)
            for s in seqs
        ],
    )


def channel_options(target: str, max_message_bytes: int, load_balancing: str | None) -> list[tuple[str, object]]:
    opts: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Each client owns its connections. With grpc's process-wide subchannel pool a replacement
        # client (after a stalled stream was abandoned) could silently reuse the dead TCP connection.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    policy = load_balancing or ("round_robin" if target.startswith("dns:") else None)
    if policy:
        opts.append(("grpc.lb_policy_name", policy))
    return opts


class _Backoff:
    def __init__(self, retry_timeout: float, initial: float = 0.1, maximum: float = 5.0):
        self.deadline = time.monotonic() + retry_timeout
        self.delay = initial
        self.maximum = maximum

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt, or None when the retry budget is spent."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return None
        delay = min(self.delay * random.uniform(0.5, 1.5), remaining)
        self.delay = min(self.delay * 2, self.maximum)
        return delay


class _CallPlan:
    """The deadline of one unary call across its retries. `timeout` (None: the client's `timeout`;
    0 is a real, already-passed deadline, not "the default") is an overall deadline: each attempt
    gets the time that remains, and no retry is started or waited for beyond it. Retries stop
    once `retry_timeout` (None: the client's) has passed too, so a call takes at most
    `timeout` and retries for at most min(`timeout`, `retry_timeout`)."""

    def __init__(self, client: "_Base", timeout: float | None, retry_timeout: float | None):
        self.client = client
        total = client.timeout if timeout is None else timeout
        budget = client.retry_timeout if retry_timeout is None else retry_timeout
        if total is not None:
            budget = min(budget, total)
        self.deadline = None if total is None else time.monotonic() + total
        self.backoff = _Backoff(budget)

    def attempt_timeout(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def retry_delay(self, err: grpc.RpcError) -> float | None:
        """Seconds to wait before retrying after `err`, or None to raise it."""
        if not self.client._retryable(err):
            return None
        delay = self.backoff.next_delay()
        if delay is None or (self.deadline is not None and time.monotonic() + delay >= self.deadline):
            return None
        return delay


class _Base:
    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = 300.0,
        retry_timeout: float = 60.0,
        retry_overload: bool = True,
        load_balancing: str | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        auth_token: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls: bool = False,
        tls_server_name: str | None = None,
        client_id: str | None = None,
    ):
        self.target = target
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self.retryable = RETRYABLE + ((grpc.StatusCode.RESOURCE_EXHAUSTED,) if retry_overload else ())
        extra = [("x-eopd-client", client_id or f"{socket.gethostname()}-{os.getpid()}")]
        if auth_token:
            extra.append(("authorization", f"Bearer {auth_token}"))
        self.metadata = tuple(metadata) + tuple(extra)
        self._options = channel_options(target, max_message_bytes, load_balancing)
        if tls_server_name:
            self._options.append(("grpc.ssl_target_name_override", tls_server_name))
        if credentials is None and (tls or tls_ca_file or tls_cert_file):
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca_file), private_key=_read(tls_key_file), certificate_chain=_read(tls_cert_file)
            )
        self._credentials = credentials

    def _retryable(self, err: grpc.RpcError) -> bool:
        code = err.code()
        if code == grpc.StatusCode.INTERNAL and err.details() == LOST_STATUS_DETAILS:
            return True
        if code not in self.retryable:
            return False
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Over a per-request limit (the server says so), or over gRPC's message-size limit (its
            # own status, sent before or after our handlers run): the same request fails again.
            if any(k == NOT_RETRYABLE_KEY and v == "0" for k, v in (err.trailing_metadata() or ())):
                return False
            if "larger than max" in (err.details() or ""):
                return False
        return True


class TeacherClient(_Base):
    """Blocking client. Thread-safe; use as a context manager or call close()."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        if self._credentials is not None:
            self._channel = grpc.secure_channel(target, self._credentials, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.TeacherServiceStub(self._channel)

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, fn, request, timeout: float | None, retry_timeout: float | None = None):
        plan = _CallPlan(self, timeout, retry_timeout)
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
        self, sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "", timeout: float | None = None
    ) -> list[SequenceScores]:
        """Scores sequences (SequenceInput, (id, token_ids, score_from) or dicts), in order."""
        req = build_request(sequences, top_k=top_k, temperature=temperature, request_id=request_id)
        resp = self._call(self._stub.Score, req, timeout)
        return [scores_from_pb(r) for r in resp.results]

    def score_stream(
        self, batches: Iterable[ScoreBatch], timeout: float | None = None, *, on_error: str = "raise"
    ) -> Iterator[tuple[str, list[SequenceScores] | RequestFailed]]:
        """Pipelines requests on one stream; yields (request_id, scores) as answers arrive (in any
        order). A request that fails on its own (answered in band) raises `RequestFailed`
        (`on_error="raise"`, default) or is yielded as (request_id, RequestFailed) (`on_error="yield"`)
        and the stream goes on. Submitting a request_id already in flight raises ValueError. No
        re-sending here (in-band retryable errors are reported like the others): use
        AsyncTeacherClient.score_stream for that."""
        if on_error not in ("raise", "yield"):
            raise ValueError(f"on_error must be 'raise' or 'yield', not {on_error!r}")
        inflight: set[str] = set()
        problem: list[BaseException] = []
        call = None

        def requests():
            for b in batches:
                rid = b.request_id or uuid.uuid4().hex
                if rid in inflight:
                    problem.append(ValueError(f"request_id {rid!r} is already in flight on this score_stream; ids must be unique"))
                    call.cancel()
                    return
                inflight.add(rid)
                yield build_request(b.sequences, top_k=b.top_k, temperature=b.temperature, request_id=rid)

        call = self._stub.ScoreStream(requests(), timeout=self.timeout if timeout is None else timeout, metadata=self.metadata)
        try:
            for resp in call:
                if resp.HasField("ending"):
                    continue  # not asked for here (no eopd-stream-ending metadata); the status follows
                inflight.discard(resp.request_id)
                if resp.HasField("error"):
                    failed = RequestFailed(resp.request_id, _status_code(resp.error.code), resp.error.message)
                    if on_error == "raise":
                        raise failed
                    yield resp.request_id, failed
                    continue
                yield resp.request_id, [scores_from_pb(r) for r in resp.results]
        except grpc.RpcError:
            if problem:
                raise problem[0] from None
            raise
        finally:
            call.cancel()
        if problem:
            raise problem[0]


class AsyncTeacherClient(_Base):
    """asyncio client; create and use it inside one running event loop."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        if self._credentials is not None:
            self._channel = grpc.aio.secure_channel(target, self._credentials, options=self._options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.TeacherServiceStub(self._channel)

    async def __aenter__(self) -> "AsyncTeacherClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, fn, request, timeout: float | None, retry_timeout: float | None = None):
        plan = _CallPlan(self, timeout, retry_timeout)
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
        self, sequences: Iterable, *, top_k: int = 0, temperature: float = 0.0, request_id: str = "", timeout: float | None = None
    ) -> list[SequenceScores]:
        req = build_request(sequences, top_k=top_k, temperature=temperature, request_id=request_id)
        resp = await self._call(self._stub.Score, req, timeout)
        return [scores_from_pb(r) for r in resp.results]

    async def score_stream(
        self,
        batches: AsyncIterable[ScoreBatch] | Iterable[ScoreBatch],
        *,
        max_in_flight: int = 16,
        timeout: float | None = None,
        streams: int = 1,
        on_error: str = "raise",
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
        never cancels the source: the source is read by one task, apart from the streams.

        `timeout` is a deadline in seconds for the whole call, re-sends included (None, the
        default, means none: a producer may keep its streams open for as long as it runs; the
        client's `timeout` applies to unary calls only). When it passes, the streams end with
        `DEADLINE_EXCEEDED` (or with the retryable error that broke a stream, if the deadline has
        already passed when that happens)."""
        if on_error not in ("raise", "yield"):
            raise ValueError(f"on_error must be 'raise' or 'yield', not {on_error!r}")
        if streams < 1:
            raise ValueError(f"streams must be >= 1, not {streams}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, not {max_in_flight}")
        run = _StreamRun(self, batches, max_in_flight=max_in_flight, timeout=timeout, streams=streams)
        try:
            run.start()
            while True:
                kind, rid, value = await run.events.get()
                if kind == "done":
                    return
                if kind == "error":
                    raise value
                if kind == "failed" and on_error == "raise":
                    raise value
                yield rid, value
        finally:
            await run.stop()


class RequestFailed(Exception):
    """A request of a stream that failed on its own (answered in band by the server), or whose
    retries ran out: `request_id`, `code` (grpc.StatusCode) and `details` (the server's message)."""

    def __init__(self, request_id: str, code: grpc.StatusCode, details: str):
        super().__init__(f"request {request_id!r} failed: {code.name}: {details}")
        self.request_id = request_id
        self.code = code
        self.details = details


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _status_code(number: int) -> grpc.StatusCode:
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


class _Lane:
    """One ScoreStream call (re-opened after a retryable break) and the requests assigned to it."""

    def __init__(self, index: int):
        self.index = index
        self.unanswered: dict[str, pb.ScoreRequest] = {}
        self.todo: asyncio.Queue = asyncio.Queue()  # requests to write on the current call
        self.timers: dict[str, asyncio.TimerHandle] = {}  # in-band retries waiting for their backoff
        self.retries: dict[str, _Backoff] = {}
        self.task: asyncio.Task | None = None


_CLOSE = object()  # put on a lane's todo: nothing more to write, half-close


class _StreamRun:
    """The machinery of AsyncTeacherClient.score_stream: one feeder task reads the source and
    assigns requests to lanes; each lane task runs its ScoreStream calls; both report on `events`
    as ("result" | "failed", request_id, value), ("error", "", exception) or ("done", "", None)."""

    def __init__(self, client: "AsyncTeacherClient", batches, *, max_in_flight: int, timeout: float | None, streams: int):
        self.client = client
        self.source = batches.__aiter__() if hasattr(batches, "__aiter__") else _aiter(batches)
        self.slots = asyncio.Semaphore(max_in_flight)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.lanes = [_Lane(i) for i in range(streams)]
        self.events: asyncio.Queue = asyncio.Queue()
        self.inflight: set[str] = set()
        self.exhausted = False
        self.feeder: asyncio.Task | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.feeder = loop.create_task(self._feed())
        for lane in self.lanes:
            lane.task = loop.create_task(self._run_lane(lane))

    async def stop(self) -> None:
        tasks = [t for t in [self.feeder, *(lane.task for lane in self.lanes)] if t is not None and not t.done()]
        for t in tasks:
            t.cancel()
        for lane in self.lanes:
            for h in lane.timers.values():
                h.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # -- bookkeeping ------------------------------------------------------------------------
    def _resolved(self, lane: _Lane, rid: str) -> None:
        lane.unanswered.pop(rid, None)
        lane.retries.pop(rid, None)
        timer = lane.timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        self.inflight.discard(rid)
        self.slots.release()
        self._maybe_close(lane)
        if self.exhausted and not self.inflight:
            self.events.put_nowait(("done", "", None))

    def _maybe_close(self, lane: _Lane) -> None:
        if self.exhausted and not lane.unanswered:
            lane.todo.put_nowait(_CLOSE)

    async def _feed(self) -> None:
        try:
            while True:
                await self.slots.acquire()
                try:
                    batch = await self.source.__anext__()
                except StopAsyncIteration:
                    break
                rid = batch.request_id or uuid.uuid4().hex
                if rid in self.inflight:
                    raise ValueError(f"request_id {rid!r} is already in flight on this score_stream; ids must be unique")
                req = build_request(batch.sequences, top_k=batch.top_k, temperature=batch.temperature, request_id=rid)
                lane = min(self.lanes, key=lambda ln: (len(ln.unanswered), ln.index))
                self.inflight.add(rid)
                lane.unanswered[rid] = req
                lane.todo.put_nowait(req)
            self.exhausted = True
            for lane in self.lanes:
                self._maybe_close(lane)
            if not self.inflight:
                self.events.put_nowait(("done", "", None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the source failed (or a duplicate id): the caller's error
            self.events.put_nowait(("error", "", exc))

    def _in_band(self, lane: _Lane, resp: pb.ScoreResponse) -> None:
        rid, err = resp.request_id, resp.error
        code = _status_code(err.code)
        req = lane.unanswered.get(rid)
        # UNAVAILABLE, or what the server marks retryable (RESOURCE_EXHAUSTED for load only if this
        # client retries overload).
        retryable = (err.retryable or code == grpc.StatusCode.UNAVAILABLE) and not (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED and code not in self.client.retryable
        )
        if req is not None and retryable:
            backoff = lane.retries.setdefault(rid, _Backoff(self.client.retry_timeout))
            delay = backoff.next_delay()
            if delay is not None and self.deadline is not None:
                left = self.deadline - time.monotonic()
                delay = min(delay, left) if left > 0 else None
            if delay is not None:
                todo = lane.todo  # the current call's queue: a new call re-sends it anyway
                lane.timers[rid] = asyncio.get_running_loop().call_later(delay, self._resend, lane, rid, todo)
                return
        self.events.put_nowait(("failed", rid, RequestFailed(rid, code, err.message)))
        self._resolved(lane, rid)  # after the event: it may announce the end

    def _resend(self, lane: _Lane, rid: str, todo: asyncio.Queue) -> None:
        lane.timers.pop(rid, None)
        req = lane.unanswered.get(rid)
        if req is not None and todo is lane.todo:
            todo.put_nowait(req)

    async def _run_lane(self, lane: _Lane) -> None:
        client = self.client
        backoff = _Backoff(client.retry_timeout)
        try:
            while True:
                # A new call: everything unanswered on this lane is written first.
                for h in lane.timers.values():
                    h.cancel()
                lane.timers.clear()
                lane.todo = asyncio.Queue()
                for req in lane.unanswered.values():
                    lane.todo.put_nowait(req)
                self._maybe_close(lane)
                remaining = None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)
                call = client._stub.ScoreStream(metadata=client.metadata + ((STREAM_ENDING_KEY, "1"),), timeout=remaining)
                # The server announces a stream's end (a StreamEnding) before its status; from then
                # on nothing more is written and the stream is half-closed, so that no write races
                # the status (grpcio's asyncio client would report such a race as INTERNAL instead
                # of the server's status, grpc/grpc#36066).
                ending = asyncio.Event()
                writing = False
                todo = lane.todo

                async def writer() -> None:
                    nonlocal writing
                    while not ending.is_set():
                        req = await todo.get()
                        if req is _CLOSE:
                            break
                        if ending.is_set() or (isinstance(req, pb.ScoreRequest) and req.request_id not in lane.unanswered):
                            continue
                        writing = True
                        await call.write(req)
                        writing = False
                    writing = True  # cancelling done_writing would cancel the call
                    await call.done_writing()

                write_task = asyncio.get_running_loop().create_task(writer())
                try:
                    async for resp in call:
                        if resp.HasField("ending"):
                            ending.set()
                            if not writing:  # waiting for work: stop the writer and half-close here
                                write_task.cancel()
                                await asyncio.wait([write_task])
                                await call.done_writing()
                            continue  # the status follows
                        if resp.request_id not in lane.unanswered:
                            continue  # an answer to a request already answered before a re-send
                        backoff = _Backoff(client.retry_timeout)  # progress: a fresh retry budget
                        if resp.HasField("error"):
                            self._in_band(lane, resp)
                            continue
                        scores = [scores_from_pb(r) for r in resp.results]
                        self.events.put_nowait(("result", resp.request_id, scores))
                        self._resolved(lane, resp.request_id)  # after the event: it may announce the end
                    if write_task.done() and not write_task.cancelled() and write_task.exception() is not None:
                        raise write_task.exception()
                    if self.exhausted and not lane.unanswered:
                        return
                    raise RuntimeError("the teacher closed the stream with requests unanswered")
                except grpc.aio.AioRpcError as err:
                    write_task.cancel()
                    delay = backoff.next_delay() if client._retryable(err) else None
                    if delay is not None and self.deadline is not None:
                        left = self.deadline - time.monotonic()
                        delay = min(delay, left) if left > 0 else None
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
                finally:
                    if not write_task.done():
                        write_task.cancel()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.events.put_nowait(("error", "", exc))


async def _next(source) -> tuple[bool, object]:
    """(True, item) or (False, None) at the end of an async iterator."""
    try:
        return True, await source.__anext__()
    except StopAsyncIteration:
        return False, None


async def _aiter(items: Iterable):
    for item in items:
        yield item
