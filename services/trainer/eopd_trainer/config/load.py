"""Loading a run config: the YAML file, then `EOPD_RUN_<SECTION>__<KEY>` environment variables,
then `key=value` overrides with dotted paths, then validation (`config_from_dict`); relative paths
in the file are resolved against the file's directory. Also `dump_config` and `config_for_process`
(the config of a pipeline process started from the command line)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from eopd_common.cpu_threads import cpu_threads_note

from ..objective.config import LossConfig  # it knows the registered loss variants (plugins' too)
from .sections import ConfigError, RunConfig

_PATH_FIELDS = (("run_dir",), ("data", "train_files"), ("data", "eval_files"), ("queue", "auth_key_file"))
# Model specs are presets ("smollm2-135m[drop=14]", "tiny-random@0") or paths: one with a "/" in it
# is a path, relative to the file like the others (configs/smollm2-far.yaml's built student).
_MODEL_FIELDS = (("student", "model"), ("teacher", "model"))


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML: numbers, booleans, lists...)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not of the form key=value (dotted keys, e.g. train.lr=1e-5)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Returns a copy of `data` with each `key=value` applied (intermediate mappings created)."""
    out = _deep_copy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a mapping")
            node = child
        node[path[-1]] = value
    return out


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    def fix(p: Any) -> Any:
        if isinstance(p, str) and p and not os.path.isabs(os.path.expanduser(p)):
            return os.path.normpath(str(base / p))
        return p

    def fix_model(p: Any) -> Any:
        return fix(p) if isinstance(p, str) and "/" in p else p

    for fields, fixer in ((_PATH_FIELDS, fix), (_MODEL_FIELDS, fix_model)):
        for path in fields:
            node = data
            for part in path[:-1]:
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict) or path[-1] not in node:
                continue
            value = node[path[-1]]
            node[path[-1]] = [fixer(v) for v in value] if isinstance(value, list) else fixer(value)


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(root)"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            lines.append(f"  {loc}: {msg}")
        raise ConfigError("invalid run config:\n" + "\n".join(lines)) from None


