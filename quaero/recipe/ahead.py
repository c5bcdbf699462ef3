"""Rollouts sampled ahead of the trainer: `[rollout] max_off_policy_steps = k`.

While the main thread trains step s, one worker thread samples the rollouts of the next RL steps, with the
weights the trainer had before step s. What runs there is only this rank's own work: the driver's
episodes and the rows built from them (quaero/recipe/groups.py `roll_out`). Every collective (gathering
rows, summing counters, the trainer's own) stays on the main thread, in the same order on every rank: under
torchrun a collective issued from a second thread would deadlock or pair with the wrong one.

One user at a time: the sampler and the env pool are used by the worker while a rollout is pending and by
the main thread (weight pushes, evaluation) only once `wait` says none is: the sampler takes new weights
only when idle, so the rollouts launched together share one version.

Versions: the policy version of a set of weights is the number of trainer steps they have seen, so the
rollout of step t sampled while step s trains has version s - 1 and is `t - s` versions stale when step
t trains (its `policy_staleness`); the trainer's importance ratio against the sampler's own log-probs
(trainers/loss.py) corrects for the lag, and clipping bounds it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quaero.recipe import ranks
from quaero.recipe.groups import draw, learn, roll_out
from quaero.recipe.weight_sync import sync_sampler
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger, set_step

if TYPE_CHECKING:
    from quaero.recipe.groups import Collected, GroupOutcome
    from quaero.recipe.parts import RunParts
    from quaero.recipe.progress import RunProgress
    from quaero.telemetry.counts import RolloutCounts

log = get_logger(__name__)


@dataclass
class Rollout:
    """One RL step's episodes on this rank, before any collective."""
    step: int
    version: int  # the policy version that sampled every row of it: trainer steps its weights had seen
    collected: Collected  # this rank's kept rows, each with its episode's transitions
    counts: RolloutCounts  # its counts, taken out of the pool's when it ended
    seconds: float  # how long it sampled
    # this rank's groups' outcomes, for the task samplers, which learn from them on the main thread when the
    # step takes the rollout
    groups: list[GroupOutcome] = field(default_factory=list)


class RolloutsAhead:
    """The pending rollouts of the next steps, run one after another on one worker thread.

    A context manager: leaving it (a finished run, a stop request, an error) waits for the rollout in flight
    and drops the queued ones, so no thread outlives the run and the env pool and sampler close idle."""

    def __init__(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quaero-rollout-ahead")
        self._pending: dict[int, Future] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for future in self._pending.values():
            future.cancel()  # not started yet: never starts
        wait_for(list(self._pending.values()))
        self._worker.shutdown(wait=True)
        for step, future in sorted(self._pending.items()):
            # the run already ends; say why it failed
            if not future.cancelled() and future.exception() is not None:
                log.warning(names.ROLLOUT_AHEAD_DISCARDED_EVENT, for_step=step,
                            error=repr(future.exception()))
        self._pending.clear()

    def idle(self) -> bool:
        """No rollout is pending: the sampler and the env pool are free for the main thread."""
        return not self._pending

    def launch(self, step: int, roll_out: Callable[[], Rollout]) -> None:
        import torch

        self._pending[step] = self._worker.submit(_with_threads, torch.get_num_threads(), roll_out)

    def take(self, step: int) -> tuple[Rollout | None, float]:
        """Step `step`'s rollout (None when none was launched for it) once it has ended, and the seconds
        waited for it; an error raised on the worker is raised here, as the run's error."""
        future = self._pending.pop(step, None)
        if future is None:
            return None, 0.0
        t0 = time.perf_counter()
        rollout = future.result()
        return rollout, time.perf_counter() - t0

    def wait(self) -> None:
        """Block until every pending rollout has ended (results and errors stay for `take`)."""
        wait_for(list(self._pending.values()))


def _with_threads(threads: int, roll_out: Callable[[], Rollout]) -> Rollout:
    """`roll_out` with the launching thread's torch thread count. OpenMP keeps the count per thread, and a new
    thread starts from the environment's (OMP_NUM_THREADS, else one per core), not from the count the main
    thread set, as vLLM's CPU worker does when it binds its threads to the cores: its attention kernels then
    refused metadata sized on the other thread ("Check failed: input->metadata->thread_num == thread_num
    (1 vs. 2)": OMP_NUM_THREADS=1, the main thread at 2)."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return roll_out()


def sample_ahead(parts: RunParts, step: int, picks: list[list], version: int) -> Rollout:
    """Step `step`'s rollout of `picks` with the sampler's weights of policy `version`, its counts taken
    apart; runs on the worker thread (or inline, on-policy, for a step nothing was launched for)."""
    set_step(step)  # the events logged while it samples carry the step they sample for
    t0 = time.perf_counter()
    collected, groups = roll_out(parts, step, picks, sft=False)  # no dynamic sampling ahead (config rule)
    return Rollout(step, version, collected, parts.counts.take(), time.perf_counter() - t0, groups)


def take_rollout(parts: RunParts, progress: RunProgress, step: int, ahead: RolloutsAhead
                 ) -> tuple[Rollout, dict[str, Any], float]:
    """RL step `step`'s rollout (launched earlier, or sampled now when none was), then the launch of the next
    steps' rollouts; also the weight push's metrics and the seconds waited for the rollout.

    The sampler takes the weights of version step - 1 only while no rollout is pending, and every rollout
    launched then shares them: the steps up to step + k, so none trains rows more than k versions old.
    A step's tasks are drawn when its rollout is launched (on this thread, in step order), so a learning task
    sampler has learned from the steps trained by then, not from the k steps in flight; the drawn tasks of
    steps not yet trained are kept in checkpoints (`pending`), so a resumed run plays them."""
    t, n_tasks = parts.cfg.training, parts.cfg.rollout.tasks_per_step
    rollout, waited = ahead.take(step)
    synced: dict[str, Any] = {}
    if rollout is None:  # the first RL step (of the run, or since a resume): on-policy
        t0 = time.perf_counter()
        synced = sync_sampler(parts, progress)
        picks = progress.pending.get(step) or draw(parts, step, n_tasks)
        rollout = sample_ahead(parts, step, picks, step - 1)
        waited = time.perf_counter() - t0
    # the step's tasks are used; a checkpoint of this step resumes after them
    progress.pending.pop(step, None)
    progress.step_groups = ranks.gather_rows(rollout.groups)
    learn(parts, step, progress.step_groups)
    last = min(step + parts.cfg.rollout.max_off_policy_steps, t.warmup_sft_steps + t.steps)
    if ahead.idle() and last > step:  # the run's last step launches nothing: no push either
        synced = sync_sampler(parts, progress) or synced
        for s in range(step + 1, last + 1):
            if s not in progress.pending:
                progress.pending[s] = draw(parts, s, n_tasks)
            ahead.launch(s, lambda s=s, picks=progress.pending[s]: sample_ahead(parts, s, picks, step - 1))
    return rollout, synced, waited
