"""Guided episodes (`[training] guidance = "episode"`, per `[[envs]]` too): when an RL group's kept episodes
all fail, up to k of its members are replaced by episodes the env's oracle (the warm start's demonstrator,
`oracle_policy(info)`) plays whole on the same task, from the same reset. The oracle's actions are encoded
exactly as the warm start encodes them (quaero/rollout/driver.py: the assistant message through the
renderer, the ids a model would have sampled, log-prob 0), and every action token of their rows is marked
guided (`EchoRow.guided`): the trainer weights those with LUFFY's policy shaping instead of a ratio
(trainers/policy_losses.py). The group's advantages are computed over the mixed group, so the guided
successes get a positive advantage and the failures a negative one.

k anneals linearly from `guided_members` at RL step 0 to 0 at RL step `guidance_until_step` (`members_at`):
a function of the step alone, so a resumed run guides exactly as the unstopped one, with nothing in its
checkpoint. The task samplers learn from the unguided outcomes only (quaero/recipe/groups.py `learn`).

Not built yet: `prefix` guidance (the guide plays the first turns, the policy the rest) and recorded traces
as guides.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from quaero.config import QuaeroConfig
from quaero.telemetry import names
from quaero.telemetry.counts import RolloutCounts
from quaero.telemetry.runlog import get_logger

if TYPE_CHECKING:
    from quaero.recipe.parts import EnvRun
    from quaero.rollout.driver import Episode

log = get_logger(__name__)


def members_at(training, rl_step: int) -> int:
    """Guided members per all-fail group at RL step `rl_step` (1 is the first RL step) of a `[training]`
    section: 0 without guidance; `guided_members` k every step without `guidance_until_step`; else
    ceil(k (until - s) / until), which is k at step 0 and 0 from step `until` on."""
    if training.guidance == "none":
        return 0
    k, until = training.guided_members, training.guidance_until_step
    if until is None:
        return k
    return -(-k * max(until - rl_step, 0) // until)


def schedule_warning(cfg: QuaeroConfig) -> str | None:
    """A line when some env's guidance never reaches none within the run (its final policy would be measured
    while still guided); None when every schedule ends."""
    t = cfg.training
    guided = [name for name, view in cfg.views().items() if view.training.guidance != "none"]
    if not guided or not t.steps:
        return None
    who = "" if not cfg.is_mixture else f" (envs {', '.join(guided)})"
    if t.guidance_until_step is None:
        return (f"warning: [training] guidance{who} never anneals to none (guidance_until_step unset): every "
                f"RL step of {t.steps} guides; set guidance_until_step <= steps")
    if t.guidance_until_step > t.steps:
        return (f"warning: [training] guidance_until_step={t.guidance_until_step} > steps={t.steps}: "
                f"guidance{who} never reaches none in this run; set guidance_until_step <= steps")
    return None


def guidance_lines(cfg: QuaeroConfig) -> list[str]:
    """`quaero check`'s guidance line (none when no env guides) and its schedule's warning."""
    t = cfg.training
    modes = {name: view.training.guidance for name, view in cfg.views().items()}
    if set(modes.values()) == {"none"}:
        return []
    which = "" if not cfg.is_mixture else " on " + ", ".join(n for n, m in modes.items() if m != "none")
    until = (f"annealed linearly to 0 at RL step {t.guidance_until_step}" if t.guidance_until_step
             else "never annealed")
    line = (f"guidance    episode{which}: an all-fail group's last {t.guided_members} member(s) played by "
            f"the env's oracle, {until}; guided tokens shaped by f(p) = p / (p + {t.guidance_gamma:g})")
    warning = schedule_warning(cfg)
    return [line] + ([warning] if warning else [])


def needs_guide(group: list[Episode]) -> bool:
    """A group the guide plays for: some episode kept, none a success."""
    kept = [ep for ep in group if not ep.dropped]
    return bool(kept) and not any(ep.success for ep in kept)


def play_guides(e: EnvRun, tasks: list[dict], k: int, seed: int) -> list[list[Episode]]:
    """k episodes of the env's oracle on each of `tasks` (the reset arguments of its all-fail groups), on the
    env's own sessions. Its driver counts into counts of its own: the guides' episodes never count as the
    policy's (episodes, successes, rewards). An oracle that raises (a guide is user code) drops this call's
    guided members, counted and said (`guide_failed`): the groups train as the policy played them."""
    from quaero.rollout.driver import EpisodeDriver, ExactnessError

    guide = EpisodeDriver(e.driver.render, e.driver.sampler, e.driver.settings, RolloutCounts())
    try:
        return guide.run(e.pool.sessions, tasks, group_size=k, policy=e.oracle, seed=seed)
    except ExactnessError:  # [training] strict: an exactness mismatch is the run's error, a guide's too
        raise
    except Exception as err:  # noqa: BLE001 - the oracle is user code; its failure costs its members only
        log.warning(names.GUIDE_FAILED_EVENT, env=e.name, groups=len(tasks), members=k * len(tasks),
                    error=f"{type(err).__name__}: {err}"[:300],
                    note="the env's oracle raised while guiding; these groups train as the policy played "
                         "them (guided_members_dropped counts the members)")
        return [[_failed_guide(err) for _ in range(k)] for _ in tasks]


def _failed_guide(err: Exception) -> Episode:
    from quaero.rollout.driver import Episode

    return Episode([], 0.0, False, 0, {}, [], dropped=True, drop_reason=f"guide raised: {err}"[:200])


def mix(kept: list[Episode], guides: list[Episode], counts: RolloutCounts) -> tuple[list[Episode], int]:
    """The trained members of an all-fail group: its kept episodes with the last of them replaced by the
    guides' kept ones (a guide's dropped episode is counted and leaves its member to the policy); and how
    many members are guided (the last ones)."""
    played = [ep for ep in guides if not ep.dropped]
    n = min(len(played), len(kept))
    counts.add(names.GUIDED_MEMBERS_DROPPED, len(guides) - len(played))
    if n:
        counts.add(names.GROUPS_GUIDED)
        counts.add(names.GUIDED_MEMBERS, n)
        counts.add(names.GUIDED_MEMBERS_SUCCEEDED, sum(ep.success for ep in played[:n]))
    return kept[:len(kept) - n] + played[:n], n
