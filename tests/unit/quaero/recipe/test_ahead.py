"""RolloutsAhead (quaero/recipe/ahead.py): a rollout's error is the taking step's error, leaving waits for the
one in flight and drops the queued ones, and no worker thread outlives it; RolloutCounts.take keeps a
rollout's counts apart; a rollout samples with the launching thread's torch thread count."""
import threading
import time

import pytest

from quaero.recipe.ahead import Rollout, RolloutsAhead
from quaero.telemetry.counts import RolloutCounts


def workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("quaero-rollout-ahead")]


def rollout(step: int) -> Rollout:
    return Rollout(step, step - 2, [], RolloutCounts(), 0.0)


def test_a_rollout_is_taken_once_and_an_error_raised_on_the_worker_is_raised_by_the_step_taking_it():
    def broken():
        raise RuntimeError("env pool gone")

    with RolloutsAhead() as ahead:
        assert ahead.idle() and ahead.take(3) == (None, 0.0)  # nothing launched: the step samples itself
        ahead.launch(3, lambda: rollout(3))
        ahead.launch(4, broken)
        assert not ahead.idle()
        ahead.wait()
        got, waited = ahead.take(3)
        assert got.step == 3 and got.version == 1 and waited >= 0
        with pytest.raises(RuntimeError, match="env pool gone"):
            ahead.take(4)
        assert ahead.idle()
    assert not workers()


def test_leaving_waits_for_the_rollout_in_flight_and_drops_the_queued_ones():
    started, ran = threading.Event(), []

    def slow(step):
        started.set()
        time.sleep(0.3)
        ran.append(step)
        return rollout(step)

    with pytest.raises(KeyboardInterrupt), RolloutsAhead() as ahead:
        ahead.launch(5, lambda: slow(5))
        ahead.launch(6, lambda: slow(6))
        started.wait(5)
        raise KeyboardInterrupt  # a stop request while step 5's rollout samples
    assert ran == [5] and not workers()


def test_take_moves_every_count_out_and_the_source_starts_over():
    counts = RolloutCounts()
    counts.episode_finished(reward=1.0, success=True, truncated=False, turns=2)
    counts.add("env_steps", 3)
    taken = counts.take()
    counts.episode_dropped("timeout")  # an evaluation counting after the rollout ended
    mine, theirs = taken.snapshot_and_reset(), counts.snapshot_and_reset()
    assert (mine["episodes"], mine["env_steps"], mine["reward_mean"]) == (1, 3, 1.0)
    assert (theirs["episodes"], theirs["env_steps"], theirs["episodes_dropped"]) == (1, 0, 1)


def test_a_rollout_samples_with_the_torch_thread_count_of_the_thread_that_launched_it():
    """A new thread starts from OpenMP's default count, not the count the main thread set (vLLM's CPU worker
    sets it when it binds its threads): a rollout sees the launcher's count, whatever the worker's own."""
    import torch

    def sampled(step, seen):
        seen.append(torch.get_num_threads())  # on the worker thread
        return rollout(step)

    before = torch.get_num_threads()
    with RolloutsAhead() as ahead:
        try:
            for step in (1, 2):  # the second launch asks for a count the worker thread did not start with
                seen = []
                ahead.launch(step, lambda s=step, seen=seen: sampled(s, seen))
                ahead.wait()
                ahead.take(step)
                assert seen == [torch.get_num_threads()]
                torch.set_num_threads(2 if seen[0] == 1 else 1)
        finally:
            torch.set_num_threads(before)
