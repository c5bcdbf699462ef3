"""A plain (non-MCP) OpenEnv env defined only in the tests: guess a number from 1 to 20.

Fault hooks for the fault tests: guessing -1 makes step hang for `hang_s` seconds, -2 makes it raise.
"""
from __future__ import annotations

import random
import time

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    prompt: str = ""
    hint: str = ""


class GuessState(State):
    target: int = 0


class GuessEnv(Environment[GuessAction, GuessObservation, GuessState]):
    SUPPORTS_CONCURRENT_SESSIONS = True
    hang_s = 3.0

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, target=random.Random(seed).randint(1, 20))
        return GuessObservation(prompt="Guess my number between 1 and 20.")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        if action.guess == -1:
            time.sleep(self.hang_s)
        if action.guess == -2:
            raise RuntimeError("the env crashed on purpose")
        self._state.step_count += 1
        t = self._state.target
        if action.guess == t:
            return GuessObservation(hint="correct", done=True, reward=1.0)
        return GuessObservation(hint="higher" if action.guess < t else "lower", reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


class SoloGuessEnv(GuessEnv):
    """Same game, but declares that instances cannot run concurrently."""

    SUPPORTS_CONCURRENT_SESSIONS = False


def make_guess_env() -> GuessEnv:
    """A factory entry point (`envs_fixtures.guess:make_guess_env`)."""
    return GuessEnv()


def hint_formatter(observation: dict) -> str:
    """A user formatter: only the hint (or the prompt on reset)."""
    return observation.get("hint") or observation.get("prompt", "")
