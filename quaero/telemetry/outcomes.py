"""Whether a run's RL steps carried a learning signal, said during the run and at its end.

An RL step trains its action tokens only where a group's rewards differ (group-relative advantage). When no
action is valid, or every episode of a group earns the same reward, every advantage is 0: the step trains
ECHO alone, and a run of such steps learns nothing about acting, however cleanly it finishes. A new env with a
random-init or too-small model does exactly this. `SignalWatch` counts, per RL step, the action tokens that
carried an advantage (the trainer's `action_tokens`; none on a step the optimizer skipped), the valid actions
(turns minus malformed ones) and, when the recipe logs them, the groups and the groups whose advantages were
all zero (`groups`, `groups_zero_advantage`); it warns at the first RL step without signal (and every 10th
after) and logs `rl_signal` at the end. `quaero review` judges the same totals (`quaero/telemetry/proofs.py`:
"RL trained" and "ECHO trained" are reported apart).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from quaero.telemetry import names
from quaero.telemetry.proofs import RL_EPISODE_COUNTERS, describe_rl_signal, updated_weights
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

WARN_EVERY = 10  # RL steps without signal between two warnings


class SignalWatch:
    """RL-signal totals over a run's RL steps (from this process's start: a resumed run counts from its
    resume)."""

    def __init__(self) -> None:
        self.totals: Counter = Counter()

    def step(self, step: int, m: Mapping[str, Any]) -> None:
        """Count one train_step's metrics; warn when an RL step carried no signal."""
        if m.get(names.PHASE) != names.PHASE_RL:
            return
        # a step the optimizer skipped (non-finite gradient) trained none of the tokens it read
        stepped = updated_weights(m)
        action, echo = (m.get(names.ACTION_TOKENS, 0), m.get(names.ECHO_TOKENS, 0)) if stepped else (0, 0)
        one = {names.RL_STEPS: 1, names.RL_STEPS_WITH_SIGNAL: int(action > 0),
               names.RL_STEPS_WITHOUT_UPDATE: int(not stepped),
               names.ACTION_TOKENS: action, names.ECHO_TOKENS: echo, names.RL_ACTIONS: m.get(names.TURNS, 0),
               names.RL_VALID_ACTIONS: m.get(names.TURNS, 0) - m.get(names.MALFORMED_ACTIONS, 0)}
        summed = (names.GROUPS, names.GROUPS_ZERO_ADVANTAGE, *RL_EPISODE_COUNTERS)
        one.update({k: m[k] for k in summed if k in m})
        self.totals.update(one)
        silent = self.totals[names.RL_STEPS] - self.totals[names.RL_STEPS_WITH_SIGNAL]
        if not one[names.RL_STEPS_WITH_SIGNAL] and silent % WARN_EVERY == 1:
            log.warning(names.RL_NO_SIGNAL_EVENT, step=step, rl_steps_without_signal=silent,
                        note=describe_rl_signal(one))

    def finish(self) -> dict[str, Any]:
        """Log `rl_signal` (a warning when no RL step carried signal) and return its totals."""
        t = dict(self.totals)
        if not t:
            return {}
        (log.info if t[names.ACTION_TOKENS] else log.warning)(names.RL_SIGNAL_EVENT, **t,
                                                              note=describe_rl_signal(t))
        return t
