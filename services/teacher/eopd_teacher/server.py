"""The teacher server's lifecycle: gRPC (`eopd.v1.TeacherService`, health, reflection) and a small
HTTP side (`/healthz`, `/readyz`, `/metrics`, `/v1/completions`) in one asyncio process; with
`http_probe_port`, a second HTTP listener serving the probes alone, with its own connection budget.

Lifecycle: both servers bind first and report NOT_SERVING / 503 while the model loads; once it is
loaded, health turns SERVING. On SIGTERM or SIGINT the server drains: health turns NOT_SERVING,
new requests get UNAVAILABLE, in-flight requests finish (up to `grace_seconds`), then it exits.
With `ports_file`, the bound ports are written there as soon as both servers listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_common.atomic_files import write_atomic
from eopd_common.cpu_threads import cpu_threads_note
from eopd_common.private_files import write_token_file

from .engines import create_engine
from .grpc.interceptors import AuthInterceptor, StatusInterceptor
from .grpc.servicer import SERVICE_NAME, TeacherServicer
from .http.app import create_app
from .http.body_budget import BodyBudget
from .http.limits import ACCEPT_BATCH, connection_cap, limited_protocol
from .serving.batcher import BatchObserver, DynamicBatcher
from .serving.metrics import TeacherMetrics
from .serving.resources import MemoryReturner, raise_open_file_limit
from .serving.service import TeacherService
from .serving.state import ServerState, served_info
from .settings import TeacherSettings

if TYPE_CHECKING:
    from .engines.base import ScoringEngine

log = logging.getLogger("eopd_teacher")

INSECURE_WARNING = (
    "INSECURE: serving with no client authentication (insecure_no_auth): anyone who can reach %s may score, "
    "generate and read /metrics, and per-client shares key on source addresses only; give a bearer token "
    "(--auth-token-file FILE --create-token) unless every process that can reach these ports is trusted"
)


class AuthRequired(RuntimeError):
    """The settings name no client authentication and no explicit opt-out (`TeacherSettings.auth_refusal`)."""


def server_credentials(settings: TeacherSettings) -> grpc.ServerCredentials | None:
    """TLS (and mutual TLS with tls_client_ca_file) credentials, or None for plaintext."""
    if settings.tls_cert_file is None:
        return None
    cert = Path(settings.tls_cert_file).read_bytes()
    key = Path(settings.tls_key_file).read_bytes()
    ca = Path(settings.tls_client_ca_file).read_bytes() if settings.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def http_tls_options(settings: TeacherSettings) -> dict:
    """uvicorn.Config's TLS arguments. With TLS on, the HTTP side (/metrics, probes) serves HTTPS with
    gRPC's certificate pair, so its bearer token never crosses the network in clear. Under mutual TLS
    a client certificate is verified against tls_client_ca_file when one is presented but not
    required (the kubelet's HTTPS probes cannot present one); `create_app` then refuses every
    non-probe path unless a bearer token guards it (`http_deny_unauthenticated`)."""
    if settings.tls_cert_file is None:
        return {}
    opts = {"ssl_certfile": str(settings.tls_cert_file), "ssl_keyfile": str(settings.tls_key_file)}
    if settings.tls_client_ca_file is not None:
        opts |= {"ssl_ca_certs": str(settings.tls_client_ca_file), "ssl_cert_reqs": ssl.CERT_OPTIONAL}
    return opts


def http_deny_unauthenticated(settings: TeacherSettings) -> bool:
    """Mutual TLS and no bearer token: gRPC admits only certified clients, the HTTP side cannot
    require certificates, so its non-probe paths answer 403 rather than serve anyone."""
    return settings.tls_client_ca_file is not None and not settings.bearer_token()


def _bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def grpc_options(settings: TeacherSettings) -> list[tuple[str, object]]:
    """The gRPC server's channel options: message sizes (requests: the smaller of max_request_bytes
    and max_message_bytes), streams per connection, connection age."""
    s = settings
    opts: list[tuple[str, object]] = [
        ("grpc.max_send_message_length", s.max_message_bytes),
        ("grpc.max_receive_message_length", min(s.max_request_bytes, s.max_message_bytes)),
        ("grpc.max_concurrent_streams", s.max_concurrent_streams),
        ("grpc.so_reuseport", 0),
    ]
    if s.max_connection_age_s > 0:  # clients reconnect (and re-resolve DNS) now and then
        opts += [
            ("grpc.max_connection_age_ms", int(s.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", int(s.max_connection_age_grace_s * 1000)),
        ]
    return opts


# The probe listener (`http_probe_port`): connections in all and per client address (the kubelet
# opens one per probe), and its header deadline.
PROBE_MAX_CONNECTIONS = 64
PROBE_MAX_CONNECTIONS_PER_PEER = 16
PROBE_HEADER_TIMEOUT_S = 5.0


def http_config(app, settings: TeacherSettings, open_file_limit: int, *, probes: bool = False) -> uvicorn.Config:
    """uvicorn's configuration of an HTTP listener (`http.limits`): request headers due within
    http_header_timeout_s and bodies within http_body_timeout_s; at most http_max_connections
    connections (kept below the open-file limit: `connection_cap`) and http_max_connections_per_peer
    from one address, a connection beyond answered 503 and closed; HTTPS when TLS is on
    (`http_tls_options`). `probes`: the probe listener's own, smaller budget."""
    s = settings
    if probes:
        total, per_peer = PROBE_MAX_CONNECTIONS, PROBE_MAX_CONNECTIONS_PER_PEER
        header_timeout_s = min(PROBE_HEADER_TIMEOUT_S, s.http_header_timeout_s)
    else:
        total = connection_cap(s.http_max_connections, open_file_limit)
        per_peer, header_timeout_s = min(s.http_max_connections_per_peer, total), s.http_header_timeout_s
    protocol = limited_protocol(header_timeout_s=header_timeout_s, body_timeout_s=s.http_body_timeout_s,
                                max_connections=total, max_connections_per_peer=per_peer)
    return uvicorn.Config(
        app, log_level="warning", lifespan="off", access_log=False, http=protocol,
        limit_concurrency=total, backlog=ACCEPT_BATCH, **http_tls_options(settings),
    )


