"""A user's call, bounded (quaero/bounded.py): its value or error, its bound, its progress line, a stop
request's grace, and a worker left stuck. Every hang here ends when the fixture's RELEASE is set."""
from __future__ import annotations

import threading
import time

import pytest
import structlog

from quaero import bounded
from quaero.bounded import STOP_REQUESTED, CallTimeout, CallWorker, StoppedInCall, bounded_call

pytestmark = pytest.mark.hostile

RELEASE = threading.Event()


@pytest.fixture(autouse=True)
def _released():
    RELEASE.clear()
    yield
    RELEASE.set()
    STOP_REQUESTED.clear()


def _hang():
    RELEASE.wait(30)


def test_a_call_gives_its_value_or_its_own_error():
    assert bounded_call(lambda: 7, "f()", timeout_s=1, bound="b") == 7
    with pytest.raises(ZeroDivisionError):
        bounded_call(lambda: 1 / 0, "f()", timeout_s=1, bound="b")


@pytest.mark.parametrize("exits", [SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
def test_a_call_that_exits_is_the_calls_failure_not_the_runs_silent_end(exits):
    """An oracle's sys.exit or KeyboardInterrupt while guiding ended the run with no line and no run_end."""
    def call():
        raise exits

    with pytest.raises(bounded.UserCallExited, match=rf"^f\(\) raised {type(exits).__name__}\(.*\): a user's "
                                                      "call may not exit the run"):
        bounded_call(call, "f()", timeout_s=1, bound="b")
    assert isinstance(bounded.UserCallExited("x"), Exception)  # every `except Exception` of a caller holds it


def test_a_call_past_its_bound_is_named_with_the_setting_that_bounds_it():
    t0 = time.monotonic()
    with pytest.raises(CallTimeout, match=r"^S: sample\(4\) did not return within 0.3s \(\[env.tasks\] "
                       r"timeout_s\); fix the code"):
        bounded_call(_hang, "S: sample(4)", timeout_s=0.3, bound="[env.tasks] timeout_s")
    assert time.monotonic() - t0 < 2


def test_a_long_call_logs_progress_lines_with_what_it_did(monkeypatch):
    monkeypatch.setattr(bounded, "PROGRESS_S", 0.15)
    done = [0]

    def slow():
        for _ in range(6):
            done[0] += 1
            time.sleep(0.1)
        return "ok"

    with structlog.testing.capture_logs() as logs:
        assert bounded_call(slow, "S: sample(1)", timeout_s=None, bound="b",
                            progress=lambda: {"task_specs_read": done[0]}) == "ok"
    lines = [e for e in logs if e["event"] == "user_call_waiting"]
    assert len(lines) >= 2 and lines[0]["call"] == "S: sample(1)" and lines[-1]["task_specs_read"] > 1


def test_a_stop_request_ends_a_call_that_never_returns_after_its_grace():
    STOP_REQUESTED.set()
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs, pytest.raises(StoppedInCall):
        bounded_call(_hang, "S: sample(2)", timeout_s=None, bound="b", grace_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert [e["call"] for e in logs if e["event"] == "user_call_stopped"] == ["S: sample(2)"]


def test_a_call_that_returns_within_the_grace_is_kept():
    STOP_REQUESTED.set()
    assert bounded_call(lambda: time.sleep(0.1) or 3, "f()", timeout_s=None, bound="b", grace_s=5) == 3


def test_a_worker_stuck_past_a_bound_says_so():
    worker = CallWorker("w")
    assert bounded_call(lambda: 1, "f()", timeout_s=1, bound="b", worker=worker) == 1
    with pytest.raises(CallTimeout):
        bounded_call(_hang, "g()", timeout_s=0.2, bound="b", worker=worker)
    assert worker.stuck


def _user_call_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "quaero-user-call"]


def test_a_call_without_a_worker_leaves_no_thread_behind():
    # the warm start's oracle calls ran one each: a thread left idle per call was ~14 a step of the main job
    for t in _user_call_threads():  # another test's abandoned call: released by the fixture, ending
        t.join(5)
    for i in range(40):
        assert bounded_call(lambda i=i: i, "f()", timeout_s=5, bound="b") == i
    for t in _user_call_threads():
        t.join(5)
    assert _user_call_threads() == []


def test_a_worker_dropped_after_its_calls_ends_its_thread():
    worker = CallWorker("quaero-dropped-worker")
    assert bounded_call(lambda: 1, "f()", timeout_s=5, bound="b", worker=worker) == 1
    thread = worker._thread
    del worker
    thread.join(5)
    assert not thread.is_alive()
