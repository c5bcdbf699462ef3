"""One typed, validated schema for a quaero TOML config.

Judged here, before anything heavy is imported: unknown keys (with the closest valid key), wrong
types, out-of-range values, and the rules the config alone decides. What depends on the installed
components (a known trainer, its capabilities, CUDA, vLLM) is judged in quaero/preflight/plan.py.
Errors are `ConfigError`s whose message names the file, section, key, value and the fix.

The package, by what a reader looks for: `base` (the section base, `ConfigError`, the trainer options a
section takes), the roles' sections, each with its settings (`loop` [training], `rollout` [rollout] with
`advantages`, `guidance` [guidance], `loss` [loss]), `sections` (the other sections), `envs` ([env], [[envs]],
[env.tasks]), `schema` (`QuaeroConfig` and what changed between two configs), `renamed` (old spellings,
read for one release), `load` (TOML and overrides in, one error line out), `rules` (the rules across
sections; a section's own are its validators). Everything a caller needs is importable from `quaero.config`.
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
from quaero.config.guidance import GuidanceConfig, GuidanceSettings
from quaero.config.load import load_config, parse_override
from quaero.config.loop import LoopSettings, TrainingConfig
from quaero.config.loss import LossConfig
from quaero.config.rollout import RolloutConfig, RolloutSettings
from quaero.config.rules import check_rules
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
)
from quaero.task_sampler_registry import TASK_SAMPLERS

__all__ = ["AGGREGATE", "MAX_TASK_WEIGHT", "SINGLE", "TASK_SAMPLERS", "UNTRAINED_KEYS", "AdvantageOptions",
           "BackendConfig",
           "BackendOptions", "ConfigError", "DataConfig", "DistributedConfig", "EchoConfig", "EnvConfig",
           "GuidanceConfig", "GuidanceSettings", "LoggingConfig", "LoopSettings", "LossConfig", "MixtureEnv",
           "ModelConfig", "QuaeroConfig", "RolloutConfig", "RolloutSettings", "RunConfig", "SamplerConfig",
           "TaskSamplerConfig", "TrainingConfig", "changed_keys", "check_rules", "load_config",
           "parse_override", "settings_of", "shares_of", "with_trainer_options"]
