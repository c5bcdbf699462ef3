"""What a run tells: the names it writes (names.py), what its rollouts count (counts.py), its run log
(runlog.py), the sinks that mirror it (sinks.py), the proofs read from it (proofs.py) and the
learning-signal watch (outcomes.py)."""
