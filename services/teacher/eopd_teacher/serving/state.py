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
from .admission import CallSlots
from .resources import ByteBudget
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
    open_streams: int = 0
    request_bytes: ByteBudget = field(init=False)  # max_inflight_request_bytes, shared by all calls
    call_slots: CallSlots = field(init=False)  # max_concurrent_calls, gRPC unary calls and /v1/completions

    def __post_init__(self) -> None:
        self.request_bytes = ByteBudget(self.settings.max_inflight_request_bytes)
        self.call_slots = CallSlots(self.settings.max_concurrent_calls)

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
