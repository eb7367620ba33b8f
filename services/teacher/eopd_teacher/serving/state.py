"""What the servicer, the HTTP side and the server lifecycle share: the settings, metrics, engine,
batcher and the served model, and whether requests are accepted now; and the served model's
description (`served_info`): what the engine loaded plus the server's limits and version."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .. import __version__
from ..settings import TeacherSettings
from ..types import EngineInfo, ModelInfo
from .batcher import Draining, DynamicBatcher
from .metrics import TeacherMetrics
from .resources import ByteBudget
from .shares import Identities, PerClientLimit
from .status import NotReady

if TYPE_CHECKING:
    from ..engines.base import ScoringEngine


def served_info(engine_info: EngineInfo, settings: TeacherSettings, *, can_generate: bool = False) -> ModelInfo:
    """What GetModelInfo answers: the engine's model, plus what this server admits (top-k, capped at
    the vocabulary; sequences and tokens per request; Generate's bounds, 0 when the engine cannot
    generate) and its version."""
    return ModelInfo(
        **asdict(engine_info),
        default_top_k=settings.default_top_k,
        max_top_k=min(settings.max_top_k, engine_info.vocab_size),
        max_sequences_per_request=settings.max_sequences_per_request,
        max_tokens_per_request=settings.max_tokens_per_request,
        server_version=__version__,
        max_candidates=min(settings.max_candidates, engine_info.vocab_size),
        max_new_tokens=min(settings.max_new_tokens, engine_info.max_context_length - 1) if can_generate else 0,
        max_generate_samples=settings.max_generate_samples if can_generate else 0,
    )


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
    # The global limits, each with a per-client share (`shares`, `max_client_share`), keyed on `shares.share_key`.
    request_bytes: ByteBudget = field(init=False)  # max_inflight_request_bytes, shared by all calls
    calls: PerClientLimit = field(init=False)  # max_concurrent_calls: unary calls (and Generate) being served
    streams: PerClientLimit = field(init=False)  # max_streams: ScoreStreams open
    tokens: PerClientLimit = field(init=False)  # max_queue_tokens: tokens of requests in flight
    watches: PerClientLimit = field(init=False)  # max_health_watches: grpc.health.v1 Watch streams open
    stalled_streams: PerClientLimit = field(init=False)  # max_streams again: ScoreStreams given up (never read), their slot freed
    refusing_streams: PerClientLimit = field(init=False)  # max_streams again: ScoreStreams refused at open, announcing it in band
    http_bodies: PerClientLimit = field(init=False)  # http_max_concurrent_bodies: HTTP requests whose body is arriving
    identities: Identities = field(init=False)  # whose share a caller counts against (`shares.Identities`)

    def __post_init__(self) -> None:
        s = self.settings
        share = s.max_client_share
        self.request_bytes = ByteBudget(s.max_inflight_request_bytes, share)
        self.calls = PerClientLimit(s.max_concurrent_calls, share)
        self.streams = PerClientLimit(s.max_streams, share)
        self.tokens = PerClientLimit(s.max_queue_tokens, share)
        self.watches = PerClientLimit(s.max_health_watches, share)
        self.stalled_streams = PerClientLimit(s.max_streams, share)
        self.refusing_streams = PerClientLimit(s.max_streams, share)
        self.http_bodies = PerClientLimit(s.http_max_concurrent_bodies, share)
        self.identities = Identities(s.bearer_token())
        for gauge, limit in ((self.metrics.calls_in_progress, self.calls), (self.metrics.open_streams, self.streams),
                             (self.metrics.health_watches, self.watches)):
            gauge.set_function(lambda limit=limit: limit.held)

    @property
    def open_streams(self) -> int:
        return self.streams.held

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
