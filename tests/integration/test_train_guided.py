"""Guided episodes in a real run (the main job: toolbench on 127.0.0.1, tiny-qwen3, the local trainer): the
random policy fails every group, so the first RL step's groups each get the oracle's member, trained with
policy shaping, and from `guidance_until_step` on none is guided."""
import pytest
from fixtures.runs import events_of, make_config


@pytest.mark.slow
def test_a_run_guides_its_all_fail_groups_until_the_schedule_reaches_none(tmp_path):
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "guided", steps=3, warmup=0, eval_every=10, extra=[
        "training.guidance=episode", "training.guided_members=1", "training.guidance_until_step=2"])
    steps = events_of(train(cfg), "train_step")
    assert [s["phase"] for s in steps] == ["rl"] * 3
    first, *later = steps
    assert first["guidance_members"] == 1
    assert first["groups_guided"] == first["guided_members"] >= 1
    assert first["guided_action_tokens"] > 0 and first["guided_tokens"] == first["guided_action_tokens"]
    assert first["onpolicy_action_tokens"] + first["guided_action_tokens"] == first["action_tokens"]
    low, mean, high = (first[f"guidance_shaping_{k}"] for k in ("min", "mean", "max"))
    assert 0 < low <= mean <= high < 1
    for s in later:  # RL steps 2 and 3: the schedule is at none
        assert s["guidance_members"] == 0 and s["groups_guided"] == 0 and s["guided_action_tokens"] == 0
        assert s["guidance_shaping_mean"] is None
