"""The advantage estimator's settings (quaero/rollout/advantages.py reads them): each written once, by its
`option(...)` here (trainers/spec.py's mechanism: the key that sets it, its default, meaning and bounds);
`[training]` takes them as keys (quaero/config/sections.py) and `settings_of` reads them back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainers.spec import option


@dataclass(frozen=True)
class AdvantageOptions:
    """How a group's rewards become its members' advantages (the defaults are quaero's first estimator)."""

    advantage: Literal["grpo", "rloo"] = option(
        "grpo", "training.advantage",
        about="the baseline: `grpo` (the group's mean reward) or `rloo` (the mean of the others)")
    scale_rewards: Literal["none", "group", "batch"] = option(
        "none", "training.scale_rewards",
        about="divide advantages by the group's reward std (`group`), the step's (`batch`) or not at all "
              "(`none`)")
    positive_advantage_weight: float = option(
        1.0, "training.positive_advantage_weight", ge=0,
        about="multiplies positive advantages (W-REINFORCE: 0.1; 0: negative samples only, NSR)")
    all_fail_advantage: float = option(
        0.0, "training.all_fail_advantage", le=0,
        about="every member's advantage in a group with no success and no reward spread (NSR: e.g. -1; 0: "
              "the group trains ECHO only)")
