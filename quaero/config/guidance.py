"""`[guidance]`: guided episodes (quaero/recipe/guidance.py): when an RL group's kept episodes all fail, some
of its members are played by a guide (the env's oracle, or recorded episodes) on the same task. Each setting
is written once by its `option(...)` in `GuidanceSettings`; `GuidanceConfig` is the section they make, with
the trainer's `gamma` (the policy shaping of guided tokens, trainers/spec.py). A mixture's env may set its
own `guidance` and `guidance_traces` (`[[envs]]`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import model_validator

from quaero.config.base import Located, _Section, with_trainer_options
from trainers.spec import option

Mode = Literal["none", "episode", "prefix"]


@dataclass(frozen=True)
class GuidanceSettings:
    """Which members a guide plays, how many, for how long, and how long a guide may take."""

    # "episode": the oracle's tokens train off-policy with policy shaping (`gamma`); "prefix": on-policy
    # after the guide's turns
    mode: Mode = option(  # noqa: RUF009
        "none", "guidance.mode",
        about="`episode`: an RL group whose kept episodes all fail gets `members` members played whole by "
              "the env's oracle on the same task, trained with policy shaping (see \"Guided episodes\" "
              "below); `prefix`: the oracle plays those members' first `prefix_turns` turns, the policy the "
              "rest (on-policy); `none`: no guide")
    members: int = option(1, "guidance.members", ge=1,
                          about="k, the members guided per all-fail group (<= [rollout] group_size)")
    until_step: int | None = option(
        None, "guidance.until_step", ge=1,
        about="the RL step at which guidance reaches none, annealed linearly from k (unset: never; a warning "
              "at check)")
    prefix_turns: int = option(
        1, "guidance.prefix_turns", ge=1,
        about="`prefix` guidance: the oracle's turns n of a guided member, annealed with k: ceil(n (until - "
              "s) / until) at RL step s")
    timeout_s: float = option(
        60.0, "guidance.timeout_s", gt=0,
        about="the bound in seconds on each call of a guide (the env's oracle); one past it, or one that "
              "raises, drops its member (`guides_timed_out`, `guides_failed`), never the run")
    # a member whose prompt no recording reached (a task not recorded, an env that answered otherwise) is
    # dropped, counted (`guides_unmatched`)
    traces: str | None = option(
        None, "guidance.traces",
        about="the guide is recorded episodes instead of the oracle: a JSONL file of RFC 010 records or "
              "OpenEnv TrainingTraces (`quaero inspect rows RUN --export rfc010`), each action replayed "
              "verbatim where the live prompt's ids equal a recording's (see \"Guided episodes\" below)")


@with_trainer_options("guidance", GuidanceSettings)
class GuidanceConfig(_Section):
    """Guided episodes, with the trainer's `gamma`."""

    @model_validator(mode="after")
    def _traces_guide_something(self) -> GuidanceConfig:
        if self.traces is not None and self.mode == "none":
            raise Located(f"traces={self.traces!r} with mode='none': the recordings would guide nothing; "
                             "set mode = 'episode' or 'prefix', or remove traces")
        return self
