"""The teacher server: gRPC (`eopd.v1.TeacherService`, health, reflection) and a small HTTP side
(`/healthz`, `/readyz`, `/metrics`) in one asyncio process.

Lifecycle: both servers bind first and report NOT_SERVING / 503 while the model loads; once it is
loaded, health turns SERVING. On SIGTERM or SIGINT the server drains: health turns NOT_SERVING,
new requests get UNAVAILABLE, in-flight requests finish (up to `grace_seconds`), then it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc

from .batcher import BatchObserver, Draining, DynamicBatcher, Overloaded
from .convert import NOT_RETRYABLE_KEY, STREAM_ENDING_KEY, InvalidRequest, RequestTooLarge, info_to_pb, items_from_request, scores_to_pb
from .engines import create_engine
from .engines.base import ScoringEngine
from .metrics import TeacherMetrics
from .settings import TeacherSettings
from .types import ModelInfo

log = logging.getLogger("eopd_teacher")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TeacherService"].full_name
MAX_INFLIGHT_PER_STREAM = 64


class NotReady(Exception):
    """The model is still loading: UNAVAILABLE."""


# Exceptions the servicer raises, and the status each maps to.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    NotReady: grpc.StatusCode.UNAVAILABLE,
}


# Failures that end a ScoreStream (the server, not the request, is the problem); every other
# failure of a request is answered in band and the stream goes on.
STREAM_LEVEL: tuple[type[Exception], ...] = (Overloaded, Draining, NotReady)


def status_of(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def describe(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a handler's exception is answered with."""
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        return code, f"internal error: {type(exc).__name__}: {exc}"
    return code, str(exc)


# How long a ScoreStream that announced its end (StreamEnding) waits for the client to half-close.
STREAM_ENDING_GRACE_S = 5.0


def wants_stream_ending(context: grpc.aio.ServicerContext) -> bool:
    return any(k == STREAM_ENDING_KEY and v == "1" for k, v in context.invocation_metadata() or ())


CLIENT_ID_HEADER = "x-eopd-client"


