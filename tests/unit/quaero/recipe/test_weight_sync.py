"""The weight sync (quaero/recipe/weight_sync.py): a sampler with its own copy takes the trainer's weights
once after the trainer changed, right before it samples; a sampler sharing the trainer's module never."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from fixtures.rollout import make_cfg, recipe_parts

from quaero.recipe.progress import RunProgress
from quaero.recipe.weight_sync import sync_sampler
from quaero.telemetry.counts import RolloutCounts


def _parts(shares_model: bool):
    pushed = []
    trainer = SimpleNamespace(device="cpu", export_weights=lambda: {"w": len(pushed)})
    sampler = SimpleNamespace(update_weights=pushed.append, weight_transfer="file")
    parts = replace(recipe_parts(make_cfg(), None, RolloutCounts()), trainer=trainer, sampler=sampler,
                    shares_model=shares_model)
    return parts, pushed


def test_the_weights_are_pushed_once_after_the_trainer_changed():
    parts, pushed = _parts(shares_model=False)
    progress = RunProgress()
    assert sync_sampler(parts, progress) == {} and pushed == []  # nothing trained yet
    progress.sampler_behind = True  # a trainer step
    m = sync_sampler(parts, progress)
    assert pushed == [{"w": 0}] and not progress.sampler_behind
    assert (m["weights_pushed"], m["weight_transfer"]) == (1, "file") and m["weight_sync_s"] >= 0
    assert sync_sampler(parts, progress) == {} and len(pushed) == 1  # sampling again: no second push


def test_a_sampler_sharing_the_trainers_module_is_never_pushed_to():
    parts, pushed = _parts(shares_model=True)
    assert sync_sampler(parts, RunProgress(sampler_behind=True)) == {} and pushed == []
