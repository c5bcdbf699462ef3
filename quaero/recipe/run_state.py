"""The run's state on disk, as the recipe writes and reads it: a step's checkpoint (the trainer, the RNG,
the run's totals and what decides the next tasks; `RunState` in quaero/recipe/checkpoint.py is its format),
the checkpoint a run resumes from, the resume itself, and what changed in the config since the run's last
start."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quaero.config import UNTRAINED_KEYS, QuaeroConfig, changed_keys
from quaero.config.renamed import migrate
from quaero.recipe import checkpoint, ranks
from quaero.recipe.stop import interruptible
from quaero.rollout.mixture import MixtureError
from quaero.rollout.task_samplers import MAX_SAVED, SavedStateError, TaskSamplerError, saved_number
from quaero.telemetry import names
from quaero.telemetry.runlog import Cumulative, error_line, get_logger
from trainers.memory import peak_window

if TYPE_CHECKING:
    from quaero.recipe.parts import EnvRun, RunParts
    from quaero.recipe.progress import RunProgress

log = get_logger(__name__)

Found = tuple[Path, dict]  # a checkpoint to resume from: its folder and its state


def save_checkpoint(parts: RunParts, progress: RunProgress, step: int, rng: dict | None = None,
                    tasks: dict[str, Any] | None = None) -> Path:
    """Rank 0 writes the checkpoint; an FSDP2 trainer's shards are written by every rank into it first
    (torch.distributed.checkpoint), and every rank's RNG state is kept beside rank 0's. `rng`: the state to
    keep instead of the current one (a step that failed had drawn from it), `tasks` the task state
    likewise."""
    root, rank_rng = checkpoint.run_checkpoints(parts.cfg.run_dir), None
    if ranks.world_size() > 1:
        rank_rng = ranks.gather(checkpoint.rng_state())
    shards = None
    if parts.trainer.sharded:
        shards = ranks.from_rank0(lambda: checkpoint.temp_folder(root, step))
        parts.trainer.save_shards(shards / checkpoint.SHARDS)

    tasks = task_state(parts, progress) if tasks is None else tasks

    def write() -> Path:
        state = checkpoint.RunState(step=step, cursor=_cursor(parts, tasks),
                                    trainer=parts.trainer.state_dict(), rng=rng or checkpoint.rng_state(),
                                    cumulative=progress.cumulative.totals, rank_rng=rank_rng, tasks=tasks)
        return checkpoint.save(root, step, state.to_state(), keep=parts.cfg.training.keep_checkpoints,
                               folder=shards)

    t0, written = time.perf_counter(), {}
    try:
        with peak_window(parts.trainer.device, written, names.PEAK_MEM_MB):
            path = ranks.from_rank0(lambda: interruptible(write))  # a second Ctrl-C aborts mid-write
    except checkpoint.CheckpointError as e:
        log.error(names.CHECKPOINT_FAILED_EVENT, error=str(e))
        raise
    progress.saved_step = step
    log.info(names.CHECKPOINT_SAVED_EVENT, path=str(path), seconds=round(time.perf_counter() - t0, 3),
             **written)
    return path


def _cursor(parts: RunParts, tasks: dict[str, Any]) -> int:
    """The one-env sequential cursor a checkpoint has always held (an older quaero resumes from it), read from
    `tasks` (`task_state`)."""
    state = tasks["samplers"][parts.envs[0].name]["state"]
    return int(state.get("cursor", 0)) if isinstance(state, dict) else 0


def task_state(parts: RunParts, progress: RunProgress) -> dict[str, Any]:
    """What decides the next tasks: the mixture's cursor, every env's task sampler, the steps drawn ahead."""
    return {"mixture": parts.mixture.state_dict(),
            "samplers": {e.name: e.tasks.state_dict() for e in parts.envs},
            "pending": {str(k): v for k, v in sorted(progress.pending.items())}}


def load_task_state(parts: RunParts, progress: RunProgress, state: checkpoint.RunState) -> None:
    """Restore `task_state`, refusing one written by another mixture or other samplers; a checkpoint of an
    older quaero holds the sequential cursor alone."""
    saved, first = state.tasks, parts.envs[0]
    warm_start = state.step <= parts.cfg.training.warmup_sft_steps  # RL has drawn nothing yet
    sequential = not parts.cfg.is_mixture and first.cfg.env.tasks.sampler == "sequential"
    if saved is None and warm_start and not sequential and not parts.cfg.is_mixture:
        _sampler_changed(first, "sequential", state.step)  # an older quaero's warm start
        return
    if saved is None:
        if not sequential:
            raise checkpoint.CheckpointError("the checkpoint holds no task sampler state (written before "
                                             "mixtures and task samplers); resume it with one [env] and "
                                             "sampler = \"sequential\", or pass --restart")
        first.tasks.sampler.load_state_dict({"cursor": state.cursor})
        return
    mine, theirs = [e.name for e in parts.envs], list(saved["samplers"])
    if mine != theirs:
        raise checkpoint.CheckpointError(f"the checkpoint was written by envs {theirs}, this config has "
                                         f"{mine}; "
                                         "resume with the config it was saved with, or pass --restart")
    parts.mixture.load_state_dict(saved["mixture"])
    progress.pending = _pending(parts, saved["pending"], state.step)
    for e in parts.envs:
        theirs = saved["samplers"][e.name].get("sampler")
        if theirs != e.tasks.view.settings.sampler and warm_start:
            _sampler_changed(e, theirs, state.step)
            progress.pending = {}
            continue
        e.tasks.load_state_dict(saved["samplers"][e.name])


def _pending(parts: RunParts, saved: dict[str, list], step: int) -> dict[int, list]:
    """The checkpoint's steps drawn ahead (`pending`: step -> [[env name, task index], ...]), each step after
    `step` and each task an index of its env's split; SavedStateError naming the first that is not."""
    sizes = {e.name: e.tasks.view.size for e in parts.envs}
    out = {}
    for key, picks in saved.items():
        later = saved_number(int(key) if str(key).isdigit() else key, "pending step", below=MAX_SAVED)
        if later <= step or not isinstance(picks, list):
            raise SavedStateError(f"pending[{key!r}] is not a step after {step} with a list of draws; the "
                                  "checkpoint was edited or is corrupt: move it aside or pass --restart")
        for pick in picks:
            env = pick[0] if isinstance(pick, list) and len(pick) == 2 else None
            if env not in sizes:
                raise SavedStateError(f"pending[{key!r}] draws {pick!r}, not [env, task] of this run's "
                                      f"envs {list(sizes)}; the checkpoint was edited or is corrupt: move it "
                                      "aside or pass --restart")
            saved_number(pick[1], f"pending[{key!r}] task of env {env!r}", below=sizes[env] or MAX_SAVED)
        out[later] = picks
    return out


