"""Group-relative advantages, the rollouts' one rule (the recipe's RL steps and `[data] traces_loss = "rl"`'s
recorded groups both use it), and the overflow-safe mean it rests on.

The estimators (`[rollout]`, quaero/config/advantages.py `AdvantageOptions`; names as TRL's GRPOConfig
spells them where it has them):
- `advantage = "grpo"` (today's): A_i = r_i - mean(r), the group's mean reward as the baseline;
  `"rloo"` (leave-one-out, Ahmadian et al. 2024, arXiv 2402.14740): A_i = r_i - mean_{j != i} r_j
  = n / (n - 1) (r_i - mean(r)); or `"package.module:function"`, an estimator of your own: a group's rewards
  -> its advantages, then scaled and weighted as the built-in ones (examples/custom_loss/my_loss.py).
- `scale_rewards = "none"` (today's; Dr. GRPO, arXiv 2503.20783: no std, so a group whose rewards are nearly
  equal is not blown up into a large signal), `"group"` (GRPO's A / (std(r of the group) + 1e-4)) or
  `"batch"` (A / (std(r of every kept group of the step) + 1e-4); Hu et al. 2025, REINFORCE++'s batch
  normalisation): std is the sample (n - 1) standard deviation, as TRL's `torch.std`.
- negative-sample reinforcement (Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in
  LLM Reasoning", arXiv 2506.01347): `positive_advantage_weight` λ multiplies every positive advantage
  (W-REINFORCE's λ = 0.1; 0 trains the negative samples only, NSR), and `all_fail_advantage` is what every
  member of a group with no success and no reward spread gets instead of 0 (e.g. -1: its wrong samples are
  pushed down, the reward -1 of W-REINFORCE with no baseline); 0 (today) leaves such a group to ECHO.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

from quaero.config.advantages import AdvantageOptions
from quaero.resolve import resolve_name

STD_EPS = 1e-4  # TRL's, added to the std before dividing
DEFAULT = AdvantageOptions()  # frozen: one shared default


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


def sample_std(xs: Sequence[float]) -> float:
    """The sample standard deviation (n - 1) of `xs`; 0 for fewer than two; inf where it overflows."""
    if len(xs) < 2:
        return 0.0
    try:
        return statistics.stdev(xs)
    except OverflowError:
        return math.inf


def group_advantages(rewards: list[float], successes: list[bool] | None = None,
                     options: AdvantageOptions = DEFAULT, batch_std: float | None = None
                     ) -> list[float]:
    """One group's advantages (the module docstring has each estimator). All-equal groups give exact zeros
    (a rounded mean would leave 1e-17s that count as trained action tokens: their rows train ECHO only), or
    `all_fail_advantage` each where no member succeeded (`successes`; none given: no reward above 0).
    `batch_std`: the step's reward std, for `scale_rewards = "batch"` (`step_advantages` computes it).
    The mean never overflows (`safe_mean`); an advantage can, when the rewards span more than the float
    range, and one past MAX_ABS_ADVANTAGE overflows the fp32 loss (rewards of +-1e308 gave a NaN rl_loss):
    such a group's advantages come back as inf, and the caller leaves it out (groups_nonfinite_advantage)."""
    if min(rewards) == max(rewards):
        failed = not any(successes) if successes is not None else max(rewards) <= 0.0
        return [options.all_fail_advantage if failed else 0.0] * len(rewards)
    advs = estimator(options.advantage)(rewards)
    if options.scale_rewards == "group":
        advs = [a / (sample_std(rewards) + STD_EPS) for a in advs]
    elif options.scale_rewards == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards='batch' needs the step's reward std: call step_advantages")
        advs = [a / (batch_std + STD_EPS) for a in advs]
    elif options.scale_rewards != "none":
        raise ValueError(f"scale_rewards={options.scale_rewards!r}: use 'none', 'group' or 'batch'")
    if options.positive_advantage_weight != 1.0:
        advs = [a * options.positive_advantage_weight if a > 0 else a for a in advs]
    return advs if all(abs(a) <= MAX_ABS_ADVANTAGE for a in advs) else [math.inf] * len(advs)


def grpo(rewards: list[float]) -> list[float]:
    """The group's mean reward as the baseline: A_i = r_i - mean(r)."""
    mean = safe_mean(rewards)
    return [r - mean for r in rewards]


def rloo(rewards: list[float]) -> list[float]:
    """Leave-one-out: A_i = r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean(r))."""
    return [a * len(rewards) / (len(rewards) - 1) for a in grpo(rewards)]


# The estimators by their `[rollout] advantage` name (quaero/config/advantages.py lists the names)
ESTIMATORS: dict[str, Callable[[list[float]], list[float]]] = {"grpo": grpo, "rloo": rloo}


def estimator(name: str) -> Callable[[list[float]], list[float]]:
    """The estimator `name` is: a built-in one, or the user's `package.module:function` (a group's rewards ->
    its advantages, before `scale_rewards` and `positive_advantage_weight`)."""
    if name in ESTIMATORS:
        return ESTIMATORS[name]
    return resolve_name(name, "[rollout] advantage", want=callable, wanted="a function (rewards: "
                        "list[float]) -> list[float]", error=ValueError)


def step_advantages(groups: list[list[float]], successes: list[list[bool]] | None = None,
                    options: AdvantageOptions = DEFAULT) -> list[list[float]]:
    """Every group of one step: `group_advantages` of each, with the std of all their rewards for
    `scale_rewards = "batch"`."""
    pooled = [r for g in groups for r in g]
    batch_std = sample_std(pooled) if options.scale_rewards == "batch" else None
    return [group_advantages(g, None if successes is None else successes[i], options, batch_std)
            for i, g in enumerate(groups)]


MAX_ABS_ADVANTAGE = 1e30  # fp32 holds 3.4e38: room for the loss's sum over 1e8 tokens at clipped ratios
