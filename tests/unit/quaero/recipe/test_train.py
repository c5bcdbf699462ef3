"""The recipe's own arithmetic (quaero/recipe/train.py): group-relative advantages from whatever rewards an
env sends."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import structlog
from fixtures.rollout import make_cfg, recipe_parts

from quaero.recipe.train import _collect
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

    c = recipe_parts(make_cfg(training__tasks_per_step=2, training__group_size=3), run, counts)
    assert _collect(c, 1, sft=False) == []
    assert counts.snapshot_and_reset()["groups_nonfinite_advantage"] == 1


def _scripted_recipe(rewards_of_task, **training):
    """The recipe's rollout over a driver whose groups' rewards are given per train task index (the recipe's
    arithmetic only: no model, no env); records which tasks and seeds each driver call got."""
    counts, calls = RolloutCounts(), []

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        calls.append(([t["index"] for t in tasks], seed))
        return [[Episode([], r, r > 0, 1, {},
                          []) for r in rewards_of_task(t["index"])[:group_size]] for t in tasks]

    cfg = make_cfg(**{f"training__{k}": v for k, v in {"tasks_per_step": 4, "group_size": 2,
                                                       **training}.items()})
    c = recipe_parts(cfg, run, counts)
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
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"],
            s["dynamic_sampling_bound_hits"]) == \
        (8, 4, 4, 0)
    assert s["groups_zero_advantage_share"] == 0.5
    assert cursor(c) == 8  # the next step starts after every task this one used


def test_dynamic_sampling_stops_at_its_bound_and_counts_the_cut():
    c, calls = _scripted_recipe(lambda i: [0.0, 0.0], dynamic_sampling=True, dynamic_sampling_max_groups=2.5)
    _collect(c, 1, sft=False)
    s = c.counts.snapshot_and_reset()
    # 10 = 2.5 x 4 groups, never more
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"],
            s["dynamic_sampling_bound_hits"]) == \
        (10, 10, 6, 1)
    assert cursor(c) == 10


def test_without_dynamic_sampling_zero_advantage_groups_are_counted_and_nothing_more_is_sampled():
    c, calls = _scripted_recipe(lambda i: [0.0, 0.0] if i % 2 else [1.0, 0.5])
    rows = _collect(c, 1, sft=False)
    s = c.counts.snapshot_and_reset()
    assert [ids for ids, _ in calls] == [[0, 1, 2, 3]] and rows == [] and cursor(c) == 4
    assert (s["groups"], s["groups_zero_advantage"], s["groups_resampled"]) == (4, 2, 0)


@pytest.mark.parametrize("start", ["continue", "reset_momentum", "reset"])
def test_the_first_rl_step_after_a_warm_start_resets_the_optimizer_when_configured(monkeypatch, tmp_path,
                                                                                   start):
    import quaero.recipe.train as recipe

    calls = []
    trainer = SimpleNamespace(reset_optimizer=lambda momentum_only: calls.append(("reset", momentum_only)),
                              set_lr=lambda lr: None, device="cpu",
                              train_step=lambda rows, **kw: calls.append("step") or {"rows": len(rows)})
    cfg = make_cfg(training__warmup_sft_steps=2, training__steps=3, training__rl_optimizer_start=start,
                   run__output_dir=str(tmp_path), logging__save_rows="none")
    c = recipe_parts(cfg, None, RolloutCounts())
    c.trainer, c.shares_model = trainer, True
    monkeypatch.setattr(recipe, "sync_sampler", lambda c: {})
    monkeypatch.setattr(recipe, "_collect", lambda c, step, sft: [(object(), [])])
    for step in range(1, 6):
        calls.append(step)
        recipe.run_step(c, step, sft=step <= 2)
    reset = [] if start == "continue" else [("reset", start == "reset_momentum")]
    assert calls == [1, "step", 2, "step", 3, *reset, "step", 4, "step", 5, "step"]


@pytest.mark.hostile
def test_lost_episodes_are_never_trained_counted_per_env_and_stop_the_run_when_configured():
    from quaero.recipe.train import EnvLostError, _lost

    # member 0 of every group lost its server
    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        return [[Episode([], float(g), g > 1, 1, {}, [],
                          dropped=g == 0) for g in range(group_size)] for _ in tasks]

    c = recipe_parts(make_cfg(training__tasks_per_step=2, training__group_size=3), run, RolloutCounts())
    assert _collect(c, 2, sft=False) == []  # scripted episodes hold no rows; the lost ones are never kept
    assert [(g.dropped, g.rewards) for g in c.step_groups] == [(1, [1.0, 2.0])] * 2
    _lost(c, 2)  # on_env_loss = "continue": the run goes on
    c.cfg = make_cfg(training__tasks_per_step=2, training__group_size=3, training__on_env_loss="stop")
    with pytest.raises(EnvLostError, match=r"step 2: env 'env' lost 2 episode\(s\) \(\[training\] "
                                           r"on_env_loss='stop'\); the step was not trained") as e:
        _lost(c, 2)
    assert "\n" not in str(e.value)


@pytest.mark.hostile
def test_a_mixture_env_that_fails_to_start_is_named(tmp_path):
    import contextlib

    from quaero.config import QuaeroConfig
    from quaero.recipe.train import open_pools

    cfg = QuaeroConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "envs": [
        {"name": "sum", "entry": "fixtures.taskenv:SumEnv", "launcher": "inprocess"},
        {"name": "bad", "entry": "fixtures.broken_import:Env", "launcher": "inprocess"}]})
    with contextlib.ExitStack() as stack, pytest.raises(Exception, match=r"\[\[envs\]\] name='bad' failed to "
                                                                          r"start: ") as e:
        open_pools(stack, cfg, RolloutCounts())
    assert "\n" not in str(e.value)


def test_a_mixture_step_shares_groups_by_ratio_and_dynamic_sampling_resamples_the_env_without_spread():
    from quaero.config import QuaeroConfig
    from quaero.recipe.train import EnvRun, env_tasks, learn
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
        "training": {"tasks_per_step": 3, "group_size": 2, "dynamic_sampling": True},
        "sampler": {"max_tokens": 8}})
    counts, envs = RolloutCounts(), []
    for name, view in cfg.views().items():
        pool = SimpleNamespace(sessions=[], tasks=None, task_spec=lambda split, index: {})
        run = runner(name, [1.0, 0.0] if name == "a" else [0.0, 0.0, 0.0])  # only a's groups have spread
        envs.append(EnvRun(name, view, pool, SimpleNamespace(run=run), env_tasks(name, view, pool)))
    c = SimpleNamespace(cfg=cfg, envs=envs, mixture=Mixture(cfg.ratios()), pending={}, counts=counts,
                        traces=None, step_groups=[])
    _collect(c, 1, sft=False)
    seed = cfg.run.seed * 7919 + 1
    # 2:1 -> a plays 2 groups of 2, b 1 group of 3 (its own size, its own seed); then every further group up
    # to the bound (3 x 3 groups) comes from b's sampler, whose groups lacked spread, in b's own numbering
    assert calls[:2] == [("a", [0, 1], 2, seed), ("b", [0], 3, seed + 7_777)]
    assert [(n, ids, g) for n, ids, g, _ in calls[2:]] == [("b", [i], 3) for i in range(1, 7)]
    s = counts.snapshot_and_reset()
    got = (s["groups"], s["groups_zero_advantage"], s["groups_resampled"], s["dynamic_sampling_bound_hits"])
    assert got == (9, 7, 6, 1)
    first = [(g.env, g.task, g.spread) for g in c.step_groups][:3]
    assert first == [("a", 0, True), ("a", 1, True), ("b", 0, False)]
    assert c.mixture.counts == {"a": 2, "b": 1} and c.envs[1].tasks.sampler.cursor == 7
    learn(c, 1, c.step_groups)  # the samplers see every group (sequential ones learn nothing)


def test_a_warm_start_checkpoint_may_start_rl_with_another_task_sampler_and_an_rl_one_may_not():
    from quaero.recipe.train import load_task_state, task_state
    from quaero.rollout.task_samplers import TaskSamplerError

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        return [[Episode([], 1.0, True, 1, {}, [])] * group_size for _ in tasks]

    from quaero.openenv_client.tasks import TaskCatalog

    catalog = TaskCatalog({"train": 50, "eval": 10}, "test")
    saved = task_state(recipe_parts(make_cfg(training__warmup_sft_steps=2), run, RolloutCounts(), catalog))
    cfg = make_cfg(training__warmup_sft_steps=2, env__tasks={"sampler": "uniform"})
    c = recipe_parts(cfg, run, RolloutCounts(), catalog)
    with structlog.testing.capture_logs() as logs:
        load_task_state(c, SimpleNamespace(step=2, tasks=saved, cursor=8))  # the warm start's last step
    assert [(e["checkpoint"], e["config"]) for e in logs if e["event"] == "task_sampler_changed"] == [
        ("sequential", "uniform")]
    with pytest.raises(TaskSamplerError, match=r"'sequential'.*this config's 'uniform'"):
        load_task_state(c, SimpleNamespace(step=3, tasks=saved, cursor=8))  # RL drew with the other one
    with structlog.testing.capture_logs() as logs:  # an older quaero's warm start: its cursor alone
        load_task_state(c, SimpleNamespace(step=2, tasks=None, cursor=8))
    assert [e["checkpoint"] for e in logs if e["event"] == "task_sampler_changed"] == ["sequential"]


def test_a_resume_under_a_changed_config_says_what_changed_and_review_repeats_it(tmp_path, capsys):
    """The run's last config (config.json) against the resumed one: a change that reaches what a step trains
    (the seed: other tasks, other samples) is a warning naming the key and both values; one that only moves
    when the run stops or evaluates is a note; no checkpoint or no change says nothing."""
    from quaero.recipe.train import _note_changed_config
    from quaero.telemetry import runlog
    from quaero.tools import review

    before = make_cfg(run__output_dir=str(tmp_path), run__seed=0)
    before.run_dir.mkdir(parents=True)
    (before.run_dir / "config.json").write_text(before.model_dump_json())
    found = (before.run_dir / "checkpoints" / "step-000010", {"step": 10})
    extended = make_cfg(run__output_dir=str(tmp_path), run__seed=0, training__steps=40)
    reseeded = make_cfg(run__output_dir=str(tmp_path), run__seed=1, training__steps=40)
    with structlog.testing.capture_logs() as logs:
        _note_changed_config(before, found)  # the same config
        _note_changed_config(reseeded, None)  # nothing to resume: a new run
        _note_changed_config(extended, found)
        _note_changed_config(reseeded, found)
    assert [(e["log_level"], e["checkpoint_step"], e["changes"], e["trained"]) for e in logs] == [
        ("info", 10, {"training.steps": [before.training.steps, 40]}, []),
        ("warning", 10, {"run.seed": [0, 1], "training.steps": [before.training.steps, 40]}, ["run.seed"])]

    runlog.configure(console="none")  # what `quaero review` reads of it, beside a hand-edited line
    with runlog.RunLog(before.run_dir, run_id="r1"):
        _note_changed_config(reseeded, found)
        runlog.get_logger("test").info("resume_config_changed", changes=[1], trained="run.seed")
        runlog.get_logger("test").info("train_step", step=11, phase="rl")
    run = review.load_run(before.run_dir)
    assert review.summarize(run).to_dict()["resumed_with_changed_config"] == {
        "10": {"changes": {"run.seed": [0, 1], "training.steps": [before.training.steps, 40]},
               "trained": ["run.seed"]}}
    assert review.main(SimpleNamespace(run_dir=str(before.run_dir), require_proof=False, require=[],
                                       plots=None, json=False, compare=None)) == 0
    said = capsys.readouterr().out
    assert ("warning: resumed at step 10 with a changed config (the steps after it train with the new "
            f"values): run.seed 0 -> 1, training.steps {before.training.steps} -> 40") in said
