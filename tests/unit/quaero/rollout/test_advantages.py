"""The advantage estimators (quaero/rollout/advantages.py) against hand computations; the default is
today's group mean."""
import math

import pytest

from quaero.config import QuaeroConfig, TrainingConfig, settings_of
from quaero.rollout.advantages import AdvantageOptions, group_advantages, step_advantages

REWARDS = [1.0, 0.0, 0.0, 0.5]  # mean 0.375; sample std sqrt(((.625)^2 + 2 (.375)^2 + (.125)^2) / 3)
STD = math.sqrt((0.625**2 + 2 * 0.375**2 + 0.125**2) / 3)


def close(xs, ys):
    return len(xs) == len(ys) and all(math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15)
                                      for x, y in zip(xs, ys))


def test_the_default_is_the_group_mean_baseline_without_std():
    assert AdvantageOptions() == settings_of(AdvantageOptions, QuaeroConfig(env={"entry": "m:E"}))
    assert close(group_advantages(REWARDS), [0.625, -0.375, -0.375, 0.125])
    assert group_advantages([0.0, 0.0, 0.0]) == [0.0] * 3  # an all-fail group: no signal (ECHO only)


def test_rloo_is_the_mean_of_the_others():
    # member 0: 1 - (0 + 0 + 0.5) / 3; member 1: 0 - (1 + 0 + 0.5) / 3; member 3: 0.5 - 1 / 3
    got = group_advantages(REWARDS, options=AdvantageOptions(advantage="rloo"))
    assert close(got, [1 - 0.5 / 3, -1.5 / 3, -1.5 / 3, 0.5 - 1 / 3])


def test_group_std_scaling_divides_by_the_groups_sample_std():
    got = group_advantages(REWARDS, options=AdvantageOptions(scale_rewards="group"))
    assert close(got, [a / (STD + 1e-4) for a in (0.625, -0.375, -0.375, 0.125)])


def test_batch_std_scaling_divides_by_the_steps_std():
    groups = [[1.0, 0.0], [0.0, 0.0], [3.0, 1.0]]
    pooled = [1.0, 0.0, 0.0, 0.0, 3.0, 1.0]  # mean 5/6
    std = math.sqrt(sum((r - 5 / 6) ** 2 for r in pooled) / 5)
    got = step_advantages(groups, options=AdvantageOptions(scale_rewards="batch"))
    assert close(got[0], [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)])
    assert got[1] == [0.0, 0.0]
    assert close(got[2], [1.0 / (std + 1e-4), -1.0 / (std + 1e-4)])
    with pytest.raises(ValueError, match="step_advantages"):
        group_advantages([1.0, 0.0], options=AdvantageOptions(scale_rewards="batch"))


def test_w_reinforce_weights_positive_advantages_and_nsr_pushes_an_all_fail_group_down():
    nsr = AdvantageOptions(positive_advantage_weight=0.1, all_fail_advantage=-1.0)
    assert close(group_advantages(REWARDS, options=nsr), [0.0625, -0.375, -0.375, 0.0125])
    assert group_advantages([0.0, 0.0, 0.0], [False] * 3, nsr) == [-1.0] * 3  # wrong samples pushed down
    assert group_advantages([1.0, 1.0], [True, True], nsr) == [0.0, 0.0]  # all solved: nothing to push
    assert group_advantages([0.2, 0.2], None, nsr) == [0.0, 0.0]  # no successes given: reward > 0 succeeded
    assert group_advantages([0.0, 0.0], None, nsr) == [-1.0, -1.0]
    # a group whose members all failed but with partial rewards keeps its baseline
    assert close(group_advantages([0.5, 0.0], [False, False], nsr), [0.025, -0.25])


def test_bad_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="all_fail_advantage"):
        TrainingConfig(all_fail_advantage=1.0)
    with pytest.raises(ValueError, match="advantage='ppo'"):
        group_advantages([1.0, 0.0], options=AdvantageOptions(advantage="ppo"))


def test_an_estimator_of_the_users_own_named_in_the_config_is_scaled_and_weighted_as_the_built_ins(
        monkeypatch):
    from pathlib import Path

    from quaero.config import ConfigError, load_config
    from quaero.config.advantages import ESTIMATORS as NAMES
    from quaero.rollout.advantages import ESTIMATORS

    assert tuple(ESTIMATORS) == NAMES
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[4] / "examples" / "custom_loss"))
    cfg = load_config("envs/toolbench.toml", ["rollout.advantage='my_loss:rank_baseline'",
                                              "rollout.scale_rewards='group'",
                                              "rollout.positive_advantage_weight=0.5"])
    options = settings_of(AdvantageOptions, cfg)
    assert options == AdvantageOptions("my_loss:rank_baseline", "group", 0.5)
    # ranks of [1, 0, 0, 0.5]: 3, 0.5, 0.5, 2 -> centred 1.5, -1, -1, 0.5; / (std(r) + 1e-4); x 0.5 if > 0
    want = [a / (STD + 1e-4) * (0.5 if a > 0 else 1.0) for a in (1.5, -1.0, -1.0, 0.5)]
    assert close(group_advantages(REWARDS, options=options), want)
    assert group_advantages([1.0, 1.0], options=options) == [0.0, 0.0]  # all-equal: quaero's rule, not theirs
    with pytest.raises(ConfigError, match=r"advantage\]: advantage='my_loss:nope': module 'my_loss' has no"):
        load_config("envs/toolbench.toml", ["rollout.advantage='my_loss:nope'"])
    with pytest.raises(ConfigError, match=r"advantage='ppo': expected 'package.module:Name'"):
        load_config("envs/toolbench.toml", ["rollout.advantage='ppo'"])
