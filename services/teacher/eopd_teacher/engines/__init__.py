"""Scoring engines behind one small interface (`base.ScoringEngine`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..settings import EngineSettings, TeacherSettings

if TYPE_CHECKING:
    from .base import ScoringEngine


def create_engine(settings: TeacherSettings | EngineSettings) -> ScoringEngine:
    """The engine named by `settings.engine`, given the engine's part of the settings
    (`TeacherSettings.engine_settings()`). Imported lazily: torch and vLLM are extras."""
    engine_settings = settings.engine_settings() if isinstance(settings, TeacherSettings) else settings
    if engine_settings.engine == "transformers":
        from .transformers_engine import TransformersEngine

        return TransformersEngine(engine_settings)
    if engine_settings.engine == "vllm":
        from .vllm_engine import VllmEngine

        return VllmEngine(engine_settings)
    raise ValueError(f"unknown engine {engine_settings.engine!r}")
