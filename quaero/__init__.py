"""quaero: reinforcement learning for LLM agents on OpenEnv environments, with exact ECHO training."""

__version__ = "0.1.0"
