"""What every config section shares: frozen, unknown keys refused; and the error type."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """Invalid run configuration; the message lists every offending field by dotted path."""


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
