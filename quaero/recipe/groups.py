"""A step's groups into rows: each group's task drawn (the mixture shares the step out over the envs, each
env's task sampler picks), played (G episodes on the env's own sessions, with its own group size and
oracle), turned into rows with group-relative advantages, and its outcome handed back to the task sampler.

The operations, outermost first:
- `roll_out`: this rank's share of a step's groups, with dynamic sampling's further groups;
- `play_groups`: some groups played on their envs, their rows and outcomes in the order they were drawn;
- `group_rows`: one played group's kept rows and its outcome.
With `[guidance] mode` (quaero/recipe/guidance.py), `play_groups` has the env's oracle play for the groups
whose kept episodes all failed, and `group_rows` trains the mixed group.
No collective here: a rollout sampled ahead (quaero/recipe/ahead.py) runs `roll_out` on a worker thread.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from quaero.bounded import STOP_REQUESTED
from quaero.config import AdvantageOptions, settings_of
from quaero.recipe import ranks
from quaero.recipe.guidance import members_at, mix, needs_guide, play_guides, prefix_turns_at
from quaero.rollout.advantages import group_advantages, sample_std
from quaero.rollout.task_samplers import POOLS
from quaero.rollout.tasks import reset_args, spec_label
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

if TYPE_CHECKING:
    from quaero.recipe.parts import EnvRun, RunParts
    from quaero.rollout.driver import Episode
    from quaero.rollout.rows import Transition
    from quaero.rows import EchoRow

log = get_logger(__name__)

Collected = list[tuple["EchoRow", list["Transition"]]]  # kept rows, each with its episode's transitions


@dataclass
class GroupOutcome:
    """A task's group, as the task sampler and the per-env counters see it."""

    env: str
    task: int
    rewards: list[float]  # its kept episodes' (the policy's: what the task sampler learns from)
    costs: list[float]  # generated tokens of each kept episode
    dropped: int  # its episodes lost (a dead server, a timeout): never trained
    spread: bool  # its trained members' rewards differ (guided ones included): the group carries an RL signal
    kept: bool  # it trained (some episode kept, finite advantages)
    guided: int = 0  # its members the env's oracle played ([guidance] mode), in place of kept ones
    guided_costs: float = 0.0  # their action tokens (not generated, yet a cost of the signal)


def draw(parts: RunParts, step: int, n: int) -> list[list]:
    """Step `step`'s `n` groups: [env name, task index] each, shared out over the envs by the mixture and
    drawn from each env's task sampler; logged with the weights each was drawn with (`tasks_drawn`). Every
    rank draws the same (the samplers learn from every rank's outcomes)."""
    picks, drawn = [], {}
    for e, k in zip(parts.envs, parts.mixture.allocate(n).values()):
        if not k:
            continue
        tasks = e.tasks.sample(k)
        picks += [[e.name, i] for i in tasks]
        drawn[e.name] = e.tasks.last
    log.info(names.TASKS_DRAWN_EVENT, for_step=step, envs=drawn)
    return picks


def _further(parts: RunParts, lacking: list[str], more: int) -> list[list]:
    """Dynamic sampling's `more` further groups, each from the task sampler of an env whose group had no
    spread (in turn)."""
    wanted: dict[str, int] = {}
    for j in range(more):
        name = lacking[j % len(lacking)]
        wanted[name] = wanted.get(name, 0) + 1
    return [[e.name, i] for e in parts.envs if e.name in wanted for i in e.tasks.sample(wanted[e.name])]


def learn(parts: RunParts, step: int, groups: list[GroupOutcome]) -> None:
    """Hand every RL group's outcome to its env's task sampler (in the step's group order) and log them
    (`task_outcomes`). The outcomes are the policy's own episodes: a guided group's guides are no part of
    them (its success estimate stays the policy's); whether the guides gave the all-fail group a signal is
    told apart, to the samplers that weigh it (the curriculum's s)."""
    by_name = {e.name: e for e in parts.envs}
    for g in groups:
        if g.rewards:
            by_name[g.env].tasks.update(g.task, g.rewards, g.costs)
            if g.guided:
                by_name[g.env].tasks.guided(g.task, g.spread)
    # per group: [env, task, its spec's group (e.g. toolbench's template), successes, episodes, spread,
    # tokens]
    log.info(names.TASK_OUTCOMES_EVENT, for_step=step, groups=[
        [g.env, g.task, _spec_group(by_name[g.env], g.task), sum(r > 0 for r in g.rewards), len(g.rewards),
         g.spread, int(sum(g.costs))] for g in groups])


