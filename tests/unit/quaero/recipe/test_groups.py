"""A step's groups into rows (quaero/recipe/groups.py, through the recipe's `collect_rows`): group-relative
advantages from whatever rewards an env sends, dynamic sampling's further groups, a mixture's share of the
groups; over a scripted driver (no model, no env)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from fixtures.rollout import make_cfg, recipe_parts

from quaero.recipe.progress import RunProgress
from quaero.recipe.train import collect_rows
from quaero.rollout.advantages import group_advantages
from quaero.rollout.driver import Episode
from quaero.telemetry.counts import RolloutCounts


def cursor(c) -> int:
    return c.envs[0].tasks.sampler.cursor


@pytest.mark.hostile
def test_group_advantages_are_exact_zeros_for_equal_rewards_and_the_mean_never_overflows():
    # fmean's mean left -1.4e-17: trained action tokens on noise
    assert group_advantages([0.1] * 3) == [0.0] * 3
    assert group_advantages([1e308, 1e308]) == [0.0, 0.0]  # fmean raised OverflowError: the run died
    # finite, but past what the fp32 loss holds (a NaN rl_loss, the update skipped): left out like an overflow
    assert group_advantages([1e308, -1e308]) == [math.inf, math.inf]
    assert group_advantages([1e30, -1e30]) == [1e30, -1e30]
    assert group_advantages([1.0, 0.0, 0.5]) == [0.5, -0.5, 0.0]
    # the spread overflows
    assert not all(map(math.isfinite, group_advantages([1.7e308, -1.7e308, -1.7e308])))


@pytest.mark.hostile
@pytest.mark.parametrize("huge", [[1.7e308, -1.7e308, -1.7e308], [1e308, -1e308, 0.0]])
def test_a_group_whose_advantages_overflow_is_left_out_and_counted(huge):
    counts = RolloutCounts()

    # one group of rewards a float (or the fp32 loss) cannot hold, one ordinary group
    def run(*args, **kwargs):
        return [[Episode([], r, False, 1, {}, []) for r in rewards] for rewards in (huge, [1.0, 0.0, 0.0])]

    c = recipe_parts(make_cfg(rollout__tasks_per_step=2, rollout__group_size=3), run, counts)
    assert collect_rows(c, RunProgress(), 1, sft=False) == []
    assert counts.snapshot_and_reset()["groups_nonfinite_advantage"] == 1


def _scripted_recipe(rewards_of_task, **rollout):
    """The recipe's rollout over a driver whose groups' rewards are given per train task index (the recipe's
    arithmetic only: no model, no env); records which tasks and seeds each driver call got."""
    counts, calls = RolloutCounts(), []

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        calls.append(([t["index"] for t in tasks], seed))
        return [[Episode([], r, r > 0, 1, {},
                          []) for r in rewards_of_task(t["index"])[:group_size]] for t in tasks]

    cfg = make_cfg(**{f"rollout__{k}": v for k, v in {"tasks_per_step": 4, "group_size": 2,
                                                       **rollout}.items()})
    c = recipe_parts(cfg, run, counts)
    return c, calls


def test_dynamic_sampling_samples_further_groups_until_enough_have_spread():
    # tasks 0-3: only task 1 has spread; tasks 4-6: 5 and 6 have spread; task 7 too
    spread = {1, 5, 6, 7}
    c, calls = _scripted_recipe(lambda i: [1.0, 0.0] if i in spread else [0.0, 0.0], dynamic_sampling=True,
                                dynamic_sampling_max_groups=3.0)
    collect_rows(c, RunProgress(), 1, sft=False)
    s = c.counts.snapshot_and_reset()
    # 1 of 4 had spread -> 3 more (tasks 4-6: 2 with spread, 3 in all) -> 1 more (task 7) -> 4: enough
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert len({seed for _, seed in calls}) == 3  # each further call samples with a seed of its own
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"],
            s["dynamic_sampling_bound_hits"]) == \
        (8, 4, 4, 0)
    assert s["groups_zero_advantage_share"] == 0.5
    assert cursor(c) == 8  # the next step starts after every task this one used


def test_dynamic_sampling_stops_at_its_bound_and_counts_the_cut():
    c, calls = _scripted_recipe(lambda i: [0.0, 0.0], dynamic_sampling=True, dynamic_sampling_max_groups=2.5)
    collect_rows(c, RunProgress(), 1, sft=False)
    s = c.counts.snapshot_and_reset()
    # 10 = 2.5 x 4 groups, never more
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"],
            s["dynamic_sampling_bound_hits"]) == \
        (10, 10, 6, 1)
    assert cursor(c) == 10


def test_without_dynamic_sampling_zero_advantage_groups_are_counted_and_nothing_more_is_sampled():
    c, calls = _scripted_recipe(lambda i: [0.0, 0.0] if i % 2 else [1.0, 0.5])
    rows = collect_rows(c, RunProgress(), 1, sft=False)
    s = c.counts.snapshot_and_reset()
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3]] and rows == [] and cursor(c) == 4
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"]) == (4, 2, 0)


def test_a_mixture_step_shares_groups_by_ratio_and_dynamic_sampling_resamples_the_env_without_spread():
    from quaero.config import QuaeroConfig
    from quaero.recipe.groups import learn
    from quaero.recipe.parts import EnvRun, RunParts, env_tasks
    from quaero.rollout.mixture import Mixture

    calls = []

    def runner(name, rewards):
        def run(sessions, tasks, *, group_size, policy=None, seed=None):
            calls.append((name, [t["index"] for t in tasks], group_size, seed))
            return [[Episode([], r, r > 0, 1, {}, []) for r in rewards[:group_size]] for _ in tasks]
        return run

    cfg = QuaeroConfig.model_validate({
        "envs": [{"name": "a", "entry": "tests:toy", "ratio": 2},
                 {"name": "b", "entry": "tests:toy", "group_size": 3}],
        "rollout": {"tasks_per_step": 3, "group_size": 2, "dynamic_sampling": True},
        "sampler": {"max_tokens": 8}})
    counts, envs = RolloutCounts(), []
    for name, view in cfg.views().items():
        pool = SimpleNamespace(sessions=[], tasks=None, task_spec=lambda split, index: {})
        run = runner(name, [1.0, 0.0] if name == "a" else [0.0, 0.0, 0.0])  # only a's groups have spread
        envs.append(EnvRun(name, view, pool, SimpleNamespace(run=run), env_tasks(name, view, pool)))
    c = RunParts(cfg, trainer=None, sampler=None, render=None, envs=envs, counts=counts, shares_model=False,
                 mixture=Mixture(cfg.ratios()))
    progress = RunProgress()
    collect_rows(c, progress, 1, sft=False)
    seed = cfg.run.seed * 7919 + 1
    # 2:1 -> a plays 2 groups of 2, b 1 group of 3 (its own size, its own seed); then every further group up
    # to the bound (3 x 3 groups) comes from b's sampler, whose groups lacked spread, in b's own numbering
    assert calls[:2] == [("a", [0, 1], 2, seed), ("b", [0], 3, seed + 7_777)]
    assert [(n, ids, g) for n, ids, g, _ in calls[2:]] == [("b", [i], 3) for i in range(1, 7)]
    s = counts.snapshot_and_reset()
    got = (s["groups"], s["groups_zero_advantage"], s["groups_resampled"], s["dynamic_sampling_bound_hits"])
    assert got == (9, 7, 6, 1)
    first = [(g.env, g.task, g.spread) for g in progress.step_groups][:3]
    assert first == [("a", 0, True), ("a", 1, True), ("b", 0, False)]
    assert c.mixture.counts == {"a": 2, "b": 1} and c.envs[1].tasks.sampler.cursor == 7
    learn(c, 1, progress.step_groups)  # the samplers see every group (sequential ones learn nothing)


@pytest.mark.hostile
def test_a_huge_task_group_is_cut_in_the_events_that_carry_it():
    """Round 4: a task spec whose `group` was 10 MB rode whole in every step's task_outcomes event (and the
    eval's groups): cut at 200 characters with the count of what was cut; a scalar stays as it is."""
    from types import SimpleNamespace

    from quaero.recipe.groups import _spec_group
    from quaero.rollout.tasks import spec_label

    huge = "x" * 10_000_000
    env = SimpleNamespace(tasks=SimpleNamespace(view=SimpleNamespace(spec=lambda i: {"group": huge})))
    assert _spec_group(env, 3) == "x" * 200 + "… [9999800 more characters]"
    assert [spec_label(v) for v in ("price", 2, 0.5, None, {"kind": "a"})] == ["price", 2, 0.5, None,
                                                                             "{'kind': 'a'}"]
