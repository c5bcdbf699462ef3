"""The recipe's own arithmetic (quaero/recipe/train.py): group-relative advantages from whatever rewards an env sends."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from fixtures.rollout import make_cfg

from quaero.recipe.train import _collect
from quaero.rollout.advantages import group_advantages
from quaero.rollout.driver import Episode
from quaero.telemetry.counts import RolloutCounts


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
    counts = RolloutCounts()

    def run(*args, **kwargs):  # one group of rewards a float (or the fp32 loss) cannot hold, one ordinary group
        return [[Episode([], r, False, 1, {}, []) for r in rewards] for rewards in (huge, [1.0, 0.0, 0.0])]

    c = SimpleNamespace(cfg=make_cfg(training__tasks_per_step=2, training__group_size=3), cursor=0, oracle=None,
                        driver=SimpleNamespace(run=run), pool=SimpleNamespace(sessions=[], tasks=None), counts=counts)
    assert _collect(c, 1, sft=False) == []
    assert counts.snapshot_and_reset()["groups_nonfinite_advantage"] == 1


def _scripted_recipe(rewards_of_task, **training):
    """The recipe's rollout over a driver whose groups' rewards are given per train task index (the recipe's
    arithmetic only: no model, no env); records which tasks and seeds each driver call got."""
    counts, calls = RolloutCounts(), []

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        calls.append(([t["index"] for t in tasks], seed))
        return [[Episode([], r, r > 0, 1, {}, []) for r in rewards_of_task(t["index"])[:group_size]] for t in tasks]

    cfg = make_cfg(**{f"training__{k}": v for k, v in {"tasks_per_step": 4, "group_size": 2, **training}.items()})
    c = SimpleNamespace(cfg=cfg, cursor=0, oracle=None, driver=SimpleNamespace(run=run),
                        pool=SimpleNamespace(sessions=[], tasks=None), counts=counts)
    return c, calls


def test_dynamic_sampling_samples_further_groups_until_enough_have_spread():
    # tasks 0-3: only task 1 has spread; tasks 4-6: 5 and 6 have spread; task 7 too
    spread = {1, 5, 6, 7}
    c, calls = _scripted_recipe(lambda i: [1.0, 0.0] if i in spread else [0.0, 0.0], dynamic_sampling=True,
                                dynamic_sampling_max_groups=3.0)
    _collect(c, 1, sft=False)
    s = c.counts.snapshot_and_reset()
    # 1 of 4 had spread -> 3 more (tasks 4-6: 2 with spread, 3 in all) -> 1 more (task 7) -> 4: enough
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert len({seed for _, seed in calls}) == 3  # each further call samples with a seed of its own
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"], s["dynamic_sampling_bound_hits"]) == \
        (8, 4, 4, 0)
    assert s["groups_zero_advantage_share"] == 0.5
    assert c.cursor == 8  # the next step starts after every task this one used


def test_dynamic_sampling_stops_at_its_bound_and_counts_the_cut():
    c, calls = _scripted_recipe(lambda i: [0.0, 0.0], dynamic_sampling=True, dynamic_sampling_max_groups=2.5)
    _collect(c, 1, sft=False)
    s = c.counts.snapshot_and_reset()
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # 10 = 2.5 x 4 groups, never more
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"], s["dynamic_sampling_bound_hits"]) == \
        (10, 10, 6, 1)
    assert c.cursor == 10


def test_without_dynamic_sampling_zero_advantage_groups_are_counted_and_nothing_more_is_sampled():
    c, calls = _scripted_recipe(lambda i: [0.0, 0.0] if i % 2 else [1.0, 0.5])
    rows = _collect(c, 1, sft=False)
    s = c.counts.snapshot_and_reset()
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3]] and rows == [] and c.cursor == 4
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"]) == (4, 2, 0)


@pytest.mark.parametrize("start", ["continue", "reset_momentum", "reset"])
def test_the_first_rl_step_after_a_warm_start_resets_the_optimizer_when_configured(monkeypatch, tmp_path, start):
    import quaero.recipe.train as recipe

    calls = []
    trainer = SimpleNamespace(reset_optimizer=lambda momentum_only: calls.append(("reset", momentum_only)),
                              set_lr=lambda lr: None,
                              train_step=lambda rows, **kw: calls.append("step") or {"rows": len(rows)})
    cfg = make_cfg(training__warmup_sft_steps=2, training__steps=3, training__rl_optimizer_start=start,
                   run__output_dir=str(tmp_path), logging__save_rows="none")
    c = SimpleNamespace(cfg=cfg, trainer=trainer, counts=RolloutCounts(), shares_model=True, traces=None)
    monkeypatch.setattr(recipe, "sync_sampler", lambda c: {})
    monkeypatch.setattr(recipe, "_collect", lambda c, step, sft: [(object(), [])])
    for step in range(1, 6):
        calls.append(step)
        recipe.run_step(c, step, sft=step <= 2)
    reset = [] if start == "continue" else [("reset", start == "reset_momentum")]
    assert calls == [1, "step", 2, "step", 3, *reset, "step", 4, "step", 5, "step"]