def _spec_group(e: EnvRun, index: int) -> Any:
    spec = e.tasks.view.spec
    return spec_label((spec(index) or {}).get("group")) if spec is not None else None


def _signal_figures(groups: list[GroupOutcome], envs: list[EnvRun]) -> dict[str, Any]:
    signal = sum(g.spread for g in groups)
    episodes = sum(len(g.rewards) for g in groups)
    tokens = int(sum(sum(g.costs) for g in groups))
    cost = tokens + int(sum(g.guided_costs for g in groups))  # guided tokens count in the signal's cost
    out = {names.SIGNAL_GROUPS: signal, names.GENERATED_TOKENS: tokens,
           names.SIGNAL_GROUPS_GUIDED: sum(g.spread and g.guided > 0 for g in groups),
           names.GUIDED_TOKENS: cost - tokens,
           names.SIGNAL_GROUPS_PER_EPISODE: round(signal / episodes, 6) if episodes else None,
           names.SIGNAL_GROUPS_PER_1K_TOKENS: round(1000 * signal / cost, 6) if cost else None}
    pools = dict.fromkeys(POOLS, 0)
    played, size = 0, 0
    for e in envs:
        for pool, n in e.tasks.occupancy().items():
            pools[pool] += n
        if e.tasks.played() is not None and e.tasks.view.size:  # sequential keeps no memory
            played += e.tasks.played()
            size += e.tasks.view.size
    out.update({names.TASKS_UNSEEN: pools["unseen"], names.TASKS_LEARNABLE: pools["learnable"],
                names.TASKS_SATURATED: pools["saturated"], names.TASKS_HOPELESS: pools["hopeless"]})
    out[names.SPLIT_COVERAGE] = round(played / size, 9) if size else None
    return out


def signal_metrics(parts: RunParts, groups: list[GroupOutcome], step: int | None = None) -> dict[str, Any]:
    """The RL step's learning signal (`groups`: its outcomes), pooled and (a mixture's) per env: groups with
    spread per episode and per 1,000 generated tokens, and the task samplers' pool occupancy and split
    coverage; with `step`, the guidance schedule's members at it (where some env guides)."""
    out = _signal_figures(groups, parts.envs)
    if step is not None and any(e.cfg.guidance.mode != "none" for e in parts.envs):
        rl_step = step - parts.cfg.training.warmup_sft_steps
        out[names.GUIDANCE_MEMBERS] = max(members_at(e.cfg.guidance, rl_step) for e in parts.envs)
    if parts.cfg.is_mixture:
        by_env = {}
        for e in parts.envs:
            mine = [g for g in groups if g.env == e.name]
            kept = [g for g in mine if g.kept]
            by_env[e.name] = {**_signal_figures(mine, [e]), names.GROUPS: len(kept),
                              names.GROUPS_ZERO_ADVANTAGE: sum(not g.spread for g in kept),
                              names.EPISODES_LOST: sum(g.dropped for g in mine)}
        out[names.BY_ENV] = by_env
    return out


