"""One typed, validated schema for a quaero TOML config.

Judged here, before anything heavy is imported: unknown keys (with the closest valid key), wrong
types, out-of-range values, and the rules the config alone decides. What depends on the installed
components (a known trainer, its capabilities, CUDA, vLLM) is judged in quaero/preflight/plan.py.
Errors are `ConfigError`s whose message names the file, section, key, value and the fix.

The package, by what a reader looks for: `base` (the section base, `ConfigError`, the trainer options a
section takes), `sections` (every section but the envs'), `envs` ([env], [[envs]], [env.tasks]), `schema`
(`QuaeroConfig` and what changed between two configs), `load` (TOML and overrides in, one error line out,
the rules). Everything a caller needs is importable from `quaero.config`.
"""
from quaero.config.advantages import AdvantageOptions
from quaero.config.base import ConfigError, settings_of, with_trainer_options
from quaero.config.envs import (
    AGGREGATE,
    MAX_TASK_WEIGHT,
    SINGLE,
    EnvConfig,
    MixtureEnv,
    TaskSamplerConfig,
    shares_of,
)
from quaero.config.load import check_rules, load_config, parse_override
from quaero.config.schema import UNTRAINED_KEYS, QuaeroConfig, changed_keys
from quaero.config.sections import (
    BackendConfig,
    BackendOptions,
    DataConfig,
    DistributedConfig,
    EchoConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    SamplerConfig,
    TrainingConfig,
)
from quaero.task_sampler_registry import TASK_SAMPLERS

__all__ = ["AGGREGATE", "MAX_TASK_WEIGHT", "SINGLE", "TASK_SAMPLERS", "UNTRAINED_KEYS", "AdvantageOptions",
           "BackendConfig",
           "BackendOptions", "ConfigError", "DataConfig", "DistributedConfig", "EchoConfig", "EnvConfig",
           "LoggingConfig", "MixtureEnv", "ModelConfig", "QuaeroConfig", "RunConfig", "SamplerConfig",
           "TaskSamplerConfig", "TrainingConfig", "changed_keys", "check_rules", "load_config",
           "parse_override", "settings_of", "shares_of", "with_trainer_options"]
