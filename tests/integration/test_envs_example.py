"""examples/custom_env: a user's own env package and TOML run through quaero's plug-in path as shipped."""
import sys
from pathlib import Path

import pytest

from quaero.config import load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_env"


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # what `pip install -e examples/custom_env` gives a user


def test_example_config_trains_env_over_its_configured_launcher(example_on_path):
    from quaero.config import load_config
    from quaero.openenv_client import open_envs

    cfg = load_config(EXAMPLE / "anagram.toml")
    assert cfg.env.launcher == "local-server" and cfg.env.entry == "anagram_env:AnagramEnv"
    from anagram_env.env import WORDS

    with open_envs(cfg.env, 2) as pool:
        for seed, env in enumerate(pool.sessions):
            start = env.reset(seed=seed)
            scrambled = start.messages[1]["content"].rsplit(" ", 1)[-1]
            assert start.messages[0]["content"].startswith("You unscramble words.")
            # one text field: the action is the reply itself (a JSON object is still read), and the prompt
            # says so
            assert "your whole reply becomes its `word` field" in start.messages[0]["content"]
            wrong = env.step({"role": "assistant", "content": '{"word": "zzzzzz"}'})
            assert wrong.messages[0]["content"].startswith("Feedback: ") and wrong.reward == 0.0
            answer = next(w for w in WORDS if sorted(w) == sorted(scrambled))
            right = env.step({"role": "assistant", "content": f"```json\n{{\"word\": \"{answer}\"}}\n```"})
            assert right.reward == 1.0 and right.done
    assert "anagram_env" in sys.modules


# -- examples/tictactoe: a plain, non-concurrent game with penalties, trained as it is
# ---------------------------
TICTACTOE = EXAMPLE.parent / "tictactoe"


@pytest.fixture
def tictactoe_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TICTACTOE))


def test_tictactoe_prompt_shows_the_board_and_penalties_hold(tictactoe_on_path, qwen3_render):
    from quaero.openenv_client import open_envs

    cfg = load_config(TICTACTOE / "tictactoe.toml")
    with open_envs(cfg.env, 1) as pool:
        env = pool.sessions[0]
        start = env.reset(seed=1)
        prompt = qwen3_render.tokenizer.decode(qwen3_render.prompt_ids(start.messages, None))
        assert "You play X against a fixed opponent (O)." in prompt
        assert "board:\n" in prompt and "legal_moves: [" in prompt  # the default formatter, every field
        assert '"move":{"description":"the free cell to mark, 1-9","type":"integer"}' in prompt
        malformed = env.step({"role": "assistant", "content": "center!"})
        assert malformed.malformed and malformed.reward == cfg.env.malformed_reward == -1.0
        illegal = env.step({"role": "assistant", "content": '{"move": 10}'})
        assert illegal.reward == -1.0 and illegal.done and "illegal move 10" in illegal.messages[0]["content"]


@pytest.mark.slow
def test_tictactoe_trains_as_it_is_with_an_oracle_warm_start(tictactoe_on_path, tmp_path):
    from quaero.recipe.train import train
    from quaero.telemetry.runlog import read_events

    cfg = load_config(
        TICTACTOE / "tictactoe.toml",
        [
            f"run.output_dir='{tmp_path}'",
            "training.warmup_sft_steps=1",
            "training.steps=1",
            "training.eval_every=0",
            "sampler.max_tokens=8",
            "logging.console='none'",
            "logging.progress=false",
        ],
    )
    events = read_events(train(cfg) / "events.jsonl")[0]
    sft, rl = [e for e in events if e["event"] == "train_step"]
    assert sft["phase"] == "sft" and rl["phase"] == "rl" and sft["rows"] > 0 and rl["rows"] > 0
    assert sft["malformed_actions"] == 0 and 0.0 <= sft["reward_mean"] <= 1.0  # the oracle never loses
    # every malformed reply scores [env] malformed_reward = -1; the env's own rewards lie within [-1, 1]
    env_reward = rl["reward_mean"] - cfg.env.malformed_reward * rl["malformed_actions"] / rl["episodes"]
    assert -1.0 <= env_reward <= 1.0
    (opened,) = [e for e in events if e["event"] == "env_pool_opened"]
    assert opened["action"] == "its type parameters" and opened["sessions"] == 2 and opened["servers"] == 2
