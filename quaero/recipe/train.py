"""The main job, as a recipe: (weight sync) -> rollout -> rows -> update -> log -> checkpoint.

Words, as this module uses them. A *step* is one of the run's numbered steps, numbered globally: steps
1..W are warm-start SFT on the environment's oracle demonstrations (when `[training] warmup_sft_steps =
W`), steps W+1..W+N are RL + ECHO; the *last* step is W+N, or the RL step that spent `rl_token_budget`.
A step's *update* is the trainer's `train_step` on its rows: one optimizer step per mini-batch, and an RL
step's rows make `steps_per_generation` x `num_iterations` of them (trainers/mini_steps.py). "RL step k"
(the ECHO and guidance schedules) counts from the first RL step, k = step - W. The functions, outside
in: `_loop` runs the steps, `_advance` one of them (then logs it, checkpoints and evaluates when due),
`run_step` its work (weight sync, rows, update), `collect_rows` its rows and `_update` its update.
Evaluation (greedy, eval split) runs before the first step (the untrained baseline) and every
`eval_every` steps.

Determinism: the sampler seed of step k and the tasks of step k are functions of (run seed, k), so
a run interrupted after step k and resumed from its checkpoint reproduces step k+1 exactly.

Asynchronous rollouts (`[rollout] max_off_policy_steps = k >= 1`, quaero/recipe/ahead.py): while an RL step
trains, a worker thread samples the rollouts of the next k steps with the weights the step started from,
so a step trains rows up to k policy versions old (`policy_staleness`). The first RL step (after a warm
start, or after a resume: the rollouts in flight are not checkpointed) samples on-policy, now. k = 0 is the
loop above, unchanged: no thread, the sampler sharing the trainer's module.

Under torchrun (`quaero train --nproc N`) every rank runs this recipe on its share of each step's
tasks; rank 0 alone writes the run folder (quaero/recipe/ranks.py says who does what).

The recipe's parts, each a module of quaero/recipe/: `parts` (what the run is wired from, `build`),
`progress` (what moves every step), `groups` (a step's groups into rows), `ahead` (rollouts sampled
ahead), `weight_sync`, `evaluation`, `run_state` (checkpoints and resume) and `stop` (when a run stops
early: a stop request, `max_empty_steps`, `on_env_loss`, `rl_token_budget`).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from quaero.bounded import StoppedInCall
from quaero.config import QuaeroConfig
from quaero.recipe import checkpoint, ranks
from quaero.recipe.ahead import RolloutsAhead, take_rollout
from quaero.recipe.evaluation import evaluate_at
from quaero.recipe.groups import Collected, draw, echo_scale, learn, roll_out, signal_metrics
from quaero.recipe.parts import RunParts, build, open_pools
from quaero.recipe.progress import RunProgress
from quaero.recipe.run_state import (
    Found,
    agreed_resume_point,
    keep_last_step,
    note_changed_config,
    resume_from,
    save_checkpoint,
    task_state,
)
from quaero.recipe.saved_rows import save_step_rows
from quaero.recipe.stop import (
    EmptyRunError,
    StopRequest,
    budget_spent,
    check_env_loss,
    nothing_trained,
)
from quaero.recipe.weight_sync import sync_sampler
from quaero.rollout.traces import trace_batch
from quaero.telemetry import names
from quaero.telemetry.counts import drop_reasons
from quaero.telemetry.runlog import RunLog, configure, error_line, get_logger, set_step
from trainers.memory import MALLINFO_READABLE, malloc_in_use_mb, peak_window, process_peak_mb, process_rss_mb

if TYPE_CHECKING:
    from pathlib import Path

log = get_logger(__name__)


def collect_rows(parts: RunParts, progress: RunProgress, step: int, *, sft: bool) -> Collected:
    """Step `step`'s rows, sampled now: every rank's kept rows with their advantages, each with its episode's
    transitions (the sampler's own record, for saved rows; parts.counts counts). A warm start on `[data]
    traces` plays nothing: its recorded rows. The task samplers learn from the RL groups' outcomes before the
    next draw."""
    if sft and parts.traces is not None:  # recorded episodes: no rollout, no transitions of a sampler to save
        per_step = parts.cfg.rollout.tasks_per_step
        return ranks.gather_rows([(r, []) for r in trace_batch(parts.traces, step, per_step,
                                                               ranks.task_share(per_step))])
    picks = progress.pending.pop(step, None) or draw(parts, step, parts.cfg.rollout.tasks_per_step)
    rows, groups = roll_out(parts, step, picks, sft=sft)
    if not sft:
        progress.step_groups = ranks.gather_rows(groups)
        learn(parts, step, progress.step_groups)
    return ranks.gather_rows(rows)  # every rank's, in rank order


def run_step(parts: RunParts, progress: RunProgress, step: int, *, sft: bool,
             ahead: RolloutsAhead | None = None) -> dict[str, Any]:
    """Step `step`'s work: (weight sync, when it samples) -> rollout -> rows -> update; returns its
    metrics. With `ahead` (max_off_policy_steps >= 1) an RL step trains the rollout sampled ahead for it and
    launches the next ones first."""
    t0, peaks = time.perf_counter(), {}
    if ahead is None or sft:
        synced = {} if sft else sync_sampler(parts, progress)  # a warm-start step plays the oracle
        # alone: no other phase runs
        with peak_window(parts.trainer.device, peaks, names.ROLLOUT_PEAK_MEM_MB):
            collected = collect_rows(parts, progress, step, sft=sft)
        t_rollout = ranks.largest(time.perf_counter() - t0)
        counts, lag = parts.counts, ({} if sft else {names.POLICY_STALENESS: 0})
        version = None if sft else step - 1
    else:
        rollout, synced, waited = take_rollout(parts, progress, step, ahead)
        collected = ranks.gather_rows(rollout.collected)
        t_rollout = ranks.largest(rollout.seconds)
        counts, version = rollout.counts, rollout.version
        lag = {names.POLICY_STALENESS: step - 1 - rollout.version,
               names.ROLLOUT_WAIT_S: round(ranks.largest(waited), 3)}
    if not sft:
        check_env_loss(parts.cfg, progress.step_groups, step)
    # [data] traces_loss = "rl": the warm start's recorded rows train the RL loss off-policy (their
    # advantages, the ratio over their recorded sampler log-probs), not SFT
    traces_rl = sft and parts.traces is not None and parts.cfg.data.traces_loss == "rl"
    phase = names.PHASE_TRACES_RL if traces_rl else names.PHASE_SFT if sft else names.PHASE_RL
    saved = (save_step_rows(parts.cfg.run_dir, parts.cfg.logging.save_rows, step, collected, phase=phase,
                            policy_version=version) if ranks.is_main() else {})
    trained = _update(parts, progress, step, [row for row, _ in collected], sft=sft, phase=phase)
    took = time.perf_counter() - t0
    timing = {names.ROLLOUT_TIME_S: round(t_rollout, 3), names.TOTAL_STEP_TIME_S: round(took, 3),
              names.TOKENS_PER_S: round(trained.get(names.ROW_TOKENS, 0) / took, 1) if took > 0 else 0.0,
              **{k: ranks.largest(v) for k, v in peaks.items()},  # every rank's largest, as its seconds
              names.PROCESS_PEAK_MEM_MB: ranks.largest(round(process_peak_mb(parts.trainer.device), 1))}
    if (rss := process_rss_mb()) is not None:
        timing[names.PROCESS_RSS_MB] = ranks.largest(rss)
    # MALLINFO_READABLE is the same on every rank, so all or none join the gather; -1: a skipped reading
    if MALLINFO_READABLE and (in_use := ranks.largest(_or_skipped(malloc_in_use_mb(took)))) >= 0:
        timing[names.PROCESS_MALLOC_IN_USE_MB] = in_use
    return _disjoint({names.PHASE: phase}, ranks.rollout_snapshot(counts), trained, synced,
                     saved, timing, lag, {} if sft else signal_metrics(parts, progress.step_groups, step))


def _or_skipped(reading: float | None) -> float:
    return -1.0 if reading is None else reading


def _update(parts: RunParts, progress: RunProgress, step: int, rows: list, *, sft: bool, phase: str
            ) -> dict[str, Any]:
    """Step `step`'s update: the trainer's `train_step` on its rows (`phase`: which loss); its metrics."""
    t = parts.cfg.training
    progress.updating_step = step  # from here on the trainer no longer holds the previous step's state
    if t.warmup_sft_steps and step == t.warmup_sft_steps + 1 and t.rl_optimizer_start != "continue":
        # the first RL step starts without the warm start's momentum (a resume past here keeps RL's own)
        parts.trainer.reset_optimizer(momentum_only=t.rl_optimizer_start == "reset_momentum")
    if phase == names.PHASE_RL and parts.cfg.loss.beta > 0:
        # the KL penalty's reference ([loss] beta > 0): the weights the RL phase starts from, frozen once
        # (a resume restores the one its checkpoint holds; trainers/reference.py)
        parts.trainer.take_reference()
    if not rows:
        return {names.ROWS: 0, names.ACTION_TOKENS: 0, names.ECHO_TOKENS: 0}  # a step that trains nothing
    parts.trainer.set_lr(parts.cfg.lr_for(sft=sft))
    trained = parts.trainer.train_step(rows, sft=phase == names.PHASE_SFT, echo_weight=echo_scale(parts, step,
                                                                                                   sft)[0])
    progress.sampler_behind = not parts.shares_model
    return trained


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


def _run(parts: RunParts, progress: RunProgress, stop: StopRequest, tqdm, run_id: str,
         found: Found | None) -> None:
    """The run from its first step (or its resume point) to its model in final/."""
    cfg = parts.cfg
    try:
        start = resume_from(parts, progress, found)
    except StoppedInCall as e:  # a task sampler's load_state_dict had not returned
        log.info(names.RUN_END_EVENT, status="interrupted", steps=0, run_id=run_id,
                 note=f"stopped while {e} ran, before the first step")
        raise
    if found is not None and ranks.is_main():
        _accepted(cfg, found)
    if ranks.any_rank(stop.requested):  # while the trainer, sampler or checkpoint loaded: no step to finish
        log.info(names.RUN_END_EVENT, status="interrupted", steps=start, run_id=run_id,
                 note="stopped before the first step")
        raise KeyboardInterrupt
    last = cfg.training.warmup_sft_steps + cfg.training.steps
    if start == 0 and cfg.training.eval_every:
        evaluate_at(parts, progress, 0)
        if ranks.any_rank(stop.requested):  # during the untrained evaluation: still no step to finish
            log.info(names.RUN_END_EVENT, status="interrupted", steps=0, run_id=run_id,
                     note="stopped during the untrained evaluation, before the first step")
            raise KeyboardInterrupt
    bar = tqdm(range(start + 1, last + 1), initial=start, total=last, desc="train", unit="step",
               # no bar in a log file
               disable=not cfg.logging.progress or not sys.stderr.isatty() or not ranks.is_main())
    try:
        with RolloutsAhead() if cfg.rollout.max_off_policy_steps else contextlib.nullcontext() as ahead:
            last = _loop(parts, progress, stop, bar, run_id, ahead)
    except (KeyboardInterrupt, EmptyRunError):
        raise  # their run_end is logged where they are raised
    except Exception as e:
        log.error(names.RUN_END_EVENT, status="failed", steps=progress.completed_step, run_id=run_id,
                  error=error_line(e), checkpoint_step=progress.saved_step)
        raise
    why = nothing_trained(cfg, progress.cumulative.totals, last)  # fewer steps than max_empty_steps
    if why:
        log.error(names.RUN_END_EVENT, status="failed", steps=last, run_id=run_id, error=why,
                  drop_reasons=drop_reasons(progress.cumulative.totals))
        raise EmptyRunError(why)  # no final/: there is no trained model to hand over
    from quaero.recipe.model_folder import save_final

    save_final(parts.trainer, cfg)  # runs/NAME/final/: the model a user takes away, an HF folder (rank 0)
    progress.signal.finish()
    log.info(names.RUN_END_EVENT, status="finished", steps=last, run_id=run_id)


def _loop(parts: RunParts, progress: RunProgress, stop: StopRequest, bar, run_id: str,
          ahead: RolloutsAhead | None) -> int:
    """Run the steps of `bar` up to the last; the last: `warmup_sft_steps + steps`, or the RL step that spent
    the token budget."""
    last = parts.cfg.training.warmup_sft_steps + parts.cfg.training.steps
    for step in bar:
        set_step(step)
        # a copy, not the live state
        before = (json.loads(json.dumps(task_state(parts, progress))), checkpoint.rng_state())
        try:
            last = _advance(parts, progress, stop, bar, run_id, ahead, step, last)
        except StoppedInCall as e:  # a user's call (a task sampler's) had not returned when the run stopped
            _stopped_in_call(parts, progress, step, e, before, run_id)
            raise
        except (KeyboardInterrupt, EmptyRunError):
            raise
        except Exception as e:
            keep_last_step(parts, progress, step, e, before)
            raise
        if step == last:
            break
    return last


def _stopped_in_call(parts: RunParts, progress: RunProgress, step: int, e: StoppedInCall,
                     before: tuple[dict, dict], run_id: str) -> None:
    """A stop request ended a user's call in step `step` (quaero/bounded.py): the last completed step is
    checkpointed as a failed step's would be (from the task state `before` this step, not from the stuck
    call's), and the run ends interrupted there."""
    try:
        keep_last_step(parts, progress, step, e, before)
    except StoppedInCall:  # its state_dict() is the stuck call: the last checkpoint stays the resume point
        pass
    log.info(names.RUN_END_EVENT, status="interrupted", steps=progress.completed_step, run_id=run_id,
             checkpoint_step=progress.saved_step, note=f"stopped while {e} ran; step {step} was not trained")


def _advance(parts: RunParts, progress: RunProgress, stop: StopRequest, bar, run_id: str,
             ahead: RolloutsAhead | None, step: int, last: int) -> int:
    """Step `step` (`run_step`), then log it, checkpoint when due, evaluate when due; the run's last step
    (`last`, or this one when it spent `[training] rl_token_budget`)."""
    cfg = parts.cfg
    m = run_step(parts, progress, step, sft=step <= cfg.training.warmup_sft_steps, ahead=ahead)
    stopping = ranks.any_rank(stop.requested)  # every rank checkpoints and stops at the same step
    log.info(names.TRAIN_STEP_EVENT, **m, cumulative=progress.cumulative.add(m))
    progress.completed_step = step
    progress.signal.step(step, m)
    empty = progress.empty.after(cfg, {e.name: e.driver for e in parts.envs}, step, m)
    if empty:
        log.error(names.RUN_END_EVENT, status="failed", steps=step, run_id=run_id, error=empty,
                  drop_reasons=progress.empty.drops)
        raise EmptyRunError(empty)
    bar.set_postfix(reward=m.get(names.REWARD_MEAN), echo=m.get(names.ECHO_LOSS), rl=m.get(names.RL_LOSS))
    if step < last and budget_spent(cfg, progress.cumulative.totals, step):
        log.info(names.RL_TOKEN_BUDGET_SPENT_EVENT, step=step, budget=cfg.training.rl_token_budget,
                 generated_tokens=progress.cumulative.totals.get(names.GENERATED_TOKENS),
                 steps_left=last - step)
        last = step  # this step is the run's last: checkpoint, evaluation, final/
    if step % cfg.training.checkpoint_every == 0 or step == last or stopping:
        save_checkpoint(parts, progress, step)
    if not stopping and cfg.training.eval_every and (step % cfg.training.eval_every == 0 or step == last):
        if ahead is not None:
            ahead.wait()  # evaluation never shares the sampler or the env pool with a rollout sampled ahead
        evaluate_at(parts, progress, step)
    if not stopping and step < last:  # a stop during the checkpoint write or the evaluation: no further step
        stopping = ranks.any_rank(stop.requested)
        if stopping and progress.saved_step < step:
            save_checkpoint(parts, progress, step)
    if stopping:
        log.info(names.RUN_END_EVENT, status="interrupted", steps=step, run_id=run_id)
        raise KeyboardInterrupt
    return last


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
        log.warning(names.RUN_LOCK_TAKEN_OVER_EVENT, lock=str(lock.path), stale_pid=lock.stale_pid,
                    note="that process died holding the run folder's lock")
    return run.run_id


def _start(cfg: QuaeroConfig, found: Found | None, source: str) -> None:
    """Rank 0's first lines of the run: a new run's config.json (a resume's is written once its checkpoint is
    accepted: `_accepted`), `run_start`."""
    if found is None:
        (cfg.run_dir / names.CONFIG).write_text(cfg.model_dump_json(indent=2))
    spread = {names.RANKS: ranks.world_size()} if ranks.world_size() > 1 else {}
    log.info(names.RUN_START_EVENT, source=source, run_dir=str(cfg.run_dir),
             config=cfg.model_dump(mode="json"), **spread)


def _accepted(cfg: QuaeroConfig, found: Found) -> None:
    """A resume whose checkpoint loaded: what changed since the run's last start, then its config.json. A
    refused resume leaves both alone (the next resume, `quaero review` and `quaero export` read the config
    that trained)."""
    note_changed_config(cfg, found)
    (cfg.run_dir / names.CONFIG).write_text(cfg.model_dump_json(indent=2))


def _set_up(cfg: QuaeroConfig) -> bool:
    """The process before the run: unsloth before transformers, the process group joined, logging and the
    seed set; whether this call joined the process group (and leaves it at the end)."""
    if cfg.backend.backend == "unsloth":
        from trainers.registry import trainer_class

        trainer_class("unsloth")  # unsloth must be imported before transformers to patch it
    import torch

    from quaero import process_group
    from quaero.models.load import resolve_device

    joins = not torch.distributed.is_initialized()
    process_group.setup(cfg.distributed.strategy, torch.device(resolve_device(cfg.run.device)))
    configure(cfg.logging.level, cfg.logging.console if ranks.is_main() else "none")  # rank 0 speaks for all
    torch.manual_seed(cfg.run.seed)
    if cfg.backend.options.train_supervised_context_tokens:
        log.warning(names.APPROXIMATION_EVENT, option="train_supervised_context_tokens",
                    value=cfg.backend.options.train_supervised_context_tokens,
                    note="rows are cropped before their first target: not exact full-context training")
    return joins


def train(cfg: QuaeroConfig, *, resume: bool = False, restart: bool = False, source: str = "config") -> Path:
    """Run the job; returns the run folder. Ctrl-C (or SIGTERM) finishes the step, checkpoints, shuts down env
    servers and the sampler, and raises KeyboardInterrupt (the CLI exits 130). A run folder with checkpoints
    is resumed from its newest intact one; `restart` starts over at step 1 instead (see
    quaero/recipe/run_state.py `resume_point`). Raises RunFolderLocked when another process trains in the
    same run folder.

    Under torchrun every rank calls this; it joins the process group first and leaves it at the end."""
    joins = _set_up(cfg)  # unsloth first: nothing above imports transformers
    from tqdm.auto import tqdm

    from quaero import process_group
    from quaero.telemetry.counts import RolloutCounts

    try:
        with contextlib.ExitStack() as held:
            run_id = ranks.from_rank0(lambda: _open_run_folder(held, cfg))
            found = agreed_resume_point(cfg, resume=resume, restart=restart)
            counts = RolloutCounts()
            pools = open_pools(held, cfg, counts)
            with StopRequest() as stop:
                if ranks.is_main():
                    _start(cfg, found, source)
                try:
                    parts = build(cfg, pools, counts, sampler_log_dir=cfg.run_dir / names.SAMPLER_SERVERS)
                except KeyboardInterrupt:  # a stop request while the sampler's servers started (stopped now)
                    resumed_at = found[1]["step"] if found else 0
                    log.info(names.RUN_END_EVENT, status="interrupted", steps=resumed_at, run_id=run_id,
                             note="stopped while the sampler started, before the first step")
                    raise
                try:
                    _run(parts, RunProgress(), stop, tqdm, run_id, found)
                finally:
                    parts.sampler.close()
    finally:
        if joins:
            process_group.shutdown()
    return cfg.run_dir