def client_key(context: grpc.aio.ServicerContext) -> str:
    """Who a request is from, for per-client limits: the x-eopd-client metadata, else the peer
    address without its port."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_HEADER and value:
            return f"id:{value}"[:128]
    peer = context.peer() or "unknown"
    return peer.rsplit(":", 1)[0]


@dataclass
class ServerState:
    settings: TeacherSettings
    metrics: TeacherMetrics
    engine: ScoringEngine
    info: ModelInfo | None = None
    batcher: DynamicBatcher | None = None
    draining: bool = False
    load_error: str | None = None
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    inflight_tokens: dict[str, int] = field(default_factory=dict)
    open_streams: int = 0

    @property
    def ready(self) -> bool:
        return (
            self.info is not None and self.batcher is not None and self.batcher.alive and not self.draining and self.engine.health()
        )

    def check_ready(self) -> tuple[ModelInfo, DynamicBatcher]:
        if self.draining:
            raise Draining("the server is shutting down; retry on another replica")
        if self.info is None or self.batcher is None:
            raise NotReady("the model is still loading; retry shortly")
        return self.info, self.batcher


class TeacherServicer(pb_grpc.TeacherServiceServicer):
    """Short delegations: validate, queue on the batcher, convert back."""

    def __init__(self, state: ServerState):
        self.state = state

    async def _score(self, request: pb.ScoreRequest, client: str, *, stream: bool) -> pb.ScoreResponse:
        info, batcher = self.state.check_ready()
        items = items_from_request(request, info, require_request_id=stream, max_response_bytes=self.state.settings.max_message_bytes)
        tokens = sum(it.num_tokens for it in items)
        inflight = self.state.inflight_tokens
        limit = self.state.settings.max_inflight_tokens_per_client
        if inflight.get(client, 0) + tokens > limit and inflight.get(client, 0) > 0:
            raise Overloaded(f"client {client!r} has {inflight[client]} tokens in flight; this request adds {tokens}, limit {limit}")
        inflight[client] = inflight.get(client, 0) + tokens
        self.state.metrics.inflight.inc()
        try:
            results = await batcher.submit(items)
        finally:
            self.state.metrics.inflight.dec()
            inflight[client] -= tokens
            if inflight[client] <= 0:
                del inflight[client]
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

    async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
        return await self._score(request, client_key(context), stream=False)

    async def ScoreStream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ScoreResponse]:
        """Serves requests concurrently as they arrive (at most MAX_INFLIGHT_PER_STREAM at once:
        beyond that, reading pauses and HTTP/2 flow control pushes back on the client). A request
        that fails on its own (invalid, over a per-request limit, an engine error, a request_id
        already in flight) is answered in band (`ScoreResponse.error`) and the stream goes on. A
        stream-level failure (overload, draining) ends the stream with its error without waiting
        for the client to send more, after the requests already in flight are answered (and, for
        a client that asked with `eopd-stream-ending: 1`, after announcing the end and letting it
        half-close)."""
        if self.state.open_streams >= self.state.settings.max_streams:
            raise Overloaded(f"{self.state.open_streams} streams open, limit {self.state.settings.max_streams}; retry later")
        self.state.open_streams += 1
        try:
            announce = wants_stream_ending(context)
            async for response in self._serve_stream(request_iterator, client_key(context), announce=announce):
                yield response
        finally:
            self.state.open_streams -= 1

    async def _serve_stream(
        self, request_iterator: AsyncIterator[pb.ScoreRequest], client: str, *, announce: bool = False
    ) -> AsyncIterator[pb.ScoreResponse]:
        """The stream's loop. A reader task reads requests and starts one handler task per
        request; handlers put their answers (results or an in-band error) on `out`. A slot (of MAX_INFLIGHT_PER_STREAM) is held
        from reading a request until its answer is handed to gRPC, so a client that stops reading
        answers is pushed back on too. A handler meeting a stream-level failure (or a broken
        request stream) puts `failed` on `out` at once, so the error does not wait for the client to send or close anything:
        requests read after it are dropped, the requests already in flight are answered, then the
        stream ends with the first error. With `announce`, a `StreamEnding` message goes first and
        the end waits (at most STREAM_ENDING_GRACE_S) for the client to half-close. If the call
        itself ends (cancelled by the client, deadline), every task is cancelled, which withdraws
        their sequences from the batcher."""
        failed, end = object(), object()
        out: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(MAX_INFLIGHT_PER_STREAM)
        failure: list[tuple[BaseException, str]] = []
        tasks: set[asyncio.Task] = set()
        inflight_ids: set[str] = set()  # request ids read and not yet answered
        read_all = asyncio.Event()  # the client half-closed (or its request stream broke)
        latency = self.state.metrics.latency.labels("ScoreStream")
        loop = asyncio.get_running_loop()

        def fail(exc: BaseException, request_id: str) -> None:
            failure.append((exc, request_id))
            if len(failure) == 1:
                out.put_nowait(failed)

        def answer_error(request_id: str, exc: BaseException) -> None:
            """A request-level failure, answered in band (its slot is released once sent)."""
            out.put_nowait(self._in_band_error(request_id, exc))

        async def handle(req: pb.ScoreRequest) -> None:
            started = time.perf_counter()
            try:
                response = await self._score(req, client, stream=True)
            except STREAM_LEVEL as exc:  # load, draining, not ready: the stream's status
                slots.release()
                fail(exc, req.request_id)
                return
            except Exception as exc:  # noqa: BLE001 - this request's own failure: in band
                answer_error(req.request_id, exc)
                return
            finally:
                inflight_ids.discard(req.request_id)
            latency.observe(time.perf_counter() - started)
            self.state.metrics.stream_requests.labels("OK").inc()
            out.put_nowait(response)  # its slot is released once the answer is sent

        async def reader() -> None:
            try:
                async for req in request_iterator:
                    if failure:
                        continue  # the stream is ending: drop what arrives until the client half-closes
                    await slots.acquire()
                    if failure:
                        slots.release()
                        continue
                    if req.request_id and req.request_id in inflight_ids:
                        answer_error(req.request_id, InvalidRequest(
                            f"request_id: {req.request_id!r} is already in flight on this stream; "
                            "request ids must be unique among the unanswered requests of a stream"))
                        continue
                    if req.request_id:
                        inflight_ids.add(req.request_id)
                    task = loop.create_task(handle(req))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            except Exception as exc:  # noqa: BLE001 - a broken client stream
                fail(exc, "")
            finally:
                read_all.set()
            if tasks:  # asyncio.wait, not gather: cancelling the reader must not cancel these
                await asyncio.wait(set(tasks))
            out.put_nowait(end)

        read_task = loop.create_task(reader())
        try:
            while (item := await out.get()) is not end and item is not failed:
                yield item
                slots.release()
            if failure:
                if tasks:  # in flight before the failure: answered before the error
                    await asyncio.wait(set(tasks))
                while not out.empty():
                    item = out.get_nowait()
                    if isinstance(item, pb.ScoreResponse):
                        yield item
                exc, request_id = failure[0]
                if announce and not read_all.is_set():
                    code, message = describe(exc)
                    yield pb.ScoreResponse(ending=pb.StreamEnding(request_id=request_id, code=code.value[0], message=message))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(read_all.wait(), STREAM_ENDING_GRACE_S)
                raise exc
        finally:
            read_task.cancel()
            for t in list(tasks):
                t.cancel()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self.state.info is None:
            raise NotReady("the model is still loading; retry shortly")
        return info_to_pb(self.state.info)


def _decoder(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object]:
    """Protobuf decoding inside the handler, so malformed bytes get INVALID_ARGUMENT with the
    reason instead of gRPC's generic UNKNOWN."""
    if deserializer is None:
        return lambda raw: raw

    def decode(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise InvalidRequest(f"request: not a valid protobuf message of the method's request type ({exc})") from None

    return decode


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions of TeacherService handlers to statuses (never a dead stream or a bare
    UNKNOWN), logs unexpected ones, and counts every RPC by method and code."""

    def __init__(self, metrics: TeacherMetrics):
        self.metrics = metrics

    def _finish(self, method: str, code: grpc.StatusCode, started: float | None) -> None:
        self.metrics.requests.labels(method, code.name).inc()
        if code != grpc.StatusCode.OK:
            self.metrics.errors.labels(code.name).inc()
        if started is not None:
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
        code, message = describe(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("unexpected error in %s", method, exc_info=exc)
        self._finish(method, code, None)
        # A request over a per-request limit fails the same way every time: say so, so that clients
        # that retry RESOURCE_EXHAUSTED (a full queue, too many streams) do not retry this one.
        trailing = ((NOT_RETRYABLE_KEY, "0"),) if isinstance(exc, RequestTooLarge) else ()
        await context.abort(code, message, trailing_metadata=trailing)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary
            decode = _decoder(handler.request_deserializer)

            async def unary_unary(raw, context):
                started = time.perf_counter()
                try:
                    response = await inner_uu(decode(raw), context)
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:  # the client went away (cancelled, deadline passed)
                    self._finish(method, grpc.StatusCode.CANCELLED, None)
                    raise
                except Exception as exc:  # noqa: BLE001
                    await self._abort(context, method, exc)
                    raise AssertionError("unreachable") from exc
                self._finish(method, grpc.StatusCode.OK, started)
                return response

            return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream
            decode_ss = _decoder(handler.request_deserializer)

            async def decoded(raw_iterator):
                async for raw in raw_iterator:
                    yield decode_ss(raw)

            async def stream_stream(request_iterator, context):
                try:
                    async for response in inner_ss(decoded(request_iterator), context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:  # the client went away (cancelled, deadline passed)
                    self._finish(method, grpc.StatusCode.CANCELLED, None)
                    raise
                except Exception as exc:  # noqa: BLE001
                    await self._abort(context, method, exc)
                    return
                self._finish(method, grpc.StatusCode.OK, None)

            return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=handler.response_serializer)
        return handler


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except grpc.health.v1 (probes
    cannot send metadata). Compared in constant time; the token is never logged."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str, metrics: TeacherMetrics):
        self._expected = f"Bearer {token}".encode()
        self.metrics = metrics

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(self.EXEMPT) or self._authorized(details):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        self.metrics.requests.labels(method, "UNAUTHENTICATED").inc()
        self.metrics.errors.labels("UNAUTHENTICATED").inc()
        message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

        async def deny_unary(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(deny_unary, **kw)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)


def server_credentials(settings: TeacherSettings) -> grpc.ServerCredentials | None:
    """TLS (and mutual TLS with tls_client_ca_file) credentials, or None for plaintext."""
    if settings.tls_cert_file is None:
        return None
    cert = Path(settings.tls_cert_file).read_bytes()
    key = Path(settings.tls_key_file).read_bytes()
    ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


class TeacherServer:
    """Owns the gRPC server, the HTTP side, the engine and the batcher."""

    def __init__(self, settings: TeacherSettings, engine: ScoringEngine | None = None):
        self.settings = settings
        self.metrics = TeacherMetrics()
        self.state = ServerState(settings=settings, metrics=self.metrics, engine=engine or create_engine(settings))
        self.health = health.aio.HealthServicer()
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._http = None
        self._http_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Binds both servers (NOT_SERVING), then loads the model in a thread (SERVING when done)."""
        s = self.settings
        opts = [
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_concurrent_streams", s.max_concurrent_streams),
            ("grpc.so_reuseport", 0),
        ]
        if s.max_connection_age_s > 0:  # clients reconnect (and re-resolve DNS) now and then
            opts += [
                ("grpc.max_connection_age_ms", int(s.max_connection_age_s * 1000)),
                ("grpc.max_connection_age_grace_ms", int(s.max_connection_age_grace_s * 1000)),
            ]
        interceptors: list[grpc.aio.ServerInterceptor] = [StatusInterceptor(self.metrics)]
        token = s.bearer_token()
        if token:
            interceptors.insert(0, AuthInterceptor(token, self.metrics))
        server = grpc.aio.server(interceptors=interceptors, options=opts)
        pb_grpc.add_TeacherServiceServicer_to_server(TeacherServicer(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        host = f"[{s.host}]" if ":" in s.host else s.host
        creds = server_credentials(s)
        address = f"{host}:{s.grpc_port}"
        self.grpc_port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
        if self.grpc_port == 0:
            raise OSError(f"cannot bind gRPC to {s.host}:{s.grpc_port}")
        await server.start()
        self._grpc = server
        await self._start_http()
        log.info(
            "eopd-teacher listening grpc=%s:%d (%s, %s) http=%s:%d (loading %s)", s.host, self.grpc_port,
            "mutual TLS" if s.tls_client_ca_file else "TLS" if creds else "plaintext",
            "bearer token required" if token else "no auth", s.host, self.http_port, s.model,
        )
        asyncio.get_running_loop().create_task(self._load())

    async def _start_http(self) -> None:
        import uvicorn

        from .http_app import create_app

        sock = _bind_socket(self.settings.host, self.settings.http_port)
        self.http_port = sock.getsockname()[1]

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the teacher handles signals itself
                yield

        config = uvicorn.Config(create_app(self.state, self.settings.bearer_token()), log_level="warning", lifespan="off", access_log=False)
        self._http = _Server(config)
        self._http_task = asyncio.get_running_loop().create_task(self._http.serve(sockets=[sock]))

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            info = await loop.run_in_executor(None, self.state.engine.load)
        except Exception as exc:  # noqa: BLE001 - reported, then the process exits non-zero
            grace = self.settings.load_failure_grace_s
            log.exception("loading the model failed; /readyz reports the error for %.0fs, then the process exits 1", grace)
            self.state.load_error = f"{type(exc).__name__}: {exc}"
            # Keep the HTTP side up a little so that /readyz shows why (503 with the error).
            loop.call_later(grace, self.state.stop_event.set)
            return
        s = self.settings
        batcher = DynamicBatcher(
            self.state.engine.score,
            max_batch_tokens=s.max_batch_tokens,
            max_wait_s=s.max_batch_wait_ms / 1000,
            max_queue_tokens=s.max_queue_tokens,
            observer=BatchObserver(on_batch=self.metrics.on_batch, on_queue=self.metrics.on_queue),
        )
        batcher.on_died = self._batcher_died
        batcher.start()
        self.state.batcher = batcher
        self.state.info = info
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        engine = self.state.engine
        self.metrics.statistics_compiled.set_function(lambda: 1.0 if engine.statistics_path == "compiled" else 0.0)
        self.metrics.ready.set(1)
        log.info(
            "ready: %s (%s, vocab %d, context %d, %s statistics) loaded in %.1fs",
            info.model_name, info.dtype, info.vocab_size, info.max_context_length, engine.statistics_path,
            time.perf_counter() - started,
        )

    def _batcher_died(self, exc: BaseException) -> None:
        """The batcher's loop died: not ready (/readyz 503, health NOT_SERVING) so that probes and
        load balancers take this replica out; requests get UNAVAILABLE meanwhile."""
        self.metrics.ready.set(0)
        for name in ("", SERVICE_NAME):
            asyncio.get_running_loop().create_task(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))

    async def stop(self) -> None:
        """Drains: NOT_SERVING, new work refused, in-flight work finished (grace), then closes."""
        self.state.draining = True
        self.metrics.ready.set(0)
        await self.health.enter_graceful_shutdown()
        if self._grpc is not None:
            await self._grpc.stop(self.settings.grace_seconds)
        if self.state.batcher is not None:
            await self.state.batcher.close()
        if self._http is not None:
            self._http.should_exit = True
            if self._http_task is not None:
                await self._http_task
        self.state.engine.shutdown()

    async def run_until_signal(self) -> int:
        """Starts, serves until SIGTERM/SIGINT (or a failed load), drains. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.state.stop_event.set)
        await self.start()
        await self.state.stop_event.wait()
        log.info("draining (grace %.0fs)", self.settings.grace_seconds)
        await self.stop()
        log.info("stopped")
        return 1 if self.state.load_error else 0


def serve(settings: TeacherSettings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(TeacherServer(settings).run_until_signal())
