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
        backoff = _Backoff(self.retry_timeout if retry_timeout is None else retry_timeout)
        while True:
            try:
                return fn(request, timeout=timeout or self.timeout, metadata=self.metadata)
            except grpc.RpcError as err:
                delay = backoff.next_delay() if self._retryable(err) else None
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

    def score_stream(self, batches: Iterable[ScoreBatch], timeout: float | None = None) -> Iterator[tuple[str, list[SequenceScores]]]:
        """Pipelines requests on one stream; yields (request_id, scores) as answers arrive (in any
        order). No re-sending here: use AsyncTeacherClient.score_stream for that."""
        reqs = (build_request(b.sequences, top_k=b.top_k, temperature=b.temperature, request_id=b.request_id) for b in batches)
        for resp in self._stub.ScoreStream(reqs, timeout=timeout or self.timeout, metadata=self.metadata):
            if resp.HasField("ending"):
                continue  # not asked for here (no eopd-stream-ending metadata); the status follows
            yield resp.request_id, [scores_from_pb(r) for r in resp.results]


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
        backoff = _Backoff(self.retry_timeout if retry_timeout is None else retry_timeout)
        while True:
            try:
                return await fn(request, timeout=timeout or self.timeout, metadata=self.metadata)
            except grpc.aio.AioRpcError as err:
                delay = backoff.next_delay() if self._retryable(err) else None
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
        self, batches: AsyncIterable[ScoreBatch] | Iterable[ScoreBatch], *, max_in_flight: int = 16, timeout: float | None = None
    ) -> AsyncIterator[tuple[str, list[SequenceScores]]]:
        """Pipelines requests (at most `max_in_flight` unanswered) and yields (request_id, scores)
        as answers arrive. When the stream breaks with a retryable status, unanswered requests
        are re-sent on a new stream after a backoff; each request_id is yielded exactly once.
        Request ids must be unique (empty ones are filled in).

        A broken stream never cancels the source: a pending "next request" is carried over to
        the next stream, so an async generator source keeps producing across re-sends.

        `timeout` is a deadline in seconds for the whole stream, re-sends included (None, the
        default, means none: a producer may keep one stream open for as long as it runs; the
        client's `timeout` applies to unary calls only). When it passes, the stream ends with
        `DEADLINE_EXCEEDED` (or with the retryable error that broke the stream, if the deadline
        has already passed when that happens). A status that is not retried (e.g.
        `INVALID_ARGUMENT` for a bad request) is raised at once, after the answers that arrived
        before it."""
        source = batches.__aiter__() if hasattr(batches, "__aiter__") else _aiter(batches)
        unanswered: dict[str, pb.ScoreRequest] = {}
        exhausted = False
        next_item: asyncio.Task | None = None
        backoff = _Backoff(self.retry_timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                resend = list(unanswered.values())
                slots = asyncio.Semaphore(max(max_in_flight - len(resend), 0))
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                call = self._stub.ScoreStream(metadata=self.metadata + ((STREAM_ENDING_KEY, "1"),), timeout=remaining)
                # The server announces the stream's end (a StreamEnding) before its status; from
                # then on nothing more is written and the stream is half-closed, so that no write
                # races the status (grpcio's asyncio client would report such a race as INTERNAL
                # instead of the server's status, grpc/grpc#36066).
                ending = asyncio.Event()
                writing = False

                async def writer() -> None:
                    nonlocal exhausted, next_item, writing
                    for req in resend:
                        if ending.is_set():
                            break
                        writing = True
                        await call.write(req)
                        writing = False
                    while not exhausted and not ending.is_set():
                        await slots.acquire()
                        if next_item is None:
                            next_item = asyncio.ensure_future(_next(source))
                        # shield: cancelling this writer must not cancel the source's __anext__.
                        more, batch = await asyncio.shield(next_item)
                        if ending.is_set():
                            break  # the item stays in next_item, for the next stream
                        next_item = None
                        if not more:
                            exhausted = True
                            break
                        rid = batch.request_id or uuid.uuid4().hex
                        req = build_request(batch.sequences, top_k=batch.top_k, temperature=batch.temperature, request_id=rid)
                        unanswered[rid] = req
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
                            if not writing:  # waiting for a slot or the source: stop it and half-close here
                                write_task.cancel()
                                await asyncio.wait([write_task])
                                await call.done_writing()
                            continue  # the status follows
                        if unanswered.pop(resp.request_id, None) is None:
                            continue  # an answer to a request already answered before a re-send
                        slots.release()
                        backoff = _Backoff(self.retry_timeout)  # progress: a fresh retry budget
                        yield resp.request_id, [scores_from_pb(r) for r in resp.results]
                    await write_task
                    if exhausted and not unanswered:
                        return
                    raise RuntimeError("the teacher closed the stream with requests unanswered")
                except grpc.aio.AioRpcError as err:
                    write_task.cancel()
                    delay = backoff.next_delay() if self._retryable(err) else None
                    if delay is not None and deadline is not None:
                        left = deadline - time.monotonic()
                        delay = min(delay, left) if left > 0 else None
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
                finally:
                    if not write_task.done():
                        write_task.cancel()
        finally:
            if next_item is not None and not next_item.done():
                next_item.cancel()


async def _next(source) -> tuple[bool, object]:
    """(True, item) or (False, None) at the end of an async iterator."""
    try:
        return True, await source.__anext__()
    except StopAsyncIteration:
        return False, None


async def _aiter(items: Iterable):
    for item in items:
        yield item
