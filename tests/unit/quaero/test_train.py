"""The recipe's own arithmetic (quaero/train.py): group-relative advantages from whatever rewards an env sends."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from fixtures.rollout import make_cfg

from quaero.rollout import Episode
from quaero.rollout_stats import RolloutStats
from quaero.train import _collect, group_advantages


@pytest.mark.hostile
def test_group_advantages_are_exact_zeros_for_equal_rewards_and_the_mean_never_overflows():
    assert group_advantages([0.1] * 3) == [0.0] * 3  # fmean's mean left -1.4e-17: trained action tokens on noise
    assert group_advantages([1e308, 1e308]) == [0.0, 0.0]  # fmean raised OverflowError: the run died
    # finite, but past what the fp32 loss holds (a NaN rl_loss, the update skipped): left out like an overflow
    assert group_advantages([1e308, -1e308]) == [math.inf, math.inf]
    assert group_advantages([1e30, -1e30]) == [1e30, -1e30]
    assert group_advantages([1.0, 0.0, 0.5]) == [0.5, -0.5, 0.0]
    assert not all(map(math.isfinite, group_advantages([1.7e308, -1.7e308, -1.7e308])))  # the spread overflows


@pytest.mark.hostile
@pytest.mark.parametrize("huge", [[1.7e308, -1.7e308, -1.7e308], [1e308, -1e308, 0.0]])
def test_a_group_whose_advantages_overflow_is_left_out_and_counted(huge):
    stats = RolloutStats()

    def run(*args, **kwargs):  # one group of rewards a float (or the fp32 loss) cannot hold, one ordinary group
        return [[Episode([], r, False, 1, {}, []) for r in rewards] for rewards in (huge, [1.0, 0.0, 0.0])]

    c = SimpleNamespace(cfg=make_cfg(training__tasks_per_step=2, training__group_size=3), cursor=0, oracle=None,
                        driver=SimpleNamespace(run=run), pool=SimpleNamespace(sessions=[]), stats=stats)
    assert _collect(c, 1, sft=False) == []
    assert stats.snapshot_and_reset()["groups_nonfinite_advantage"] == 1
