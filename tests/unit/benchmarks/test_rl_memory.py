"""benchmarks/rl_memory.py (`quaero bench rl-memory`): its rollout-shaped rows and the plans it reads."""
import pytest

from benchmarks.rl_memory import episode_row, plans


def test_an_episode_row_is_a_prompt_then_turns_of_action_and_env_response():
    row = episode_row(1900, prompt=350, turns=4, action=48, advantage=0.5, vocab=1000, seed=0)
    assert len(row) == 1900 and sum(row.action_mask) == 4 * 48
    assert not any(row.action_mask[:350]) and not any(w > 0 for w in row.echo_weights[:350])
    assert sum(1 for w in row.echo_weights if w > 0) == 1900 - 350 - 4 * (3 + 48 + 5)
    assert {a for a in row.advantages if a} == {0.5}
    with pytest.raises(SystemExit, match="cannot hold"):
        episode_row(360, prompt=350, turns=4, action=48, advantage=0.0, vocab=1000, seed=0)


def test_the_rl_microbatch_plan_is_the_configs_at_the_measured_row():
    """SmolLM2-135M, float32 + LoRA r 16, micro_batch_tokens 2048: one 1,900-token row a microbatch, planned
    below `quaero check`'s longest row (2,048 tokens) and above its weights."""
    from quaero.config.load import load_config

    cfg = load_config("envs/toolbench_smollm2.toml")
    out = plans(cfg, 1900, 1500)
    assert out["plan_rl_microbatch_rows"] == 1
    assert out["plan_parts_gib"]["weights"] < out["plan_rl_microbatch_gib"] <= out["plan_check_gib"]
