"""examples/custom_env: a user's own env package and TOML run through quaero's plug-in path as shipped."""
import sys
from pathlib import Path

import pytest

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
            assert '"word"' in start.messages[0]["content"]  # the action schema reached the prompt
            wrong = env.step({"role": "assistant", "content": '{"word": "zzzzzz"}'})
            assert wrong.messages[0]["content"].startswith("Feedback: ") and wrong.reward == 0.0
            answer = next(w for w in WORDS if sorted(w) == sorted(scrambled))
            right = env.step({"role": "assistant", "content": f"```json\n{{\"word\": \"{answer}\"}}\n```"})
            assert right.reward == 1.0 and right.done
    assert "anagram_env" in sys.modules
