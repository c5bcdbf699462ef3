"""The recipe's step (quaero/recipe/train.py `run_step`): the optimizer at the first RL step, lost episodes
never trained; over a scripted driver (no model, no env)."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from fixtures.rollout import make_cfg, recipe_parts

from quaero.recipe.progress import RunProgress
from quaero.recipe.train import collect_rows
from quaero.rollout.driver import Episode
from quaero.telemetry.counts import RolloutCounts


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
    c = replace(recipe_parts(cfg, None, RolloutCounts()), trainer=trainer, shares_model=True)
    monkeypatch.setattr(recipe, "sync_sampler", lambda parts, progress: {})
    monkeypatch.setattr(recipe, "collect_rows", lambda parts, progress, step, sft: [(object(), [])])
    progress = RunProgress()
    for step in range(1, 6):
        calls.append(step)
        recipe.run_step(c, progress, step, sft=step <= 2)
    reset = [] if start == "continue" else [("reset", start == "reset_momentum")]
    assert calls == [1, "step", 2, "step", 3, *reset, "step", 4, "step", 5, "step"]


@pytest.mark.hostile
def test_lost_episodes_are_never_trained_counted_per_env_and_stop_the_run_when_configured():
    from quaero.recipe.stop import EnvLostError, check_env_loss

    # member 0 of every group lost its server
    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        return [[Episode([], float(g), g > 1, 1, {}, [],
                          dropped=g == 0) for g in range(group_size)] for _ in tasks]

    c = recipe_parts(make_cfg(rollout__tasks_per_step=2, rollout__group_size=3), run, RolloutCounts())
    progress = RunProgress()
    # scripted episodes hold no rows; the lost ones are never kept
    assert collect_rows(c, progress, 2, sft=False) == []
    assert [(g.dropped, g.rewards) for g in progress.step_groups] == [(1, [1.0, 2.0])] * 2
    check_env_loss(c.cfg, progress.step_groups, 2)  # on_env_loss = "continue": the run goes on
    stops = make_cfg(rollout__tasks_per_step=2, rollout__group_size=3, training__on_env_loss="stop")
    with pytest.raises(EnvLostError, match=r"step 2: env 'env' lost 2 episode\(s\) \(\[training\] "
                                           r"on_env_loss='stop'\); the step was not trained") as e:
        check_env_loss(stops, progress.step_groups, 2)
    assert "\n" not in str(e.value)