def _sampler_changed(e: EnvRun, theirs: str | None, step: int) -> None:
    """A warm start's checkpoint, written with another task sampler: RL has drawn nothing yet, so RL may start
    with this one, fresh (one warm start, several samplers compared on it: `quaero bench ablation --from`)."""
    log.warning(names.TASK_SAMPLER_CHANGED_EVENT, env=e.name, checkpoint=theirs,
                config=e.tasks.view.settings.sampler, step=step,
                note="a warm start's checkpoint: RL starts this sampler fresh")


def keep_last_step(parts: RunParts, progress: RunProgress, step: int, error: BaseException,
                   before: tuple[dict, dict]) -> None:
    """Step `step` raised (a weight push a vLLM server refused, an env server gone, an eval that failed): the
    last completed step is checkpointed now if it was not yet, so a resume loses no trained step. That is the
    step itself when it had finished (the failure came after it), else the one before, when the trainer still
    holds it (the failure came before this step's update): its task state and RNG are those `before` this step
    began. One process only: under torchrun the other ranks are not in this code path to join the
    collectives."""
    done = step if progress.completed_step == step else step - 1
    if (done <= progress.saved_step or ranks.world_size() > 1 or isinstance(error, checkpoint.CheckpointError)
            or (done < step and progress.updating_step == step)):
        return
    tasks, rng = before if done < step else (None, None)
    try:
        save_checkpoint(parts, progress, done, rng, tasks)
    except Exception as e:  # noqa: BLE001 - the step's own error is the one to raise
        log.error(names.CHECKPOINT_AFTER_FAILURE_FAILED_EVENT, step=done, error=error_line(e))