def load_config(path: Path | str | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Loads a run config: YAML file (optional), then `EOPD_RUN_*` environment variables, then
    `key=value` overrides, then validation.

    Relative paths (run_dir, data files, a model given as a path: one with a "/") in the file are
    relative to the file's directory; in overrides they are relative to the current directory.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping")
        _resolve_paths(loaded, p.resolve().parent)
        data = loaded
    overrides = env_overrides() + list(overrides)
    return config_from_dict(with_loss_defaults(data, overrides))


PER_LOSS = "per_loss"


def with_loss_defaults(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`data` with the `per_loss` defaults of the run's loss merged in, then `overrides` on top.

    `per_loss: {VARIANT: partial config}` (a preset's section, issue 47) holds what a loss wants other
    than the preset's general settings, e.g. its data layout: applied when `loss.variant` (after the
    overrides) names it, over the file's values and under every override, so `loss.variant=gkd` brings
    gkd's layout and `loss.variant=gkd train.batch_size=16` still trains batches of 16. The section
    itself is not part of the result (the effective config a run writes is complete without it;
    `per_loss={}` turns it off). Every entry must be a valid config whichever loss runs: the run's
    own loss's over the file with the overrides; another's over the file with the overrides or over
    the file alone (overrides meant for the run's loss, e.g. gkd's `checkpoint.every=16`, may not
    suit another loss's layout)."""
    staged = apply_overrides(data, overrides)
    table = staged.pop(PER_LOSS, None) or {}
    if not isinstance(table, dict):
        raise ConfigError(f"{PER_LOSS}: a mapping of loss variant -> partial config, got {type(table).__name__}")
    base = {k: v for k, v in data.items() if k != PER_LOSS}
    chosen = _variant(staged)
    for variant, partial in table.items():
        try:
            LossConfig(variant=variant)
        except ValidationError as exc:
            why = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(f"{PER_LOSS}.{variant}: not a loss variant ({why})") from None
        if not isinstance(partial, dict):
            raise ConfigError(f"{PER_LOSS}.{variant}: a partial config (a mapping), got {type(partial).__name__}")
        if "loss" in partial and "variant" in (partial["loss"] or {}):
            raise ConfigError(f"{PER_LOSS}.{variant}: cannot set loss.variant")
        exc = _entry_error(staged, variant, partial)  # over the file with the overrides (what else the run is given)
        if exc is not None and (variant == chosen or _entry_error(base, variant, partial) is not None):
            raise ConfigError(f"{PER_LOSS}.{variant}: {exc}") from None
    out = apply_overrides(deep_merge(base, table.get(chosen) or {}), overrides)
    out.pop(PER_LOSS, None)
    return out


def _entry_error(over: dict[str, Any], variant: str, partial: dict[str, Any]) -> ConfigError | None:
    """The error of `per_loss.<variant>`'s entry applied over `over` (None: a valid config)."""
    try:
        config_from_dict(deep_merge(deep_merge(over, {"loss": {"variant": variant}}), partial))
    except ConfigError as exc:
        return exc
    return None


def _variant(data: dict[str, Any]) -> str:
    return (data.get("loss") or {}).get("variant", LossConfig.model_fields["variant"].default)


def loss_defaults_note(path: Path | str | None, overrides: list[str] | tuple[str, ...], final: RunConfig) -> str | None:
    """What `final = load_config(path, overrides)` took from `per_loss`, in a line (None: nothing), e.g.
    "loss gkd's own settings (per_loss.gkd in the config): rollout.n_samples=1, train.batch_size=8";
    a key an override also sets is named as overridden."""
    if path is None or not Path(path).is_file():
        return None
    data = yaml.safe_load(Path(path).read_text()) or {}
    staged = apply_overrides(data, env_overrides() + list(overrides))
    variant = _variant(staged)
    partial = (staged.get(PER_LOSS) or {}).get(variant) or {}
    if not partial:
        return None
    flat = _flatten(partial)
    items = []
    for key, value in flat.items():
        node: Any = final
        for part in key.split("."):
            node = getattr(node, part, None)
        items.append(f"{key}={value}" if node == value else f"{key}={value} (overridden: {node})")
    return f"loss {variant}'s own settings ({PER_LOSS}.{variant} in the config): " + ", ".join(items)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` deep-merged over a copy of `base` (mappings merged key by key, anything else replaced);
    neither input is modified (also the learner's user DeepSpeed config over the generated one)."""
    out = _deep_copy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else _deep_copy(v)
    return out


ENV_PREFIX = "EOPD_RUN_"


def env_overrides(environ: dict[str, str] | None = None) -> list[str]:
    """`EOPD_RUN_<SECTION>__<KEY>=value` environment variables as `section.key=value` overrides
    (`__` separates levels; names are case-insensitive), e.g. `EOPD_RUN_TEACHER__TARGET=teacher:50051`,
    `EOPD_RUN_SEED=3`. They apply after the file and before command-line overrides."""
    env = os.environ if environ is None else environ
    out = []
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX) or len(name) == len(ENV_PREFIX):
            continue
        key = ".".join(part.lower() for part in name[len(ENV_PREFIX):].split("__"))
        out.append(f"{key}={env[name]}")
    return out


def dump_config(cfg: RunConfig) -> str:
    """The effective config as YAML (written into the run directory for provenance)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_for_process(prog: str, config_file: str | None, overrides: list[str], role: str) -> RunConfig | None:
    """The config of a pipeline process started from the command line, with logging set up; None
    (after printing the error) when the config is invalid, for an exit status of 2."""
    try:
        cfg = load_config(config_file, overrides)
    except (ConfigError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    logging.basicConfig(level=cfg.logging.level, format=f"%(asctime)s %(levelname)s {role} %(message)s", stream=sys.stderr)
    logging.getLogger(f"eopd.{role}").info("%s: %s", prog, cpu_threads_note())
    return cfg
