"""The warm start's demonstrator for the imported Verifiers env (`[training] oracle` in
verifiers_reasoning_gym.toml names it; neither the Verifiers source nor the imported package is touched).

verifiers' `reasoning_gym_env` example builds its tasks as `load_environment()`'s defaults say (arc_1d, 2000
train + 2000 eval examples, seed 0) and stores, as each task's `answer`, the example's index into that
reasoning-gym dataset; the reset's metadata carries the task (`task_spec`). So the demonstrator rebuilds the
same dataset, looks the true answer up and submits it in the env's answer format, through the wrapper's
`submit` tool.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import cache

GYM, EXAMPLES, SEED = "arc_1d", 2000 + 2000, 0  # load_environment()'s defaults


@cache
def _dataset():
    import reasoning_gym

    return reasoning_gym.create_dataset(GYM, size=EXAMPLES, seed=SEED)


def oracle_policy(info: dict) -> Callable[[list[dict]], dict]:
    answer = _dataset()[int(info["task_spec"]["answer"])]["answer"]

    def policy(messages: list[dict]) -> dict:
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": "submit", "arguments": {"completion": f"<answer>{answer}</answer>"}}}]}

    return policy
