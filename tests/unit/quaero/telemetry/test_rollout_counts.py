"""RolloutCounts: one snapshot per step, every counter present, means only over kept episodes; the
recipe's merge refuses two owners of one metric name."""
import threading

import pytest

from quaero.recipe.train import _disjoint
from quaero.telemetry.counts import RolloutCounts, drop_reasons
from quaero.telemetry.names import ROLLOUT_COUNTERS


def test_a_snapshot_has_every_counter_and_no_mean_of_nothing():
    counts = RolloutCounts()
    counts.episode_dropped("timeout")
    counts.episode_dropped("server_error")
    snap = counts.snapshot_and_reset()
    assert set(ROLLOUT_COUNTERS) <= set(snap) and snap["episodes"] == snap["episodes_dropped"] == 2
    assert snap["reward_mean"] is None and snap["success_rate"] is None and snap["turns_mean"] is None
    assert drop_reasons(snap) == {"timeout": 1, "server_error": 1}
    assert counts.snapshot_and_reset()["episodes"] == 0 and drop_reasons(counts.snapshot_and_reset()) == {}


def test_means_are_over_kept_episodes_and_truncated_ones_count_apart():
    counts = RolloutCounts()
    counts.episode_finished(reward=1.0, success=True, truncated=False, turns=2)
    counts.episode_finished(reward=0.5, success=False, truncated=True, turns=4)
    counts.episode_dropped("connection")
    snap = counts.snapshot_and_reset()
    assert snap["episodes"] == 3 and snap["episodes_truncated"] == 1 and snap["episodes_succeeded"] == 1
    assert snap["reward_mean"] == 0.75 and snap["success_rate"] == 0.5 and snap["turns_mean"] == 3


def test_counts_from_many_threads_are_not_lost():
    counts = RolloutCounts()
    threads = [threading.Thread(target=lambda: [counts.add("env_steps") for _ in range(2000)])
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts.snapshot_and_reset()["env_steps"] == 16000


def test_step_metrics_from_two_owners_under_one_name_are_refused():
    assert _disjoint({"rows": 0}, {"episodes": 4}) == {"rows": 0, "episodes": 4}
    with pytest.raises(ValueError, match=r"\['action_tokens'\] come from two owners"):
        _disjoint({"action_tokens": 768}, {"action_tokens": 0})


@pytest.mark.hostile
def test_the_reward_mean_of_huge_finite_rewards_is_their_mean_not_inf():
    """Rewards of 1e308 (finite, accepted): their sum overflowed and the console showed reward_mean=inf."""
    counts = RolloutCounts()
    for reward in (1e308, 1e308, 1e308):
        counts.episode_finished(reward=reward, success=True, truncated=False, turns=1)
    assert counts.snapshot_and_reset()["reward_mean"] == 1e308
    counts.episode_finished(reward=0.1, success=True, truncated=False, turns=1)
    counts.episode_finished(reward=0.2, success=True, truncated=False, turns=1)
    assert counts.snapshot_and_reset()["reward_mean"] == (0.1 + 0.2) / 2  # the scaling is exact
