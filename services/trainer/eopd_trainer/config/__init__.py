"""The run configuration (facade): the sections (`config/sections.py`, the teachers in
`config/teachers.py`) and their loading
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
    loss_defaults_note,
    parse_override,
    with_loss_defaults,
)
from .base import ConfigError
from .sections import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    FaultConfig,
    LoggingConfig,
    QueueConfig,
    RolloutConfig,
    RunConfig,
    StudentConfig,
    TasksConfig,
    ThreadsConfig,
    WeightBroadcastConfig,
    TrainConfig,
    VllmRolloutConfig,
)
from .teachers import DEFAULT_TEACHER, NamedTeacher, RouteConfig, TeacherConfig

__all__ = [
    "DEFAULT_TEACHER",
    "ENV_PREFIX",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FaultConfig",
    "LoggingConfig",
    "NamedTeacher",
    "QueueConfig",
    "RolloutConfig",
    "RouteConfig",
    "RunConfig",
    "StudentConfig",
    "TasksConfig",
    "ThreadsConfig",
    "WeightBroadcastConfig",
    "TeacherConfig",
    "TrainConfig",
    "VllmRolloutConfig",
    "apply_overrides",
    "config_for_process",
    "config_from_dict",
    "dump_config",
    "env_overrides",
    "load_config",
    "loss_defaults_note",
    "parse_override",
    "with_loss_defaults",
]
