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

A run whose RL steps trained action tokens and then wrote no valid action at all has collapsed: every group
fails alike from then on, no advantage and no env response to train on, so nothing brings the format back
(the 20M main job at seed 1 from RL step 19 on: benchmarks/README.md). That step is warned at once, whatever
the count of silent steps, with the fixes that apply after a warm start, and the run's end says so while it
lasts.
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
COLLAPSE_FIX = ('[guidance] mode = "episode" (the env\'s oracle plays members of a group whose episodes all '
                "fail, so the group has a success to learn from), or a lower [backend] lr")


class SignalWatch:
    """RL-signal totals over a run's RL steps (from this process's start: a resumed run counts from its
    resume)."""

    def __init__(self) -> None:
        self.totals: Counter = Counter()
        self.last_signal_step: int | None = None  # the last RL step that trained action tokens
        self.collapsed_at: int | None = None  # the first step of a collapse that lasts

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
        if one[names.RL_STEPS_WITH_SIGNAL]:
            self.last_signal_step = step
        nothing_valid = (one[names.RL_ACTIONS] > 0 and one[names.RL_VALID_ACTIONS] == 0
                         and not one[names.RL_STEPS_WITH_SIGNAL])
        collapsed = nothing_valid and self.last_signal_step is not None  # after RL trained
        collapse_starts = collapsed and self.collapsed_at is None
        if not collapsed:
            self.collapsed_at = None
        elif collapse_starts:
            self.collapsed_at = step
        if collapse_starts or (not one[names.RL_STEPS_WITH_SIGNAL] and silent % WARN_EVERY == 1):
            said = ({"note": describe_rl_signal(one)} if self.collapsed_at is None else
                    {"format_collapsed_at": self.collapsed_at, "note": self._collapse_note(one)})
            log.warning(names.RL_NO_SIGNAL_EVENT, step=step, rl_steps_without_signal=silent, **said)

    def _collapse_note(self, one: Mapping[str, Any]) -> str:
        return (f"0 of {one[names.RL_ACTIONS]} actions were valid, at every step since step "
                f"{self.collapsed_at}, after RL steps that trained action tokens (the last: step "
                f"{self.last_signal_step}): the policy's format collapsed. Every group now fails alike, with "
                "no advantage and no env response to train on, so nothing brings it back. "
                f"Fix: {COLLAPSE_FIX}")

    def finish(self) -> dict[str, Any]:
        """Log `rl_signal` (a warning when no RL step carried signal) and return its totals."""
        t = dict(self.totals)
        if not t:
            return {}
        said = {"note": describe_rl_signal(t)}
        if self.collapsed_at is not None:  # it trained once: the end says it stopped, not only the totals
            said = {"format_collapsed_at": self.collapsed_at,
                    "note": f"{said['note']}; but no action was valid from step {self.collapsed_at} to the "
                            f"end: the policy's format collapsed. Fix: {COLLAPSE_FIX}"}
        warn = self.collapsed_at is not None or not t[names.ACTION_TOKENS]
        (log.warning if warn else log.info)(names.RL_SIGNAL_EVENT, **t, **said)
        return t
