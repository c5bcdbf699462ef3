"""anagram_env: a user's own OpenEnv environment, trained by quaero without touching quaero's code."""
from .env import AnagramAction, AnagramEnv, AnagramObservation, AnagramState

__all__ = ["AnagramAction", "AnagramEnv", "AnagramObservation", "AnagramState"]
