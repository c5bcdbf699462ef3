"""A call into a user's code (a task sampler's method, an env's Task API read) that a run waits for: bounded,
never silent, and ended by a stop request.

Python cannot cancel a call, so the call runs on a daemon thread and the caller waits for it in short polls:
a call past its bound raises CallTimeout (the thread is abandoned, still inside it: what it touches must not
be used again); a long one logs a progress line every `progress_s`; a stop request (Ctrl-C, SIGTERM:
quaero/recipe/stop.py StopRequest sets STOP_REQUESTED) lets the call run `grace_s` more, then raises
StoppedInCall (a KeyboardInterrupt: the run ends at its last completed step). While the caller waits on the
main thread the signal handlers run, so a second Ctrl-C aborts at once.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

# set by a stop request (quaero/recipe/stop.py StopRequest), cleared after it; every wait of a run reads it
STOP_REQUESTED = threading.Event()
POLL_S = 0.1  # how often a wait looks at the clock and at a stop request
PROGRESS_S = 30.0  # a call still running this long logs a progress line, and again every as long
STOP_GRACE_S = 10.0  # how long a call may go on after a stop request ([sampler] stop_grace_s)


class CallTimeout(TimeoutError):
    """A user's call did not return within its bound; the message names the call and the bound."""


class StoppedInCall(KeyboardInterrupt):
    """A stop request came while a user's call ran, and the call had not returned `grace_s` later."""


class UserCallExited(RuntimeError):
    """A user's call raised SystemExit, KeyboardInterrupt or another exception that is no `Exception`: user
    code never ends a run without a word; its exit is the call's failure, handled as any error it raises."""


class _Job:
    def __init__(self, call: Callable[[], Any]) -> None:
        self.call, self.done = call, threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the waiting thread
            self.error = e
        self.done.set()


class CallWorker:
    """One daemon thread that runs a source's calls in turn (an env's `get_task`, read once per task: a
    thread per call would cost more than the read). Once a call outlives its bound the worker is stuck
    inside it: `stuck` says so, and nothing more is sent to it. The thread ends when the worker is
    collected (its queue gets None): a worker dropped after its calls leaves no thread behind."""

    def __init__(self, name: str) -> None:
        self.name, self.stuck = name, False
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, call: Callable[[], Any]) -> _Job:
        if self._thread is None:
            # the thread holds the queue, never the worker: else the worker could never be collected
            self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=self.name, daemon=True)
            self._thread.start()
        job = _Job(call)
        self._jobs.put(job)
        return job

    def __del__(self) -> None:
        self._jobs.put(None)  # the thread ends after the calls sent before (a stuck one: when it returns)


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        job.run()
        del job  # the finished call's value is the caller's, not this idle thread's


def bounded_call(call: Callable[[], Any], what: str, *, timeout_s: float | None, bound: str,
                 grace_s: float = STOP_GRACE_S, progress_s: float | None = None,
                 progress: Callable[[], dict] | None = None, worker: CallWorker | None = None) -> Any:
    """`call()`'s value (or its exception), run on `worker` (a thread of its own when None). `what` names the
    call in every line ("[env.tasks] sampler='mypkg:S' (env 'a'): sample(4)"); `bound` names the setting of
    `timeout_s` (None: no bound, progress lines and the stop request still apply); `progress()` adds what the
    call has done so far to a progress line."""
    if worker is None:  # a thread for this call alone, ended when it returns (one left idle per call, never
        # joined, was the main job's ~14 threads a warm-start step: 7,000 by its end)
        job = _Job(call)
        threading.Thread(target=job.run, name="quaero-user-call", daemon=True).start()
    else:
        job = worker.submit(call)
    progress_s = PROGRESS_S if progress_s is None else progress_s
    start = time.monotonic()
    said, stop_seen = start, None
    while not job.done.wait(POLL_S):
        now = time.monotonic()
        if timeout_s is not None and now - start >= timeout_s:
            if worker is not None:
                worker.stuck = True
            raise CallTimeout(f"{what} did not return within {timeout_s:g}s ({bound}); fix the code it runs "
                              "(it must not block) or raise the bound")
        if STOP_REQUESTED.is_set():
            stop_seen = stop_seen or now
            if now - stop_seen >= grace_s:
                if worker is not None:
                    worker.stuck = True
                log.warning(names.USER_CALL_STOPPED_EVENT, call=what, waited_s=round(now - start, 1),
                            note=f"a stop request came and the call had not returned {grace_s:g}s later "
                            "([sampler] stop_grace_s); the run stops at its last completed step")
                raise StoppedInCall(what)
        if now - said >= progress_s:
            said = now
            log.info(names.USER_CALL_WAITING_EVENT, call=what, elapsed_s=round(now - start, 1),
                     bound_s=timeout_s, **(progress() if progress is not None else {}))
    if job.error is not None:
        if not isinstance(job.error, Exception):  # a Ctrl-C's signal comes to this thread, never to that one
            said = f"{type(job.error).__name__}({str(job.error)[:100]})"
            raise UserCallExited(f"{what} raised {said}: a user's call may not exit the run; raise an "
                                 "exception instead") from job.error
        raise job.error
    return job.value
