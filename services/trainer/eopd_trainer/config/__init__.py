"""The run configuration (facade): the sections (`config/sections.py`) and their loading
(`config/load.py`). `from eopd_trainer.config import load_config, RunConfig, ...` is the public
API quoted in the README, the docs, `deploy/` and `scripts/`."""

from .load import (
    ENV_PREFIX,
    apply_overrides,
    config_for_process,
    config_from_dict,
    dump_config,
    env_overrides,
    load_config,
    parse_override,
)
from .sections import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    EvalConfig,
    FaultConfig,
    LoggingConfig,
    QueueConfig,
    RolloutConfig,
    RunConfig,
    StudentConfig,
    TasksConfig,
    TeacherConfig,
    TrainConfig,
    VllmRolloutConfig,
)

__all__ = [
    "ENV_PREFIX",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FaultConfig",
    "LoggingConfig",
    "QueueConfig",
    "RolloutConfig",
    "RunConfig",
    "StudentConfig",
    "TasksConfig",
    "TeacherConfig",
    "TrainConfig",
    "VllmRolloutConfig",
    "apply_overrides",
    "config_for_process",
    "config_from_dict",
    "dump_config",
    "env_overrides",
    "load_config",
    "parse_override",
]