def write_ports_file(path: Path, grpc_port: int, http_port: int, http_scheme: str = "http",
                     probe_port: int | None = None) -> None:
    """Writes `{"grpc_port", "http_port", "pid", "http_scheme"}` (and `"probe_port"` when there is a
    probe listener) as JSON to `path` atomically (a temp file beside it, then a rename), so a
    supervisor that started this teacher on port 0 never reads half of it. `http_scheme` is "https"
    when the HTTP side serves TLS."""
    path = Path(path)
    doc = {"grpc_port": grpc_port, "http_port": http_port, "pid": os.getpid(), "http_scheme": http_scheme}
    if probe_port is not None:
        doc["probe_port"] = probe_port
    write_atomic(path, json.dumps(doc) + "\n")


class _UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the teacher handles signals itself
        yield


class TeacherServer:
    """Owns the gRPC server, the HTTP side, the engine and the batcher."""

    def __init__(self, settings: TeacherSettings, engine: ScoringEngine | None = None):
        self.settings = settings
        self.metrics = TeacherMetrics()
        self.state = ServerState(settings=settings, metrics=self.metrics, engine=engine or create_engine(settings))
        self.service = TeacherService(self.state)  # what both front ends serve
        self.health = health.aio.HealthServicer()
        self.memory = MemoryReturner()
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.probe_port: int | None = None
        self.open_file_limit = 0
        self._grpc: grpc.aio.Server | None = None
        self._http: list[uvicorn.Server] = []  # the HTTP listener, then the probe listener if any
        self._http_tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Binds both servers (NOT_SERVING), then loads the model in a thread (SERVING when done)."""
        s = self.settings
        if (why := s.auth_refusal()) is not None:
            raise AuthRequired(why)
        soft, hard = raise_open_file_limit()
        self.open_file_limit = soft
        log.info("open-file limit %d (hard %d); HTTP connections at most %d", soft, hard,
                 connection_cap(s.http_max_connections, soft))
        self.memory.start()
        opts = grpc_options(s)
        interceptors: list[grpc.aio.ServerInterceptor] = [
            StatusInterceptor(self.metrics, calls=self.state.calls, memory=self.memory, request_bytes=self.state.request_bytes,
                              receive_timeout_s=s.request_receive_timeout_s, watches=self.state.watches,
                              identities=self.state.identities)
        ]
        token = s.bearer_token()
        if token:
            interceptors.insert(0, AuthInterceptor(token, self.metrics, self.memory))
        server = grpc.aio.server(interceptors=interceptors, options=opts)
        pb_grpc.add_TeacherServiceServicer_to_server(TeacherServicer(self.service), server)
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
        if s.ports_file is not None:
            write_ports_file(s.ports_file, self.grpc_port, self.http_port, "https" if creds else "http", self.probe_port)
        log.info(
            "eopd-teacher listening grpc=%s:%d (%s, %s) http=%s:%d (%s)%s (loading %s)", s.host, self.grpc_port,
            "mutual TLS" if s.tls_client_ca_file else "TLS" if creds else "plaintext",
            "bearer token required" if token else "no auth", s.host, self.http_port, "https" if creds else "http",
            f" probes={s.host}:{self.probe_port}" if self.probe_port is not None else "", s.model,
        )
        if s.client_auth() is None:
            log.warning(INSECURE_WARNING, s.host)
        asyncio.get_running_loop().create_task(self._load())

    async def _start_http(self) -> None:
        """The HTTP listener (request bodies held at most http_max_inflight_body_bytes in total:
        `BodyBudget`), then the probe listener if `http_probe_port` is set."""
        s = self.settings
        token, deny = s.bearer_token(), http_deny_unauthenticated(s)
        app = BodyBudget(create_app(self.service, token, deny_unauthenticated=deny),
                         s.http_max_inflight_body_bytes, on_large_body_done=self.memory.message_done)
        self.http_port = self._serve_http(app, s.http_port, probes=False)
        if s.http_probe_port is not None:
            probe_app = create_app(self.service, token, deny_unauthenticated=deny, probes_only=True)
            self.probe_port = self._serve_http(probe_app, s.http_probe_port, probes=True)

    def _serve_http(self, app, port: int, *, probes: bool) -> int:
        sock = _bind_socket(self.settings.host, port)
        server = _UvicornServer(http_config(app, self.settings, self.open_file_limit, probes=probes))
        self._http.append(server)
        self._http_tasks.append(asyncio.get_running_loop().create_task(server.serve(sockets=[sock])))
        return sock.getsockname()[1]

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
            max_client_tokens=s.max_batch_tokens_per_client,
            observer=BatchObserver(on_batch=self.metrics.on_batch, on_queue=self.metrics.on_queue,
                                   on_wait=self.metrics.on_wait, on_delivery=self.metrics.on_delivery),
            steps_fn=self.state.engine.score_steps,  # chunked prefill, where the engine can (None: not)
            step_tokens=s.prefill_chunk_tokens,
            launch_fn=self.state.engine.score_async,  # pipelined: the next batch runs while this one is delivered
        )
        batcher.on_died = self._batcher_died
        batcher.start()
        self.state.batcher = batcher
        self.state.info = served_info(info, s, can_generate=self.state.engine.can_generate)
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        engine = self.state.engine
        self.metrics.statistics_compiled.set_function(lambda: 1.0 if engine.statistics_path == "compiled" else 0.0)
        self.metrics.ready.set(1)
        log.info(
            "ready: %s (%s, vocab %d, context %d, %s statistics) loaded in %.1fs; %s",
            info.model_name, info.dtype, info.vocab_size, info.max_context_length, engine.statistics_path,
            time.perf_counter() - started, cpu_threads_note(),
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
        for server in self._http:
            server.should_exit = True
        for task in self._http_tasks:
            await task
        self.memory.close()
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
    """Serves until a signal; 2 (and why, logged) when the settings name no client authentication
    and no opt-out. With create_token, a missing auth_token_file is created first (0600)."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (why := settings.auth_refusal()) is not None:
        log.error("eopd-teacher serve: %s", why)
        return 2
    if settings.create_token and not Path(settings.auth_token_file).exists():
        write_token_file(Path(settings.auth_token_file))
        log.info("created a new bearer token in %s (mode 0600); clients read it with --auth-token-file", settings.auth_token_file)
    return asyncio.run(TeacherServer(settings).run_until_signal())