def resume_point(cfg: QuaeroConfig, *, resume: bool, restart: bool) -> Found | None:
    """The newest intact checkpoint of the run folder, or None to start at step 1. A folder whose
    checkpoints are all unusable is refused (starting over would overwrite them) unless `restart`,
    which renames the checkpoints folder aside and starts over."""
    root = checkpoint.run_checkpoints(cfg.run_dir)
    checkpoint.remove_orphans(root)  # rank 0 only, holding the lock: other ranks may be writing nothing yet
    if restart:
        aside = checkpoint.set_aside(root, time.strftime("%Y%m%dT%H%M%S"))
        if aside is not None:
            log.warning(names.RESTART_EVENT, note="starting over at step 1", previous_checkpoints=str(aside))
        return None
    if root.exists() and not root.is_dir():  # nowhere to write step 1's checkpoint either
        raise checkpoint.CheckpointError(f"{root} is not a folder; move it aside (the run keeps its "
                                         "checkpoints there) or pass --restart")
    try:
        found = checkpoint.load_latest(root)
    except checkpoint.NoIntactCheckpoint as e:
        raise checkpoint.CheckpointError(f"{e}; repair or remove them, or pass --restart to start over at "
                                         "step 1 (the old checkpoints are kept, renamed aside)") from None
    if found is not None and not resume:
        log.info(names.AUTO_RESUME_EVENT, run_dir=str(cfg.run_dir),
                 note="existing checkpoints found; resuming (use a new [run] name, or --restart to start "
                 "over)")
    if found is None and resume:
        log.warning(names.RESUME_WITHOUT_CHECKPOINT_EVENT, path=str(root),
                    note="nothing to resume; starting at step 1")
    return found


def agreed_resume_point(cfg: QuaeroConfig, *, resume: bool, restart: bool) -> Found | None:
    """`resume_point`, judged by rank 0 (it alone removes orphans and sets folders aside); the other
    ranks load the checkpoint it picked."""
    found = None

    def pick() -> Path | None:
        nonlocal found
        found = resume_point(cfg, resume=resume, restart=restart)
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


def note_changed_config(cfg: QuaeroConfig, found: Found | None) -> None:
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
        return  # not the run's to judge: config.json is rewritten next
    migrate(before, str(previous), dump=True)  # a run written with [training]'s old loss keys
    changes = changed_keys(before, cfg.model_dump(mode="json"))
    if not changes:
        return
    trained = sorted(k for k in changes if not k.startswith(UNTRAINED_KEYS))
    (log.warning if trained else log.info)(
        names.RESUME_CONFIG_CHANGED_EVENT, checkpoint_step=found[1]["step"], changes=changes, trained=trained,
        note="the steps after this resume train with the new values" if trained
        else "only when the run stops, evaluates, checkpoints or logs changed")


def missing_reference(cfg: QuaeroConfig, step: int, trainer_state: dict) -> str | None:
    """Why a checkpoint cannot resume a run with the KL penalty ([loss] beta > 0, full fine-tuning): it
    was written after RL started without the frozen reference (beta was 0 then), and the weights it froze are
    gone. None when it can (a LoRA run's reference is the base, always there; a warm-start checkpoint's is
    taken at the first RL step)."""
    if cfg.loss.beta <= 0 or cfg.backend.lora or step <= cfg.training.warmup_sft_steps:
        return None
    if "reference" in trainer_state:
        return None
    return (f"[loss] beta={cfg.loss.beta:g}: this checkpoint of RL step {step} holds no KL reference "
            "(the run trained without one) and the weights RL started from are gone; resume with beta = 0, "
            "or pass --restart to start over with the KL penalty")


def resume_from(parts: RunParts, progress: RunProgress, found: Found | None) -> int:
    """Load the checkpoint `found` into the trainer, the RNG, the task samplers and `progress`; the step it
    holds (0: nothing to resume)."""
    if found is None:
        return 0
    path, saved = found
    t0 = time.perf_counter()
    try:  # the manifest vouches for the bytes, not for what they hold (a crafted or foreign state)
        state = checkpoint.RunState.from_state(saved)
        if problem := missing_reference(parts.cfg, state.step, state.trainer):
            raise checkpoint.CheckpointError(problem)
        parts.trainer.load_state_dict(state.trainer, shards=path / checkpoint.SHARDS)
        checkpoint.set_rng_state(state.rng_of_rank(ranks.rank(), ranks.world_size()))
        load_task_state(parts, progress, state)
        progress.cumulative = Cumulative(state.cumulative)
    except (checkpoint.CheckpointError, TaskSamplerError, MixtureError) as e:  # what differs, in one line
        raise checkpoint.CheckpointError(f"{path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any failure here means: this checkpoint cannot be resumed
        raise checkpoint.CheckpointError(
            f"{path}: verified but cannot be loaded into this run ({error_line(e)}); move that folder "
            "aside to resume from the one before it, or pass --restart to start over at step 1") from None
    progress.sampler_behind = not parts.shares_model  # pushed before the sampler's next use
    progress.completed_step = progress.saved_step = state.step
    log.info(names.RESUMED_EVENT, path=str(path), step=state.step, seconds=round(time.perf_counter() - t0, 3))
    return state.step

