"""What moves every step (quaero/recipe/progress.py `RunProgress`): what a resumed run needs of it comes back
from a real checkpoint (quaero/recipe/run_state.py), and the next tasks drawn are those the run would have
drawn uninterrupted. The trainer is a stand-in holding one tensor (its own checkpoint is the trainer's
test's)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fixtures.rollout import make_cfg, recipe_parts

from quaero.openenv_client.tasks import TaskCatalog
from quaero.recipe import checkpoint
from quaero.recipe.groups import draw
from quaero.recipe.progress import RunProgress
from quaero.recipe.run_state import resume_from, save_checkpoint
from quaero.recipe.train import collect_rows
from quaero.rollout.driver import Episode
from quaero.telemetry.counts import RolloutCounts


class OneTensorTrainer:
    sharded, device = False, "cpu"

    def __init__(self, value: float) -> None:
        self.weight = torch.full((2, 3), value)

    def state_dict(self) -> dict:
        return {"weight": self.weight.clone()}

    def load_state_dict(self, state: dict, shards=None) -> None:
        self.weight = state["weight"]


def _run(sessions, tasks, *, group_size, policy=None, seed=None):
    return [[Episode([], float(t["index"] % 2 == g % 2), False, 1, {}, []) for g in range(group_size)]
            for t in tasks]


def _parts(tmp_path, trainer_value: float):
    cfg = make_cfg(run__output_dir=str(tmp_path), env__tasks={"sampler": "uniform"},
                   rollout__tasks_per_step=2, rollout__group_size=2)
    parts = recipe_parts(cfg, _run, RolloutCounts(), TaskCatalog({"train": 50, "eval": 10}, "test"))
    return replace(parts, trainer=OneTensorTrainer(trainer_value))


def test_the_progress_a_resume_needs_comes_back_from_the_checkpoint(tmp_path):
    parts, progress = _parts(tmp_path, 1.5), RunProgress()
    for step in (1, 2):
        collect_rows(parts, progress, step, sft=False)
        progress.cumulative.add({"rows": 4, "generated_tokens": 10 * step})
    progress.pending[3] = draw(parts, 3, 2)  # drawn ahead for a step not yet trained
    save_checkpoint(parts, progress, 2)
    assert progress.saved_step == 2

    resumed, theirs = _parts(tmp_path, 0.0), RunProgress()
    found = checkpoint.load_latest(checkpoint.run_checkpoints(parts.cfg.run_dir))
    assert resume_from(resumed, theirs, found) == 2
    assert (theirs.completed_step, theirs.saved_step, theirs.sampler_behind) == (2, 2, True)
    assert theirs.cumulative.totals == progress.cumulative.totals and theirs.pending == progress.pending
    assert torch.equal(resumed.trainer.weight, parts.trainer.weight)
    assert draw(resumed, 4, 2) == draw(parts, 4, 2)  # the task sampler's memory came back too


def test_a_fresh_progress_holds_no_other_runs_state():
    a, b = RunProgress(), RunProgress()
    a.pending[1] = [["env", 0]]
    a.empty.drops["timeout"] = 1
    assert b.pending == {} and b.empty.drops == {} and b.cumulative is not a.cumulative


def test_a_checkpoint_written_by_other_envs_is_refused_in_one_line(tmp_path):
    parts, progress = _parts(tmp_path, 1.0), RunProgress()
    save_checkpoint(parts, progress, 1)
    found = checkpoint.load_latest(checkpoint.run_checkpoints(parts.cfg.run_dir))
    found[1]["tasks"]["samplers"] = {"other": found[1]["tasks"]["samplers"]["env"]}
    with pytest.raises(checkpoint.CheckpointError, match=r"written by envs \['other'\], this config has "
                                                         r"\['env'\]"):
        resume_from(_parts(tmp_path, 0.0), RunProgress(), found)
