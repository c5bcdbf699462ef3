"""The recipe across ranks, in one process: task shares cover the step's tasks, and one process is the
identity."""
from collections import Counter

import pytest

from quaero import process_group
from quaero.recipe import ranks
from quaero.telemetry.counts import RolloutCounts


@pytest.mark.parametrize("n_tasks,world", [(4, 2), (5, 2), (7, 3), (1, 2), (0, 2)])
def test_task_shares_are_contiguous_and_their_union_is_the_step(monkeypatch, n_tasks, world):
    monkeypatch.setattr(process_group, "world_size", lambda: world)
    shares = []
    for r in range(world):
        monkeypatch.setattr(process_group, "rank", lambda r=r: r)
        shares.append(list(ranks.task_share(n_tasks)))
    assert [t for share in shares for t in share] == list(range(n_tasks))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_one_process_is_the_identity():
    assert ranks.task_share(5) == range(5) and ranks.rank_seed(11) == 11 and ranks.is_main()
    items = [object()]
    assert ranks.gather_rows(items) is items and ranks.total(3) == 3 and ranks.largest(0.5) == 0.5
    assert ranks.from_rank0(lambda: "x") == "x" and not ranks.any_rank(False)
    stats = RolloutCounts()
    stats.episode_finished(reward=1.0, success=True, truncated=False, turns=2)
    assert ranks.rollout_snapshot(stats)["reward_mean"] == 1.0


def test_rollout_counts_are_summed_before_any_mean():
    stats = RolloutCounts()
    stats.episode_finished(reward=1.0, success=True, truncated=False, turns=2)
    other = (Counter(episodes=3, episodes_succeeded=0, kept_turns=3), 0.0)  # another rank: 3 kept, reward 0

    def combine(counts, reward):
        return counts + other[0], reward + other[1]

    snap = stats.snapshot_and_reset(combine)
    assert snap["episodes"] == 4 and snap["reward_mean"] == 0.25 and snap["success_rate"] == 0.25
    assert snap["turns_mean"] == 1.25
