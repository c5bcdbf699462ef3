"""`[rollout]`: how a step's episodes are sampled and turned into rows (tasks and groups, packing, exactness,
sampling ahead, DAPO's dynamic sampling) and how a group's rewards become advantages. Each setting is written
once by its `option(...)`: `RolloutSettings` here, `AdvantageOptions` in quaero/config/advantages.py (the
estimator reads them back with `settings_of`); `RolloutConfig` is the section they make.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import field_validator, model_validator

from quaero.config.advantages import AdvantageOptions, check_estimator
from quaero.config.base import Located, _Section, with_trainer_options
from trainers.spec import option

# |positive_advantage_weight| and |all_fail_advantage| at most this: a group's advantages are reward
# differences (within [-1, 1] for rewards in [0, 1]); far past them the loss overflows and nothing trains
MAX_ADVANTAGE_SETTING = 100.0


@dataclass(frozen=True)
class RolloutSettings:
    """A step's rollout (quaero/recipe/groups.py, quaero/rollout/driver.py, quaero/recipe/ahead.py)."""

    tasks_per_step: int = option(4, "rollout.tasks_per_step", ge=1, about="tasks sampled per RL step")
    group_size: int = option(
        4, "rollout.group_size", ge=1,
        about="episodes per task; advantages are group-relative, so at least 2 for RL")
    packing: bool = option(
        True, "rollout.packing",
        about="one row per episode when turns extend each other exactly, else one per transition")
    strict: bool = option(
        False, "rollout.strict",
        about="an exactness mismatch (prefix, bridge) is an error instead of a counted fallback")
    # each step's rollout at most k policy versions behind the weights it trains; >= 1 gives the hf sampler
    # a copy of the model of its own
    max_off_policy_steps: int = option(
        0, "rollout.max_off_policy_steps", ge=0,
        about="asynchronous rollouts: sample up to k steps ahead while a step trains (docs/scaling.md)")
    dynamic_sampling: bool = option(
        False, "rollout.dynamic_sampling",
        about="while fewer than `tasks_per_step` groups have reward spread, sample groups of further tasks "
              "(DAPO); all-equal groups still train ECHO")
    dynamic_sampling_max_groups: float = option(
        3.0, "rollout.dynamic_sampling_max_groups", ge=1.0, le=100.0,
        about="the bound: at most this many x `tasks_per_step` groups per step (1 to 100; each round is "
              "logged, a stop request ends the rounds)")


@with_trainer_options("rollout", RolloutSettings, AdvantageOptions)
class RolloutConfig(_Section):
    """The rollout and the advantage estimator."""

    @field_validator("positive_advantage_weight", "all_fail_advantage", check_fields=False)
    @classmethod
    def _an_advantage_that_trains(cls, value: float, info) -> float:
        # -1e308 passes le=0, yet every step's loss is then inf and its gradient skipped: nothing trains
        if abs(value) > MAX_ADVANTAGE_SETTING:
            raise ValueError(f"{info.field_name}={value:g}: advantages past +-{MAX_ADVANTAGE_SETTING:g} "
                             "make the loss overflow (inf: every step's gradient is skipped and nothing "
                             "trains); use a value within it (a group's advantages are reward differences: "
                             "NSR's all_fail_advantage is -1, W-REINFORCE's positive_advantage_weight 0.1)")
        return value

    @field_validator("advantage", check_fields=False)
    @classmethod
    def _an_estimator(cls, name: str) -> str:
        return check_estimator(name)

    @model_validator(mode="after")
    def _sampled_ahead_or_dynamic(self) -> RolloutConfig:
        if self.dynamic_sampling and self.max_off_policy_steps:
            raise Located(f"dynamic_sampling=true with max_off_policy_steps={self.max_off_policy_steps}: "
                             "a step sampled ahead cannot know how many tasks the steps before it used; set "
                             "one of them off")
        return self
