"""Rollouts sampled ahead of the trainer: `[training] max_off_policy_steps = k`.

While the main thread trains step s, one worker thread samples the rollouts of the next RL steps, with the
weights the trainer had before step s. What runs there is only this rank's own work: the driver's
episodes and the rows built from them (`quaero/recipe/train.py` `_roll_out`). Every collective (gathering
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
from typing import TYPE_CHECKING

from quaero.telemetry.runlog import get_logger

if TYPE_CHECKING:
    from quaero.rollout.rows import EchoRow, Transition
    from quaero.telemetry.counts import RolloutCounts

log = get_logger(__name__)


@dataclass
class Rollout:
    """One RL step's episodes on this rank, before any collective."""
    step: int
    version: int  # the policy version that sampled every row of it: trainer steps its weights had seen
    # this rank's kept rows, each with its episode's transitions
    collected: list[tuple[EchoRow, list[Transition]]]
    counts: RolloutCounts  # its counts, taken out of the pool's when it ended
    seconds: float  # how long it sampled
    # this rank's groups' outcomes (train.py GroupOutcome), for the
    groups: list = field(default_factory=list)
    # task samplers, which learn from them on the main thread when the step takes the rollout


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
                log.warning("rollout_ahead_discarded", for_step=step, error=repr(future.exception()))
        self._pending.clear()

    def idle(self) -> bool:
        """No rollout is pending: the sampler and the env pool are free for the main thread."""
        return not self._pending

    def launch(self, step: int, roll_out: Callable[[], Rollout]) -> None:
        self._pending[step] = self._worker.submit(roll_out)

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
