"""The run's state as the recipe writes and reads it (quaero/recipe/run_state.py): the task state a checkpoint
keeps, a resume under another config or another task sampler."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from fixtures.rollout import make_cfg, recipe_parts

from quaero.recipe.progress import RunProgress
from quaero.rollout.driver import Episode
from quaero.telemetry.counts import RolloutCounts


def test_a_warm_start_checkpoint_may_start_rl_with_another_task_sampler_and_an_rl_one_may_not():
    from quaero.recipe.run_state import load_task_state, task_state
    from quaero.rollout.task_samplers import TaskSamplerError

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        return [[Episode([], 1.0, True, 1, {}, [])] * group_size for _ in tasks]

    from quaero.openenv_client.tasks import TaskCatalog

    catalog = TaskCatalog({"train": 50, "eval": 10}, "test")
    saved = task_state(recipe_parts(make_cfg(training__warmup_sft_steps=2), run, RolloutCounts(), catalog),
                       RunProgress())
    cfg = make_cfg(training__warmup_sft_steps=2, env__tasks={"sampler": "uniform"})
    c = recipe_parts(cfg, run, RolloutCounts(), catalog)
    with structlog.testing.capture_logs() as logs:
        # the warm start's last step
        load_task_state(c, RunProgress(), SimpleNamespace(step=2, tasks=saved, cursor=8))
    assert [(e["checkpoint"], e["config"]) for e in logs if e["event"] == "task_sampler_changed"] == [
        ("sequential", "uniform")]
    with pytest.raises(TaskSamplerError, match=r"'sequential'.*this config's 'uniform'"):
        # RL drew with the other one
        load_task_state(c, RunProgress(), SimpleNamespace(step=3, tasks=saved, cursor=8))
    with structlog.testing.capture_logs() as logs:  # an older quaero's warm start: its cursor alone
        load_task_state(c, RunProgress(), SimpleNamespace(step=2, tasks=None, cursor=8))
    assert [e["checkpoint"] for e in logs if e["event"] == "task_sampler_changed"] == ["sequential"]


def test_a_resume_under_a_changed_config_says_what_changed_and_review_repeats_it(tmp_path, capsys):
    """The run's last config (config.json) against the resumed one: a change that reaches what a step trains
    (the seed: other tasks, other samples) is a warning naming the key and both values; one that only moves
    when the run stops or evaluates is a note; no checkpoint or no change says nothing."""
    from quaero.recipe.run_state import note_changed_config
    from quaero.telemetry import runlog
    from quaero.tools import review, review_command

    before = make_cfg(run__output_dir=str(tmp_path), run__seed=0)
    before.run_dir.mkdir(parents=True)
    (before.run_dir / "config.json").write_text(before.model_dump_json())
    found = (before.run_dir / "checkpoints" / "step-000010", {"step": 10})
    extended = make_cfg(run__output_dir=str(tmp_path), run__seed=0, training__steps=40)
    reseeded = make_cfg(run__output_dir=str(tmp_path), run__seed=1, training__steps=40)
    with structlog.testing.capture_logs() as logs:
        note_changed_config(before, found)  # the same config
        note_changed_config(reseeded, None)  # nothing to resume: a new run
        note_changed_config(extended, found)
        note_changed_config(reseeded, found)
    assert [(e["log_level"], e["checkpoint_step"], e["changes"], e["trained"]) for e in logs] == [
        ("info", 10, {"training.steps": [before.training.steps, 40]}, []),
        ("warning", 10, {"run.seed": [0, 1], "training.steps": [before.training.steps, 40]}, ["run.seed"])]

    runlog.configure(console="none")  # what `quaero review` reads of it, beside a hand-edited line
    with runlog.RunLog(before.run_dir, run_id="r1"):
        note_changed_config(reseeded, found)
        runlog.get_logger("test").info("resume_config_changed", changes=[1], trained="run.seed")
        runlog.get_logger("test").info("train_step", step=11, phase="rl")
    run = review.load_run(before.run_dir)
    assert review.summarize(run).to_dict()["resumed_with_changed_config"] == {
        "10": {"changes": {"run.seed": [0, 1], "training.steps": [before.training.steps, 40]},
               "trained": ["run.seed"]}}
    assert review_command.main(SimpleNamespace(run_dir=str(before.run_dir), require_proof=False, require=[],
                                       plots=None, json=False, compare=None)) == 0
    said = capsys.readouterr().out
    assert ("warning: resumed at step 10 with a changed config (the steps after it train with the new "
            f"values): run.seed 0 -> 1, training.steps {before.training.steps} -> 40") in said


def test_the_resume_point_is_the_newest_checkpoint_and_a_restart_sets_the_old_ones_aside(tmp_path):
    from quaero.recipe import checkpoint
    from quaero.recipe.run_state import resume_point

    cfg = make_cfg(run__output_dir=str(tmp_path))
    with structlog.testing.capture_logs() as logs:
        assert resume_point(cfg, resume=True, restart=False) is None  # nothing to resume: step 1
    assert [e["event"] for e in logs] == ["resume_without_checkpoint"]
    root = checkpoint.run_checkpoints(cfg.run_dir)
    for step in (1, 2):
        checkpoint.save(root, step, {"step": step}, keep=2)
    with structlog.testing.capture_logs() as logs:
        path, state = resume_point(cfg, resume=False, restart=False)  # found without --resume: resumed anyway
    assert path.name == "step-000002" and state["step"] == 2
    assert [e["event"] for e in logs] == ["auto_resume"]
    with structlog.testing.capture_logs() as logs:
        assert resume_point(cfg, resume=False, restart=True) is None
    (aside,) = [e["previous_checkpoints"] for e in logs if e["event"] == "restart"]
    assert sorted(p.name for p in Path(aside).iterdir()) == ["step-000001", "step-000002"]
    assert not root.exists() or not any(root.iterdir())


def _tamper(state: dict, path: tuple, value) -> dict:
    """`state` with the value at `path` (keys into nested dicts and lists) replaced by `value`."""
    state = copy.deepcopy(state)
    inner = state
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return state


@pytest.mark.hostile
@pytest.mark.parametrize(("sampler", "path", "value", "field"), [
    ("curriculum", ("tasks", "pending", "5"), [["env", 999]], "pending['5'] task of env 'env' = 999"),
    ("curriculum", ("tasks", "pending", "5"), [["env", -3]], "pending['5'] task of env 'env' = -3"),
    ("curriculum", ("tasks", "pending", "5"), [["ghost", 1]], "pending['5'] draws ['ghost', 1], not [env"),
    ("curriculum", ("tasks", "pending", "2"), [["env", 1]], "pending['2'] is not a step after 3"),
    ("sequential", ("tasks", "samplers", "env", "state", "cursor"), -5, "cursor = -5 is not an integer"),
    ("sequential", ("tasks", "samplers", "env", "state", "cursor"), 1e30, "cursor = 1e+30 is not an integer"),
    ("curriculum", ("tasks", "mixture", "counts", "env"), -1e6, "mixture counts['env'] = -1000000.0"),
    ("curriculum", ("tasks", "samplers", "env", "state", "memory", "4"), [float("nan"), 0.0, 2.0, 1, 0.0],
     "memory['4'] successes = nan is not a number"),
    ("curriculum", ("tasks", "samplers", "env", "state", "played"), [70], "played = 70 is not an integer"),
])
def test_tampered_resume_state_is_refused_in_one_line_naming_the_checkpoint_and_the_field(sampler, path,
                                                                                          value, field):
    from quaero.openenv_client.tasks import TaskCatalog
    from quaero.recipe import checkpoint
    from quaero.recipe.run_state import resume_from, task_state

    def run(sessions, tasks, *, group_size, policy=None, seed=None):
        return [[Episode([], 1.0, True, 1, {}, [])] * group_size for _ in tasks]

    parts = recipe_parts(make_cfg(env__tasks={"sampler": sampler}), run, RolloutCounts(),
                         TaskCatalog({"train": 50, "eval": 10}, "test"))
    parts = dataclasses.replace(parts, trainer=SimpleNamespace(load_state_dict=lambda state, shards: None))
    progress = RunProgress()
    progress.pending = {5: [["env", 7]]}
    if sampler == "curriculum":
        parts.envs[0].tasks.update(4, [1.0, 0.0], [1.0, 1.0])
    state = checkpoint.RunState(step=3, cursor=0, trainer={}, rng=checkpoint.rng_state(), cumulative={},
                                tasks=task_state(parts, progress)).to_state()
    folder = Path("runs/x/checkpoints/step-000003")
    assert resume_from(parts, RunProgress(), (folder, state)) == 3  # untouched, it resumes
    with pytest.raises(checkpoint.CheckpointError) as e:
        resume_from(parts, RunProgress(), (folder, _tamper(state, path, value)))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{folder}: ") and field in line, line
    assert "edited or is corrupt" in line and "--restart" in line


@pytest.mark.hostile
def test_a_checkpoints_file_is_refused_before_a_step_is_trained_and_a_restart_sets_it_aside(tmp_path):
    from quaero.recipe import checkpoint
    from quaero.recipe.run_state import resume_point

    cfg = make_cfg(run__output_dir=str(tmp_path))
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "checkpoints").write_text("not a folder")
    for resume in (True, False):
        with pytest.raises(checkpoint.CheckpointError, match=r"checkpoints is not a folder; move it aside"):
            resume_point(cfg, resume=resume, restart=False)
    assert resume_point(cfg, resume=False, restart=True) is None
    assert not (cfg.run_dir / "checkpoints").exists()


def test_a_kl_run_cannot_resume_an_rl_checkpoint_that_holds_no_reference():
    """[loss] beta > 0 on a checkpoint written after RL started without the reference: the weights it
    would freeze are gone, so the resume is refused in one line; a warm-start checkpoint, a LoRA run and a
    checkpoint with its reference resume."""
    from quaero.config import load_config
    from quaero.recipe.run_state import missing_reference

    main = Path(__file__).resolve().parents[4] / "envs" / "toolbench.toml"
    cfg = load_config(main, ["loss.beta=0.1", "training.warmup_sft_steps=2"])
    problem = missing_reference(cfg, 3, {"model": {}})
    assert problem.startswith("[loss] beta=0.1: this checkpoint of RL step 3 holds no KL reference")
    assert "--restart" in problem
    assert missing_reference(cfg, 2, {"model": {}}) is None  # the warm start's: taken at the first RL step
    assert missing_reference(cfg, 3, {"model": {}, "reference": {"kind": "copy"}}) is None
    lora = load_config(main, ["loss.beta=0.1", "training.warmup_sft_steps=2", "backend.lora=true"])
    assert missing_reference(lora, 3, {"model": {}}) is None
    assert missing_reference(load_config(main, []), 3, {"model": {}}) is None


@pytest.mark.hostile
def test_a_resume_diff_names_each_env_field_and_a_renamed_run_is_no_trained_change(tmp_path):
    """Round 4: a renamed run's resume warned that what its steps train had changed (run.name), and an
    `[[envs]]` change was one key holding both whole lists of envs."""
    from quaero.config import changed_keys
    from quaero.recipe.run_state import note_changed_config

    envs = [{"entry": "a:A", "weight": 1.0, "kwargs": {"difficulty": 1}}, {"entry": "b:B", "weight": 1.0}]
    moved = [envs[0], {**envs[1], "weight": 3.0}]
    assert changed_keys({"envs": envs}, {"envs": moved}) == {"envs[1].weight": [1.0, 3.0]}
    assert changed_keys({"envs": envs}, {"envs": envs[:1]}) == {"envs[1]": [envs[1], None]}
    assert changed_keys({"stop": [1, 2]}, {"stop": [1, 3]}) == {"stop": [[1, 2], [1, 3]]}  # plain values
    before = make_cfg(run__output_dir=str(tmp_path), run__name="old")
    before.run_dir.mkdir(parents=True)
    (before.run_dir / "config.json").write_text(before.model_dump_json())
    renamed = make_cfg(run__output_dir=str(tmp_path), run__name="new")
    renamed.run_dir.mkdir(parents=True)
    (renamed.run_dir / "config.json").write_text(before.model_dump_json())  # the folder renamed: its config
    with structlog.testing.capture_logs() as logs:
        note_changed_config(renamed, (renamed.run_dir / "checkpoints" / "step-000010", {"step": 10}))
    assert [(e["log_level"], e["changes"], e["trained"]) for e in logs] == [
        ("info", {"run.name": ["old", "new"]}, [])]
