"""`quaero bench samplers`: each arm's groups with signal per generated token from its `task_outcomes`, its
last eval paired against the warm start's and against the `sequential` arm of its seed, per spec group
through the env's own Task API, and finished arms read instead of trained again."""
import json

import pytest

from benchmarks import samplers
from quaero.config import load_config
from quaero.telemetry import names, runlog

# per sampler: (groups per RL step as (task, template, successes, spread, tokens), eval successes of tasks
# 0..7)
ARMS = {
    "sequential": ([[(0, "price", 0, 0, 500), (1, "city", 8, 0, 500)]] * 2, [1, 1, 0, 0, 0, 0, 0, 0]),
    "curriculum": ([[(2, "city", 4, 1, 250), (3, "city", 3, 1, 250)]] * 4, [1, 1, 1, 1, 0, 0, 0, 0]),
}


def _events(run_dir, steps, evals):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(run_dir, run_id="r"):
        for step, groups in steps:
            runlog.set_step(step)
            log.info(names.TASK_OUTCOMES_EVENT, for_step=step, groups=[
                ["env", task, template, wins, 8, spread, tokens]
                for task, template, wins, spread, tokens in groups])
            log.info(names.TRAIN_STEP_EVENT, phase="rl", loss=0.1)
        for step, wins in evals:
            runlog.set_step(step)
            log.info(names.EVAL_EVENT, eval_results=[[i, w, float(w)] for i, w in enumerate(wins)])
        log.info(names.RUN_END_EVENT, status="finished")


@pytest.fixture
def warm_run(tmp_path):
    from quaero.recipe import checkpoint

    source = tmp_path / "warm"
    checkpoint.save(source / "checkpoints", 500, {"step": 500}, keep=2)
    _events(source, [], [(500, [1, 0, 0, 0, 0, 0, 0, 0])])
    return source


def test_every_env_of_a_mixture_gets_the_sampler_and_a_learner_its_key():
    cfg = load_config("envs/toolbench_mixture.toml")
    assert samplers.arm_sets(cfg.views(), True, "curriculum", "group") == [
        "envs.d1.tasks.sampler=curriculum", "envs.d1.tasks.key=group",
        "envs.d2.tasks.sampler=curriculum", "envs.d2.tasks.key=group"]
    one = load_config("envs/toolbench.toml")
    assert samplers.arm_sets(one.views(), False, "uniform", "group") == ["env.tasks.sampler=uniform"]


def test_arms_compare_per_token_and_pair_with_the_warm_start_and_sequential(tmp_path, warm_run, monkeypatch):
    trained = []

    def train_arm(config, out, name, seed, arm, common, source, from_step):
        sampler = name.rsplit("-s", 1)[0]
        assert "training.rl_token_budget=2000" in common and source == warm_run and from_step == 500
        steps, wins = ARMS[sampler]
        _events(out / name, [(501 + i, g) for i, g in enumerate(steps)], [(500 + len(steps), wins)])
        trained.append(name)
        return out / name

    monkeypatch.setattr(samplers, "train_arm", train_arm)
    argv = ["envs/toolbench.toml", "--from", str(warm_run), "--from-step", "500", "--seeds", "0,1",
            "--samplers", "sequential,curriculum", "--budget", "2000", "--out", str(tmp_path / "out")]
    assert samplers.main(argv) == 0
    assert sorted(trained) == ["curriculum-s0", "curriculum-s1", "sequential-s0", "sequential-s1"]
    report = json.loads((tmp_path / "out" / "samplers.json").read_text())["envs"]["None"]
    row = next(r for r in report["rows"] if r["sampler"] == "curriculum" and r["seed"] == 1)
    # 8 groups, all with spread, over 2,000 tokens; sequential: 0 of 4 over 2,000
    assert (row["rl_steps"], row["tokens"], row["groups"], row["signal"]) == (4, 2000, 8, 8)
    assert row["signal_per_1k"] == 4.0 and row["by_group"] == {"city": [8, 8, 28, 64]}
    assert (row["vs_warm_start"]["a_only"], row["vs_warm_start"]["b_only"]) == (3, 0)
    assert (row["vs_sequential"]["a_only"], row["vs_sequential"]["b_only"]) == (2, 0)
    pooled = report["pooled"]["curriculum"]
    assert (pooled["vs_sequential"]["pairs"], pooled["vs_sequential"]["a_only"]) == (16, 4)
    # held-out per template, through toolbench's own get_task on its eval split
    from envs.toolbench import ToolBenchEnv

    env = ToolBenchEnv(**load_config("envs/toolbench.toml").env.kwargs)
    templates = [env.get_task("eval", i)["group"] for i in range(8)]
    wins = ARMS["curriculum"][1]
    solved = {t: 2 * sum(w for w, tt in zip(wins, templates) if tt == t) for t in set(templates)}
    assert {k: v[0] for k, v in pooled["eval_by_group"].items()} == solved
    text = samplers.render(json.loads((tmp_path / "out" / "samplers.json").read_text()))
    assert "| 1 | curriculum | 4 | 2,000 | 8 | 8 | 4.000 | 0.500 | +3/-0, p 0.25 | +2/-0, p 0.5 |" in text
    assert "| sequential | 4,000 | 8 | 0 | 0.000 | 0.250 | +2/-0, p 0.5 | n/a |" in text
    assert "| curriculum | 4,000 | 16 | 16 | 4.000 | 0.500 | +6/-0, p 0.031 | +4/-0, p 0.12 |" in text

    # a second call reads the finished arms and trains none
    trained.clear()
    assert samplers.main(argv) == 0 and trained == []