def roll_out(parts: RunParts, step: int, picks: list[list], *, sft: bool
             ) -> tuple[Collected, list[GroupOutcome]]:
    """This rank's share of the step's groups (`picks`): its kept rows with their advantages, and every
    group's outcome. No collective: a rollout sampled ahead runs it on a worker thread.

    Dynamic sampling (`[rollout] dynamic_sampling`, one process, never with rollouts sampled ahead): while
    fewer than tasks_per_step groups have reward spread, further groups are drawn from the task samplers of
    the envs whose groups had none, at most dynamic_sampling_max_groups x tasks_per_step groups in all; the
    all-equal groups still train ECHO."""
    cfg, n = parts.cfg, len(picks)
    seed = ranks.rank_seed(cfg.run.seed * 7919 + step)
    share = ranks.task_share(n)
    rows, groups = play_groups(parts, step, [picks[i] for i in share], share.start, seed, sft=sft)
    if sft or not cfg.rollout.dynamic_sampling:
        return rows, groups
    spread = sum(g.spread for g in groups)
    bound, sampled = int(cfg.rollout.dynamic_sampling_max_groups * n), n
    while spread < n and sampled < bound:
        if STOP_REQUESTED.is_set():  # a stop request: this step trains what it has, then the run stops
            log.warning(names.DYNAMIC_SAMPLING_STOPPED_EVENT, groups=sampled, groups_with_spread=spread,
                        note="a stop request came; training the groups sampled so far")
            break
        more = min(n - spread, bound - sampled)
        log.info(names.DYNAMIC_SAMPLING_ROUND_EVENT, groups=sampled, groups_with_spread=spread, wanted=n,
                 sampling=more, bound=bound)
        lacking = [g.env for g in groups if not g.spread] or [e.name for e in parts.envs]
        got, new = play_groups(parts, step, _further(parts, lacking, more), sampled, seed + 104_729 * sampled,
                               sft=False)
        rows += got
        groups += new
        spread += sum(g.spread for g in new)
        sampled += more
    parts.counts.add(names.GROUPS_RESAMPLED, sampled - n)
    parts.counts.add(names.DYNAMIC_SAMPLING_BOUND_HITS, int(spread < n))
    return rows, groups


def echo_scale(parts: RunParts, step: int, sft: bool) -> tuple[float, dict[str, float]]:
    """This step's λ and each env's factor on its rows' ECHO weights: a mixture's step trains λ = the largest
    of its envs' λ (`[[envs]] echo_weight`, else [echo]'s), each env's rows scaled to their own (0: no
    ECHO)."""
    t = parts.cfg.training
    rl_step = step - t.warmup_sft_steps
    weights = {e.name: e.cfg.echo.weight if sft else e.cfg.echo.weight_at(rl_step, t.steps)
               for e in parts.envs}
    top = max(weights.values())
    return top, {name: (w / top if top > 0 else 1.0) for name, w in weights.items()}


def _episode_label(parts: RunParts, env: EnvRun, index: int, slot: int) -> str:
    """The task part of a row's episode id ("step/task/member"): the index, as quaero always wrote it, for one
    env drawn in sequence; else env:index.slot (a sampler may draw a task twice in a step)."""
    if not parts.cfg.is_mixture and env.cfg.env.tasks.sampler == "sequential":
        return str(index)
    return f"{env.name}:{index}.{slot}"


def play_groups(parts: RunParts, step: int, picks: list[list], first_slot: int, seed: int, *, sft: bool
                ) -> tuple[Collected, list[GroupOutcome]]:
    """The groups of `picks` ([env, task index], the step's groups from slot `first_slot` on), each env's on
    its own sessions with its own group size and oracle: their kept rows with advantages (each row naming its
    episode), and each group's outcome (in `picks` order). An RL group whose kept episodes all failed gets
    the members its env's guidance schedule gives (the env's oracle on the same task, `_guides`)."""
    _, echo_factor = echo_scale(parts, step, sft) if parts.cfg.is_mixture else (None, {})
    results: dict[int, tuple[Collected, GroupOutcome]] = {}
    played, guides = [], {}
    for k, e in enumerate(parts.envs):
        mine = [(j, index) for j, (name, index) in enumerate(picks) if name == e.name]
        if not mine:
            continue
        split = e.cfg.env.train_split
        tasks = [reset_args(e.cfg.run.seed, split, index) for _, index in mine]
        groups = e.driver.run(e.pool.sessions, tasks, group_size=1 if sft else e.cfg.rollout.group_size,
                              policy=e.oracle if sft else None, seed=seed + 7_777 * k)
        played += [(e, j, index, group) for (j, index), group in zip(mine, groups)]
        if not sft:
            guides.update(_guides(e, step - parts.cfg.training.warmup_sft_steps, mine, tasks, groups,
                                  seed + 7_777 * k + 3_571))
    trained = {j: mix([ep for ep in group if not ep.dropped], guides[j], parts.counts, e.name)
               if j in guides else None for e, j, _, group in played}
    # scale_rewards = "batch": every group divides by the reward std of this call's trained episodes
    batch_std = sample_std([ep.reward for e, j, index, group in played
                            for ep in (trained[j][0] if trained[j] else [g for g in group if not g.dropped])])
    for e, j, index, group in played:
        results[j] = group_rows(parts, e, step, index, first_slot + j, group, sft=sft,
                                echo_factor=echo_factor.get(e.name, 1.0), batch_std=batch_std,
                                mixed=trained[j])
    rows, outcomes = [], []
    for j in range(len(picks)):
        rows += results[j][0]
        outcomes.append(results[j][1])
    return rows, outcomes


