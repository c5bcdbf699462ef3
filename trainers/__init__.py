"""quaero trainers: the compute (shared forward, selective log-probs, RL + ECHO losses)."""
