"""The warm start's demonstrator for OpenEnv's `reasoning_gym_env` as `openenv_reasoning_gym.toml` configures
it (`[training] oracle` names this function; the env package is not touched).

With `reset_kwargs = {dataset_name = "leg_counting", size = 1}` every reset builds a one-question
reasoning-gym dataset from the reset's seed, so the task of a seed is known without the env: rebuild that
dataset and answer its question.
"""
from __future__ import annotations

from collections.abc import Callable

DATASET, SIZE = "leg_counting", 1  # as [env] reset_kwargs says


def oracle_policy(info: dict) -> Callable[[list[dict]], dict]:
    import reasoning_gym

    answer = reasoning_gym.create_dataset(DATASET, size=SIZE, seed=info["seed"])[0]["answer"]

    def policy(messages: list[dict]) -> dict:
        return {"role": "assistant", "content": str(answer)}

    return policy
