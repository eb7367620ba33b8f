"""Scoring engines behind one small interface (`base.ScoringEngine`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..settings import TeacherSettings
    from .base import ScoringEngine


def create_engine(settings: "TeacherSettings") -> "ScoringEngine":
    """The engine named by `settings.engine` (imported lazily: vLLM is an optional extra)."""
    if settings.engine == "transformers":
        from .transformers_engine import TransformersEngine

        return TransformersEngine(settings)
    if settings.engine == "vllm":
        from .vllm_engine import VllmEngine  # noqa: F401  (added with the vLLM engine)

        return VllmEngine(settings)
    raise ValueError(f"unknown engine {settings.engine!r}")
