"""One validated settings object per service, loaded from (highest priority first) CLI flags,
environment variables, a YAML file, then defaults.

A service defines a frozen `pydantic_settings.BaseSettings` subclass (derived from
`ServiceSettings`); `add_arguments` turns its fields into `--kebab-case` flags and
`load_settings` merges the sources. Unknown keys anywhere are errors.
"""

from __future__ import annotations

import argparse
import contextvars
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

_yaml_file: contextvars.ContextVar[Path | None] = contextvars.ContextVar("eopd_yaml_file", default=None)

S = TypeVar("S", bound="ServiceSettings")


class SettingsError(ValueError):
    """Invalid configuration; the message lists every offending field."""


class ServiceSettings(BaseSettings):
    """Base class: frozen, no unknown keys, YAML file as the lowest-priority explicit source."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid", validate_default=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = _yaml_file.get()
        if path is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(a is bool for a in typing.get_args(annotation))
    return False


def add_arguments(parser: argparse.ArgumentParser, settings_cls: type[ServiceSettings]) -> None:
    """Adds `--config FILE` and one flag per settings field (default: not given)."""
    parser.add_argument("--config", type=Path, default=None, help="YAML settings file")
    for name, field in settings_cls.model_fields.items():
        help_text = (field.description or "").replace("%", "%%")
        # get_default calls a default_factory (e.g. a cache directory), so help never shows PydanticUndefined.
        default = field.get_default(call_default_factory=True)
        if hasattr(default, "get_secret_value"):
            default = "(secret)"
        help_text = f"{help_text} (default: {default})" if help_text else f"default: {default}"
        if _is_bool(field.annotation):
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(_flag(name), dest=name, default=None, metavar=name.upper(), help=help_text)


def load_settings(
    settings_cls: type[S], config_file: Path | str | None = None, overrides: dict[str, Any] | None = None
) -> S:
    """Builds the settings from CLI overrides > env vars > YAML file > defaults.

    Raises SettingsError with one line per invalid field.
    """
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    token = _yaml_file.set(Path(config_file) if config_file else None)
    try:
        if config_file and not Path(config_file).is_file():
            raise SettingsError(f"settings file not found: {config_file}")
        return settings_cls(**overrides)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()]
        raise SettingsError(f"invalid {settings_cls.__name__}:\n" + "\n".join(lines)) from None
    finally:
        _yaml_file.reset(token)


def settings_from_args(settings_cls: type[S], args: argparse.Namespace) -> S:
    """load_settings() from a namespace produced by a parser that had add_arguments()."""
    overrides = {name: getattr(args, name, None) for name in settings_cls.model_fields}
    return load_settings(settings_cls, getattr(args, "config", None), overrides)
