"""RolloutCounts: the one owner of what rollouts count.

The env sessions (quaero/openenv_client) and the episode driver (quaero/rollout/driver.py) add to one object;
the recipe (quaero/recipe/train.py) takes one snapshot per train step and one per evaluation, so every count
lands in exactly one event under exactly one name. The counters, with their meanings, are declared in
quaero/telemetry/names.py (`ROLLOUT_COUNTERS`, in the order a snapshot lists them).

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

from quaero.telemetry import names

# The reward sum is kept scaled by 2**-64 (exact: a power of two), so huge finite rewards (1e308 twice) sum
# without overflowing to inf and reward_mean stays their mean.
REWARD_SCALE = 2.0 ** -64
Combine = Callable[[Counter, float], tuple[Counter, float]]


class RolloutCounts:
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
            self._c[names.PREFIX_MISMATCHES] += reason == "prefix_mismatch"
            self._c[names.BRIDGE_FALLBACKS] += 1
            self._c[names.BRIDGE_FALLBACK_REASON + reason] += 1

    def episode_dropped(self, kind: str) -> None:
        with self._lock:
            self._c[names.EPISODES] += 1
            self._c[names.EPISODES_DROPPED] += 1
            self._c[names.DROP_REASON + kind] += 1

    def episode_finished(self, *, reward: float, success: bool, truncated: bool, turns: int) -> None:
        with self._lock:
            self._c[names.EPISODES] += 1
            self._c[names.EPISODES_SUCCEEDED] += success
            self._c[names.EPISODES_TRUNCATED] += truncated
            self._c["kept_turns"] += turns
            self._reward_sum += reward * REWARD_SCALE

    def rows_built(self, *, packed: int, transition: int, row_tokens: int, per_transition_tokens: int,
                   action_tokens: int, echo_tokens: int) -> None:
        """One kept episode's rows; a packed episode has len(rows) - 1 packing breaks."""
        with self._lock:
            self._c[names.ROWS_PACKED] += packed
            self._c[names.ROWS_TRANSITION] += transition
            self._c[names.PACKING_BREAKS] += max(packed + transition - 1, 0)
            self._c[names.ROLLOUT_ROW_TOKENS] += row_tokens
            self._c[names.ROLLOUT_ROW_TOKENS_PER_TRANSITION_LAYOUT] += per_transition_tokens
            self._c[names.ROLLOUT_ACTION_TOKENS] += action_tokens
            self._c[names.ROLLOUT_ECHO_TOKENS] += echo_tokens

    def take(self) -> RolloutCounts:
        """A RolloutCounts holding every count so far; this one starts over. A rollout sampled ahead on
        another thread (quaero/recipe/ahead.py) takes its own counts when it ends, so the evaluation that runs
        before its step trains never counts them."""
        taken = RolloutCounts()
        with self._lock:
            taken._c, taken._reward_sum = self._c, self._reward_sum
            self._c, self._reward_sum = Counter(), 0.0
        return taken

    def snapshot_and_reset(self, combine: Combine | None = None) -> dict[str, Any]:
        """Every counter (0 when nothing happened), the reason counters seen, and the kept episodes'
        means (None without a kept episode: a mean of nothing is not 0).

        combine: turns this process's (counts, reward sum) into the run's, before any mean is taken
        (under torchrun, the sums over ranks: quaero/recipe/ranks.py)."""
        with self._lock:
            c, reward_sum = self._c, self._reward_sum
            self._c, self._reward_sum = Counter(), 0.0
        if combine is not None:
            c, reward_sum = combine(c, reward_sum)
        kept_turns = c.pop("kept_turns", 0)
        out: dict[str, Any] = {name: c.pop(name, 0) for name in names.ROLLOUT_COUNTERS}
        out.update(sorted(c.items()))  # the reason counters
        kept = out[names.EPISODES] - out[names.EPISODES_DROPPED]
        out[names.REWARD_MEAN] = reward_sum / kept / REWARD_SCALE if kept else None
        out[names.SUCCESS_RATE] = out[names.EPISODES_SUCCEEDED] / kept if kept else None
        out[names.TURNS_MEAN] = kept_turns / kept if kept else None
        out[names.ROLLOUT_ROW_TOKENS_PER_EPISODE] = out[names.ROLLOUT_ROW_TOKENS] / kept if kept else None
        groups = out[names.GROUPS]
        out[names.GROUPS_ZERO_ADVANTAGE_SHARE] = out[names.GROUPS_ZERO_ADVANTAGE] / groups if groups else None
        return out


def drop_reasons(snapshot: dict[str, Any]) -> dict[str, int]:
    """{kind: count} of a snapshot's (or summed snapshots') dropped episodes."""
    return {k.removeprefix(names.DROP_REASON): v for k, v in snapshot.items()
            if k.startswith(names.DROP_REASON) and v}
