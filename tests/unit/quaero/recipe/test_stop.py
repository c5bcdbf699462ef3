"""When a run stops early (quaero/recipe/stop.py): a stop request from a real signal, `max_empty_steps`, an
env that has no episode to give, a run that trained nothing, and the RL token budget."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
import structlog
from fixtures.rollout import make_cfg

from quaero.bounded import STOP_REQUESTED
from quaero.recipe.stop import EmptySteps, StopRequest, budget_spent, nothing_trained


def test_the_first_signal_asks_the_step_to_finish_the_second_aborts_and_leaving_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with structlog.testing.capture_logs() as logs, StopRequest() as stop:
        assert not stop.requested and not STOP_REQUESTED.is_set()
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested and STOP_REQUESTED.is_set()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert [e["signal"] for e in logs if e["event"] == "stop_requested"] == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is before and not STOP_REQUESTED.is_set()


def _step(rows: int, **counts) -> dict:
    return {"rows": rows, "episodes": 2, **counts}


def test_empty_steps_stop_the_run_after_max_empty_steps_in_a_row_with_their_reasons_summed():
    cfg, empty = make_cfg(training__max_empty_steps=2), EmptySteps()
    assert empty.after(cfg, {}, 1, _step(0, drop_reason_timeout=1)) is None
    assert empty.after(cfg, {}, 2, _step(3)) is None  # a trained row starts the count over
    assert empty.steps == 0 and empty.drops == {}
    assert empty.after(cfg, {}, 3, _step(0, drop_reason_timeout=2)) is None
    last = _step(0, drop_reason_timeout=1, drop_reason_env_error=1, context_exhausted=1)
    why = empty.after(cfg, {}, 4, last)
    assert why.startswith("steps 3-4 trained no row ([training] max_empty_steps=2); dropped episodes by "
                          "reason: 1x env_error, 3x timeout; 1 episode(s) ended with no room for a turn")


def test_a_step_whose_every_reset_ended_stops_at_once_with_what_the_env_said():
    drivers = {"a": SimpleNamespace(reset_end_reason="no API key set."),
               "b": SimpleNamespace(reset_end_reason=None)}
    why = EmptySteps().after(make_cfg(), drivers, 5, {"rows": 0, "episodes": 0, "episodes_ended_at_reset": 4})
    assert why == ("step 5: every reset (4) answered done=True, so there is no episode to play; the env "
                   "said: a: no API key set; fix what the env needs (a key, a sandbox, a dataset)")


def test_a_run_that_trained_no_row_says_why_and_one_that_did_says_nothing():
    cfg = make_cfg()
    assert nothing_trained(cfg, {"rows": 5}, 2) is None and nothing_trained(cfg, {}, 0) is None
    assert nothing_trained(cfg, {"rows": 0, "drop_reason_timeout": 3}, 2) == (
        "the run's 2 step(s) trained no row; dropped episodes by reason: 3x timeout; the env_episode_dropped "
        f"events in {cfg.run_dir / 'events.jsonl'} say why")


def test_the_token_budget_is_spent_by_rl_steps_only():
    cfg = make_cfg(training__rl_token_budget=100, training__warmup_sft_steps=2)
    assert not budget_spent(cfg, {"generated_tokens": 500}, 2)  # a warm-start step
    assert not budget_spent(cfg, {"generated_tokens": 99}, 3)
    assert budget_spent(cfg, {"generated_tokens": 100}, 3)
    assert not budget_spent(make_cfg(), {"generated_tokens": 10**9}, 3)  # no budget


@pytest.mark.hostile
def test_a_second_signal_aborts_a_long_checkpoint_write_at_once():
    """The write runs on a worker thread, the main thread waiting where a signal's handler runs: the second
    stop raises now, not when the write (a long call into C) returns."""
    import os
    import threading
    import time

    from quaero.recipe.stop import interruptible

    assert interruptible(lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        interruptible(lambda: 1 / 0)
    release = threading.Event()

    def long_write() -> str:
        release.wait(60)
        return "written"

    timers = [threading.Timer(t, os.kill, (os.getpid(), sig)) for t, sig in ((0.2, signal.SIGTERM),
                                                                            (0.5, signal.SIGINT))]
    with StopRequest() as stop:
        for t in timers:
            t.start()
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            interruptible(long_write)
        assert stop.requested and time.monotonic() - t0 < 10
    release.set()
