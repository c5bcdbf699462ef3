"""The run's wired parts (quaero/recipe/parts.py): each env's sessions started, an env that fails named."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from quaero.telemetry.counts import RolloutCounts


@pytest.mark.hostile
def test_a_mixture_env_that_fails_to_start_is_named(tmp_path):
    import contextlib

    from quaero.config import QuaeroConfig
    from quaero.recipe.parts import open_pools

    cfg = QuaeroConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "envs": [
        {"name": "sum", "entry": "fixtures.taskenv:SumEnv", "launcher": "inprocess"},
        {"name": "bad", "entry": "fixtures.broken_import:Env", "launcher": "inprocess"}]})
    with contextlib.ExitStack() as stack, pytest.raises(Exception, match=r"\[\[envs\]\] name='bad' failed to "
                                                                          r"start: ") as e:
        open_pools(stack, cfg, RolloutCounts())
    assert "\n" not in str(e.value)


def test_the_parts_are_fixed_for_the_run():
    """What the run is wired from is never swapped mid-run: RunParts and each EnvRun are frozen (what moves
    is RunProgress, quaero/recipe/progress.py)."""
    import dataclasses

    from fixtures.rollout import make_cfg, recipe_parts

    parts = recipe_parts(make_cfg(), None, RolloutCounts())
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.trainer = object()
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.envs[0].driver = object()


def test_an_envs_task_sampler_draws_from_its_train_split_through_the_task_api():
    from fixtures.rollout import make_cfg

    from quaero.openenv_client.tasks import TaskCatalog
    from quaero.recipe.parts import env_tasks

    cfg = make_cfg(env__tasks={"sampler": "uniform"})
    pool = SimpleNamespace(tasks=TaskCatalog({"train": 7, "eval": 3}, "test"), task_spec=lambda s, i: {})
    tasks = env_tasks("env", cfg, pool)
    assert tasks.view.size == 7 and all(0 <= i < 7 for i in tasks.sample(20))
