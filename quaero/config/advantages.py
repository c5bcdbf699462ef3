"""The advantage estimator's settings (quaero/rollout/advantages.py reads them): each written once, by its
`option(...)` here (trainers/spec.py's mechanism: the key that sets it, its default, meaning and bounds);
`[rollout]` takes them as keys (quaero/config/rollout.py) and `settings_of` reads them back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quaero.resolve import resolve_name
from trainers.spec import option

# the built-in estimators (quaero/rollout/advantages.py ESTIMATORS holds each one's formula)
ESTIMATORS = ("grpo", "rloo")


def check_estimator(name: str) -> str:
    """`name` if it is a built-in estimator or names a function of the user's own (imported here, so a bad
    one fails at config load); raises ValueError in one line otherwise."""
    if name not in ESTIMATORS:
        resolve_name(name, "advantage", want=callable, wanted="a function (rewards: list[float]) -> "
                     "list[float]", error=ValueError, example="my_advantages:rank_baseline")
    return name


@dataclass(frozen=True)
class AdvantageOptions:
    """How a group's rewards become its members' advantages (the defaults are quaero's first estimator)."""

    advantage: str = option(
        "grpo", "rollout.advantage",
        about="the baseline: `grpo` (the group's mean reward), `rloo` (the mean of the others), or "
              "`package.module:function` of your own, (rewards: list[float]) -> list[float], a group's "
              "advantages before `scale_rewards` and `positive_advantage_weight`")
    scale_rewards: Literal["none", "group", "batch"] = option(
        "none", "rollout.scale_rewards",
        about="divide advantages by the group's reward std (`group`), the step's (`batch`) or not at all "
              "(`none`)")
    positive_advantage_weight: float = option(
        1.0, "rollout.positive_advantage_weight", ge=0,
        about="multiplies positive advantages (W-REINFORCE: 0.1; 0: negative samples only, NSR); at most 100")
    all_fail_advantage: float = option(
        0.0, "rollout.all_fail_advantage", le=0,
        about="every member's advantage in a group with no success and no reward spread (NSR: e.g. -1; 0: "
              "the group trains ECHO only); -100 to 0 (past it the loss overflows and nothing trains)")
