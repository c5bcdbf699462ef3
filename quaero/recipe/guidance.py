"""Guided episodes (`[guidance] mode = "episode"`, per `[[envs]]` too): when an RL group's kept episodes
all fail, up to k of its members are replaced by episodes the env's oracle (the warm start's demonstrator,
`oracle_policy(info)`) plays whole on the same task, from the same reset. The oracle's actions are encoded
exactly as the warm start encodes them (quaero/rollout/driver.py: the assistant message through the
renderer, the ids a model would have sampled, log-prob 0), and every action token of their rows is marked
guided (`EchoRow.guided`, per token): the trainer weights those with LUFFY's policy shaping instead of a
ratio (trainers/policy_losses.py). The group's advantages are computed over the mixed group, so the guided
successes get a positive advantage and the failures a negative one.

`prefix` (BREAD, QuestA): the guided members' first `[guidance] prefix_turns` turns are the oracle's (marked
guided, token by token), and the policy samples the rest of the episode from there: those tokens are its own,
on-policy, trained with the ratio like any sampled token. An episode that ends within the prefix is the
guide's whole.

k anneals linearly from `[guidance] members` at RL step 0 to 0 at RL step `[guidance] until_step`
(`members_at`), and a prefix's turns with it (`prefix_turns_at`): functions of the step alone, so a resumed
run guides exactly as the unstopped one, with nothing in its checkpoint. The task samplers learn from the
unguided outcomes only (quaero/recipe/groups.py `learn`).

A guide is user code: one whose call raises or runs past `[guidance] timeout_s` drops its member (counted in
`guides_failed` / `guides_timed_out` and `guided_members_dropped`); its group trains as the policy played it.

`[guidance] traces` (LUFFY's off-policy expert traces): the guide is recorded episodes instead of the oracle
(quaero/rollout/traces.py `RecordedActions`): on the same reset, each turn's action is the recorded action
ids that followed exactly the live prompt's ids in some recording, replayed verbatim (never re-tokenized,
log-prob 0) and marked guided as the oracle's are. A member whose prompt no recording reached, at its first
turn (a task not recorded, another template) or later (the env answered otherwise than in the recording), is
dropped and counted (`guides_unmatched`), never guessed; its group keeps the policy's episode in its place.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from quaero.telemetry import names
from quaero.telemetry.counts import RolloutCounts
from quaero.telemetry.runlog import get_logger

if TYPE_CHECKING:
    from quaero.recipe.parts import EnvRun
    from quaero.rollout.driver import Episode

log = get_logger(__name__)


def members_at(guidance, rl_step: int) -> int:
    """Guided members per all-fail group at RL step `rl_step` (1 is the first RL step) of a `[guidance]`
    section: 0 without guidance; `members` k every step without `until_step`; else ceil(k (until - s) /
    until), which is k at step 0 and 0 from step `until` on."""
    return _annealed(guidance.members, guidance, rl_step)


def prefix_turns_at(guidance, rl_step: int) -> int | None:
    """The guide's turns of a guided member at RL step `rl_step`: None (every turn) for `episode` guidance;
    for `prefix`, `prefix_turns` n annealed as the members are, ceil(n (until - s) / until)."""
    if guidance.mode != "prefix":
        return None
    return _annealed(guidance.prefix_turns, guidance, rl_step)


def _annealed(n: int, guidance, rl_step: int) -> int:
    if guidance.mode == "none":
        return 0
    until = guidance.until_step
    if until is None:
        return n
    return -(-n * max(until - rl_step, 0) // until)


def needs_guide(group: list[Episode]) -> bool:
    """A group the guide plays for: some episode kept, none a success."""
    kept = [ep for ep in group if not ep.dropped]
    return bool(kept) and not any(ep.success for ep in kept)


def play_guides(e: EnvRun, tasks: list[dict], k: int, seed: int, turns: int | None = None
                ) -> list[list[Episode]]:
    """k guided episodes on each of `tasks` (the reset arguments of its all-fail groups), on the env's own
    sessions: the env's oracle plays their first `turns` turns (None: every turn), the policy the rest. Its
    driver counts into counts of its own: the guides' episodes never count as the policy's (episodes,
    successes, rewards). A guide's call that raises or runs past `[guidance] timeout_s` drops its episode (the
    driver's); anything else that raises drops this call's guided members, counted and said
    (`guide_failed`): the groups train as the policy played them."""
    from quaero.rollout.driver import EpisodeDriver, ExactnessError, GuidePlay

    guide = EpisodeDriver(e.driver.render, e.driver.sampler, e.driver.settings, RolloutCounts())
    play = GuidePlay(turns, e.cfg.guidance.timeout_s, e.recorded)
    policy = None if e.recorded is not None else e.oracle  # recordings replay ids: no policy call
    try:
        return guide.run(e.pool.sessions, tasks, group_size=k, policy=policy, seed=seed, guide=play)
    except ExactnessError:  # [rollout] strict: an exactness mismatch is the run's error, a guide's too
        raise
    except Exception as err:  # noqa: BLE001 - the oracle is user code; its failure costs its members only
        log.warning(names.GUIDE_FAILED_EVENT, env=e.name, groups=len(tasks), members=k * len(tasks),
                    error=f"{type(err).__name__}: {err}"[:300],
                    note="the env's oracle raised while guiding; these groups train as the policy played "
                         "them (guided_members_dropped counts the members)")
        return [[_failed_guide(err) for _ in range(k)] for _ in tasks]


def _failed_guide(err: Exception) -> Episode:
    from quaero.rollout.driver import Episode

    return Episode([], 0.0, False, 0, {}, [], dropped=True, drop_reason=f"guide raised: {err}"[:200],
                   drop_kind="guide_failed")


def mix(kept: list[Episode], guides: list[Episode], counts: RolloutCounts, env: str = ""
        ) -> tuple[list[Episode], int]:
    """The trained members of an all-fail group: its kept episodes with the last of them replaced by the
    guides' kept ones (a guide's dropped episode is counted and leaves its member to the policy; one whose
    guide failed or timed out is said, `guide_dropped`); and how many members are guided (the last ones)."""
    played = [ep for ep in guides if not ep.dropped]
    n = min(len(played), len(kept))
    counts.add(names.GUIDED_MEMBERS_DROPPED, len(guides) - len(played))
    failed = [ep for ep in guides if ep.dropped and ep.drop_kind in ("guide_failed", "guide_timeout")]
    counts.add(names.GUIDES_FAILED, sum(ep.drop_kind == "guide_failed" for ep in failed))
    counts.add(names.GUIDES_TIMED_OUT, sum(ep.drop_kind == "guide_timeout" for ep in failed))
    unmatched = [ep for ep in guides if ep.dropped and ep.drop_kind == "guide_unmatched"]
    counts.add(names.GUIDES_UNMATCHED, len(unmatched))
    if unmatched:
        log.info(names.GUIDE_UNMATCHED_EVENT, env=env, members=len(unmatched), first=unmatched[0].drop_reason,
                 note="a recorded guide ([guidance] traces) had no action for a member's prompt: "
                      "that member is dropped (guides_unmatched) and the policy's episode kept")
    if failed:
        log.warning(names.GUIDE_DROPPED_EVENT, env=env, members=len(failed), error=failed[0].drop_reason,
                    note="a guide (the env's oracle) raised or ran past [guidance] timeout_s: its "
                         "member is dropped (guides_failed / guides_timed_out) and the policy's kept")
    if n:
        counts.add(names.GROUPS_GUIDED)
        counts.add(names.GUIDED_MEMBERS, n)
        counts.add(names.GUIDED_MEMBERS_SUCCEEDED, sum(ep.success for ep in played[:n]))
    return kept[:len(kept) - n] + played[:n], n
