"""Unscramble a word in at most 3 guesses. A plain OpenEnv `Environment` (not MCP): the action is one
JSON object {"word": "..."}; the observation says which letters are already in the right place."""
from __future__ import annotations

import random
import uuid

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["planet", "garden", "silver", "window", "rocket", "forest", "bridge", "candle", "pencil", "orange"]


class AnagramAction(Action):
    word: str


class AnagramObservation(Observation):
    scrambled: str = ""
    feedback: str = ""  # e.g. "p.a..t": letters in the right place, dots elsewhere


class AnagramState(State):
    target: str = ""
    guesses_left: int = 3


class AnagramEnv(Environment[AnagramAction, AnagramObservation, AnagramState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each instance owns its puzzle

    def __init__(self) -> None:
        super().__init__()
        self._state = AnagramState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> AnagramObservation:
        rng = random.Random(seed)
        target = rng.choice(WORDS)
        letters = list(target)
        while "".join(letters) == target:
            rng.shuffle(letters)
        self._state = AnagramState(episode_id=episode_id or str(uuid.uuid4()), target=target)
        return AnagramObservation(scrambled="".join(letters), metadata={
            "question": f"Unscramble this word: {''.join(letters)}", "task_id": f"anagram/{seed}"})

    def step(self, action: AnagramAction, timeout_s: float | None = None, **kwargs) -> AnagramObservation:
        st = self._state
        st.step_count += 1
        st.guesses_left -= 1
        guess = action.word.strip().lower()
        if guess == st.target:
            return AnagramObservation(feedback="correct", done=True, reward=1.0)
        feedback = "".join(g if i < len(st.target) and g == st.target[i] else "." for i,
                           g in enumerate(guess))
        return AnagramObservation(feedback=feedback or "no letters", done=st.guesses_left <= 0, reward=0.0)

    @property
    def state(self) -> AnagramState:
        return self._state


def feedback_formatter(observation: dict, context: str = "step") -> str:
    """How the model sees an observation (named in the TOML as [env] formatter)."""
    if context == "reset":
        return (observation.get("metadata") or {}).get("question", "")
    return f"Feedback: {observation.get('feedback', '')}"
