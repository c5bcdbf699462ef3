"""RolloutStats: the one owner of what rollouts count.

The env sessions (quaero/openenv_client) and the episode driver (quaero/rollout.py) add to one object;
the recipe (quaero/train.py) takes one snapshot per train step and one per evaluation, so every count
lands in exactly one event under exactly one name.

Names never collide with the trainer's: `action_tokens`/`echo_tokens` are the trainer's loss
denominators (what a step trained); the rollout's counts of the tokens its rows hold are
`rollout_action_tokens`/`rollout_echo_tokens`, whether or not a step trains them.

Success: an episode succeeds only when the env ended it (`done`) and it was not truncated; then the env's
`success` flag in the terminal step's info decides when the env gives one, else the terminal step's
reward > 0. An episode cut by quaero's turn limit or by the context (or marked truncated by the env) is never
a success.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

COUNTERS = (
    # episodes (the driver); drops also count `drop_reason_<kind>`; unparsable_actions: replies the
    # renderer's parser raised on (also counted in malformed_actions: the env answered them with a corrective)
    "episodes", "episodes_dropped", "episodes_truncated", "episodes_succeeded",
    "turns", "malformed_actions", "unparsable_actions", "truncated_completions",
    # lengths (the driver): env messages cut to max_observation_tokens, bridged responses cut at the
    # context's end, episodes ended (truncated) because the next prompt left no room to sample
    "observations_truncated", "env_responses_clipped", "context_exhausted",
    # exactness (the driver); bridge fallbacks also count `bridge_fallback_reason_<reason>`
    "env_responses", "env_responses_captured", "terminal_responses", "bridge_fallbacks", "prefix_mismatches",
    # rows (the driver)
    "rows_packed", "rows_transition", "packing_breaks", "rollout_row_tokens",
    "rollout_row_tokens_per_transition_layout", "rollout_action_tokens", "rollout_echo_tokens",
    # the env protocol (the sessions)
    "env_steps", "env_resets", "env_retries", "env_timeouts", "env_restarts", "env_replayed_steps",
    "env_tool_errors", "env_rejected_calls", "env_invalid_replies",
    # groups (the recipe, RL steps): kept groups, those whose rewards are all equal (every advantage 0: no
    # RL signal, ECHO only), those left out because their rewards' spread overflows a float; dynamic sampling's
    # further groups and the steps its bound cut short of tasks_per_step groups with spread
    "groups", "groups_zero_advantage", "groups_nonfinite_advantage", "groups_resampled",
    "dynamic_sampling_bound_hits",
)
DROP_REASON = "drop_reason_"
# The reward sum is kept scaled by 2**-64 (exact: a power of two), so huge finite rewards (1e308 twice) sum
# without overflowing to inf and reward_mean stays their mean.
REWARD_SCALE = 2.0 ** -64
Combine = Callable[[Counter, float], tuple[Counter, float]]
BRIDGE_FALLBACK_REASON = "bridge_fallback_reason_"


class RolloutStats:
    """Thread-safe counters (env steps run in threads) plus the kept episodes' reward and turn sums."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter = Counter()
        self._reward_sum = 0.0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def bridge_fallback(self, reason: str) -> None:
        """A turn whose env response could not be appended exactly: it trains as action-only."""
        with self._lock:
            self._c["prefix_mismatches"] += reason == "prefix_mismatch"
            self._c["bridge_fallbacks"] += 1
            self._c[BRIDGE_FALLBACK_REASON + reason] += 1

    def episode_dropped(self, kind: str) -> None:
        with self._lock:
            self._c["episodes"] += 1
            self._c["episodes_dropped"] += 1
            self._c[DROP_REASON + kind] += 1

    def episode_finished(self, *, reward: float, success: bool, truncated: bool, turns: int) -> None:
        with self._lock:
            self._c["episodes"] += 1
            self._c["episodes_succeeded"] += success
            self._c["episodes_truncated"] += truncated
            self._c["kept_turns"] += turns
            self._reward_sum += reward * REWARD_SCALE

    def rows_built(self, *, packed: int, transition: int, row_tokens: int, per_transition_tokens: int,
                   action_tokens: int, echo_tokens: int) -> None:
        """One kept episode's rows; a packed episode has len(rows) - 1 packing breaks."""
        with self._lock:
            self._c["rows_packed"] += packed
            self._c["rows_transition"] += transition
            self._c["packing_breaks"] += max(packed + transition - 1, 0)
            self._c["rollout_row_tokens"] += row_tokens
            self._c["rollout_row_tokens_per_transition_layout"] += per_transition_tokens
            self._c["rollout_action_tokens"] += action_tokens
            self._c["rollout_echo_tokens"] += echo_tokens

    def take(self) -> RolloutStats:
        """A RolloutStats holding every count so far; this one starts over. A rollout sampled ahead on another
        thread (quaero/ahead.py) takes its own counts when it ends, so the evaluation that runs before its step
        trains never counts them."""
        taken = RolloutStats()
        with self._lock:
            taken._c, taken._reward_sum = self._c, self._reward_sum
            self._c, self._reward_sum = Counter(), 0.0
        return taken

    def snapshot_and_reset(self, combine: Combine | None = None) -> dict[str, Any]:
        """Every counter (0 when nothing happened), the reason counters seen, and the kept episodes'
        means (None without a kept episode: a mean of nothing is not 0).

        combine: turns this process's (counts, reward sum) into the run's, before any mean is taken
        (under torchrun, the sums over ranks: quaero/ranks.py)."""
        with self._lock:
            c, reward_sum = self._c, self._reward_sum
            self._c, self._reward_sum = Counter(), 0.0
        if combine is not None:
            c, reward_sum = combine(c, reward_sum)
        kept_turns = c.pop("kept_turns", 0)
        out: dict[str, Any] = {name: c.pop(name, 0) for name in COUNTERS}
        out.update(sorted(c.items()))  # the reason counters
        kept = out["episodes"] - out["episodes_dropped"]
        out["reward_mean"] = reward_sum / kept / REWARD_SCALE if kept else None
        out["success_rate"] = out["episodes_succeeded"] / kept if kept else None
        out["turns_mean"] = kept_turns / kept if kept else None
        out["rollout_row_tokens_per_episode"] = out["rollout_row_tokens"] / kept if kept else None
        out["groups_zero_advantage_share"] = out["groups_zero_advantage"] / out["groups"] if out["groups"] else None
        return out


def drop_reasons(snapshot: dict[str, Any]) -> dict[str, int]:
    """{kind: count} of a snapshot's (or summed snapshots') dropped episodes."""
    return {k.removeprefix(DROP_REASON): v for k, v in snapshot.items() if k.startswith(DROP_REASON) and v}
