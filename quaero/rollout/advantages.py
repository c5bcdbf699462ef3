"""Group-relative advantages, the rollouts' one rule (the recipe's RL steps and `[data] traces_loss = "rl"`'s
recorded groups both use it), and the overflow-safe mean it rests on."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def safe_mean(xs: Sequence[float]) -> float:
    """The mean of `xs`: `statistics.fmean`'s correctly rounded value, or, where its exact sum overflows
    (finite values near the float limit, e.g. a hostile env's rewards), the mean of the scaled values,
    which cannot overflow. Raises ValueError on an empty sequence."""
    if not xs:
        raise ValueError("safe_mean of an empty sequence")
    try:
        return statistics.fmean(xs)
    except OverflowError:
        return sum(x / len(xs) for x in xs)


def group_advantages(rewards: list[float]) -> list[float]:
    """Group-relative advantages: reward minus the group mean (no std scaling, so a group whose
    rewards are nearly equal is not blown up into a large signal). All-equal groups give exact zeros
    (a rounded mean would leave 1e-17s that count as trained action tokens): their rows train ECHO only.
    The mean never overflows (`safe_mean`); an advantage can, when the rewards span more than the float
    range, and one past MAX_ABS_ADVANTAGE overflows the fp32 loss (rewards of +-1e308 gave a NaN rl_loss):
    such a group's advantages come back as inf, and the caller leaves it out (groups_nonfinite_advantage)."""
    if min(rewards) == max(rewards):
        return [0.0] * len(rewards)
    mean = safe_mean(rewards)
    advs = [r - mean for r in rewards]
    return advs if all(abs(a) <= MAX_ABS_ADVANTAGE for a in advs) else [math.inf] * len(advs)


MAX_ABS_ADVANTAGE = 1e30  # fp32 holds 3.4e38: room for the loss's sum over 1e8 tokens at clipped ratios
