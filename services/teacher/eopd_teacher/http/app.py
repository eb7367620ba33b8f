"""The HTTP side: liveness, readiness and Prometheus metrics (FastAPI, served by uvicorn)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..serving.service import TeacherService
from .openai_compat import create_router


def create_app(service: TeacherService, token: str | None = None, *, deny_unauthenticated: bool = False,
               probes_only: bool = False) -> FastAPI:
    """Probes are open (orchestrators call them without credentials); with a bearer token
    configured, every other path (/metrics, /openapi.json) requires it. `deny_unauthenticated`
    (mutual TLS on gRPC, no token; see server.http_tls_options): every other path answers 403.
    `probes_only`: /healthz, /readyz and /metrics alone (the probe listener, `http_probe_port`)."""
    state = service.state
    app = FastAPI(title="eopd teacher", version="v1", docs_url=None, redoc_url=None,
                  openapi_url=None if probes_only else "/openapi.json")
    open_paths = {"/healthz", "/readyz", "/health"}

    if deny_unauthenticated and not token:

        @app.middleware("http")
        async def deny(request: Request, call_next):
            if request.url.path not in open_paths:
                return PlainTextResponse(
                    "forbidden: mutual TLS is on and the HTTP side does not require client certificates; "
                    "set a bearer token (auth_token_file) to open /metrics", status_code=403,
                )
            return await call_next(request)

    if token:
        expected = f"Bearer {token}".encode()

        @app.middleware("http")
        async def require_token(request: Request, call_next):
            if request.url.path not in open_paths:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return PlainTextResponse("missing or invalid bearer token", status_code=401)
            return await call_next(request)

    @app.get("/healthz")
    async def healthz() -> dict:
        """Live: the process and its event loop answer."""
        return {"status": "alive"}

    @app.get("/readyz", responses={503: {"description": "loading, draining or engine unhealthy"}})
    async def readyz() -> JSONResponse:
        """Ready: the model is loaded, the engine is healthy and requests are accepted."""
        body = {
            "ready": state.ready,
            "draining": state.draining,
            "model": state.info.model_name if state.info else None,
            "engine": state.info.engine if state.info else state.settings.engine,
            "queue_tokens": state.batcher.queued_tokens if state.batcher else 0,
            # "compiled" or "eager" (torch.compile off or failed); None while loading.
            "statistics": state.engine.statistics_path if state.info else None,
        }
        if state.load_error:
            body["error"] = state.load_error
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        """Prometheus text exposition, answered at /metrics itself (no redirect to /metrics/)."""
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if not probes_only:
        app.include_router(create_router(service))  # vLLM-compatible /v1/completions, /v1/models, /health
    return app
