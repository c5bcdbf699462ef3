"""Evaluation (quaero/recipe/evaluation.py): the one loop training and `quaero eval` play, on the toy env with
the real Qwen3 renderer and tiny-qwen3 sampling greedily; the `eval` event training logs from it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
from fixtures.rollout import make_cfg
from fixtures.toyenv import ToyChatEnv, oracle

from quaero.config import settings_of
from quaero.openenv_client.tasks import TaskCatalog
from quaero.recipe.evaluation import eval_episodes, evaluate_at
from quaero.recipe.parts import EnvRun, RunParts, env_tasks
from quaero.recipe.progress import RunProgress
from quaero.rollout.driver import DriverSettings, EpisodeDriver
from quaero.rollout.mixture import Mixture
from quaero.telemetry.counts import RolloutCounts


def _pool(eval_size: int = 2):
    return SimpleNamespace(sessions=[ToyChatEnv(), ToyChatEnv()], counts=RolloutCounts(),
                           tasks=TaskCatalog({"train": 10, "eval": eval_size}, "test"),
                           task_spec=lambda split, index: {})


def _transcript(groups) -> list:
    return [(ep.reward, [m.get("content") for m in ep.messages]) for (ep,) in groups]


@pytest.mark.slow
def test_the_eval_loop_plays_the_splits_first_tasks_greedily_and_twice_alike(qwen3_render, tiny_hf_sampler):
    """Never past the split's end; the same run seed gives the same tasks and, greedy, the same episodes:
    what lets `quaero eval` reproduce a run's own eval events."""
    cfg, pool = make_cfg(), _pool(eval_size=2)
    driver = EpisodeDriver(qwen3_render, tiny_hf_sampler, settings_of(DriverSettings, cfg), pool.counts)
    with structlog.testing.capture_logs() as logs:
        tasks, groups = eval_episodes(cfg, driver, pool, "eval", 5, seed=cfg.run.seed, report_as="progress")
    again = eval_episodes(cfg, driver, pool, "eval", 5, seed=cfg.run.seed)
    assert [t["index"] for t in tasks] == [0, 1] and [len(g) for g in groups] == [1, 1]
    assert again[0] == tasks and _transcript(again[1]) == _transcript(groups)
    progress = [(e["done"], e["tasks"]) for e in logs if e["event"] == "progress"]
    assert progress[0] == (0, 2) and progress[-1] == (2, 2)


def test_a_scripted_policy_plays_the_same_tasks(qwen3_render):
    cfg, pool = make_cfg(), _pool(eval_size=3)
    driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
    tasks, groups = eval_episodes(cfg, driver, pool, "eval", 3, seed=0, policy=oracle)
    assert [t["index"] for t in tasks] == [0, 1, 2] and all(ep.success for (ep,) in groups)


def test_training_logs_one_eval_event_with_each_tasks_result(qwen3_render):
    """`evaluate_at` over the oracle as the env's policy stand-in: one `eval` event, its per-task results and
    its figures."""
    cfg, pool = make_cfg(training__eval_tasks=2), _pool(eval_size=2)
    driver = EpisodeDriver(qwen3_render, None, settings_of(DriverSettings, cfg), pool.counts)
    driver.run = _with_policy(driver.run, oracle)
    env = EnvRun("env", cfg, pool, driver, env_tasks("env", cfg, pool))
    parts = RunParts(cfg, SimpleNamespace(device="cpu"), None, qwen3_render, [env], pool.counts, True,
                     Mixture({"env": 1.0}))
    with structlog.testing.capture_logs() as logs:
        evaluate_at(parts, RunProgress(), 0)
    (event,) = [e for e in logs if e["event"] == "eval"]
    assert event["eval_results"] == [[0, 1, 1.0], [1, 1, 1.0]]
    assert (event["eval_episodes"], event["eval_success_rate"], event["eval_dropped"]) == (2, 1.0, 0)
    assert event["sample_transcript"][0].startswith("user: ")


def _with_policy(run, policy):
    def played(*args, **kwargs):
        return run(*args, **{**kwargs, "policy": policy})
    return played