def _guides(e: EnvRun, rl_step: int, mine: list[tuple[int, int]], tasks: list[dict],
            groups: list[list[Episode]], seed: int) -> dict[int, list[Episode]]:
    """Env `e`'s guided episodes at RL step `rl_step`: for each of its groups (`mine`: [slot, task index],
    `tasks`: their reset arguments) whose kept episodes all failed, the schedule's k episodes of its oracle
    on the same reset (`prefix`: their first turns, the policy the rest), by the group's slot."""
    k = members_at(e.cfg.guidance, rl_step)
    need = [i for i, group in enumerate(groups) if k and needs_guide(group)]
    if not need:
        return {}
    played = play_guides(e, [tasks[i] for i in need], k, seed, prefix_turns_at(e.cfg.guidance, rl_step))
    return {mine[i][0]: episodes for i, episodes in zip(need, played)}


def group_rows(parts: RunParts, e: EnvRun, step: int, index: int, slot: int, group: list, *, sft: bool,
               echo_factor: float, batch_std: float = 0.0, mixed: tuple[list[Episode], int] | None = None
               ) -> tuple[Collected, GroupOutcome]:
    """One played group (task `index` of env `e`, the step's group `slot`): its kept episodes' rows with their
    group-relative advantages (the env's `[rollout]` advantage settings; `batch_std` for scale_rewards =
    "batch"; ECHO weights scaled by `echo_factor`), and its outcome. A group whose rewards give no finite
    advantage is left out, counted. `spread` is the trained rewards' (an all-fail group that NSR pushes down
    has advantages but no spread). `mixed`: a guided group's trained members (its kept episodes, the last
    ones replaced by guided episodes) and how many of them (the last) are guided: the advantages are the
    mixed group's, the guided members' rows carry the guide's tokens marked (the driver's, token by token:
    a prefix's continuation is the policy's), and the outcome keeps the policy's own episodes."""
    kept = [ep for ep in group if not ep.dropped]
    members, guided = mixed if mixed is not None else (kept, 0)
    outcome = GroupOutcome(e.name, index, [ep.reward for ep in kept],
                           [float(sum(len(t.action_ids) for t in ep.transitions)) for ep in kept],
                           dropped=len(group) - len(kept), spread=False, kept=False, guided=guided,
                           guided_costs=float(sum(len(t.action_ids) for ep in members[len(members) - guided:]
                                                  for t in ep.transitions)))
    if not kept:
        return [], outcome
    rewards = [ep.reward for ep in members]
    advs = [1.0] * len(members) if sft else group_advantages(
        rewards, [ep.success for ep in members], settings_of(AdvantageOptions, e.cfg), batch_std)
    if not all(math.isfinite(a) for a in advs):
        parts.counts.add(names.GROUPS_NONFINITE_ADVANTAGE)  # rewards a float cannot take the difference of
        return [], outcome
    outcome.kept = True
    if not sft:
        parts.counts.add(names.GROUPS)
        parts.counts.add(names.GROUPS_ZERO_ADVANTAGE, int(not any(advs)))
        outcome.spread = min(rewards) != max(rewards)
    label = _episode_label(parts, e, index, slot)
    rows = []
    for g, (ep, adv) in enumerate(zip(members, advs)):
        for r in ep.rows:
            r = r.with_advantage(adv, f"{step}/{label}/{g}", ep.reward)
            if echo_factor != 1.0:
                r = replace(r, echo_weights=[w * echo_factor for w in r.echo_weights])
            rows.append((r, ep.transitions))
    return rows, outcome
