"""When a run stops before its last step, and how: a stop request (Ctrl-C, SIGTERM), steps that train
nothing (`[training] max_empty_steps`), an env that lost episodes (`[training] on_env_loss = "stop"`) and the
RL token budget (`[training] rl_token_budget`). Each rule says why in one line naming the option that set it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from quaero.bounded import STOP_REQUESTED
from quaero.telemetry import names
from quaero.telemetry.counts import drop_reasons
from quaero.telemetry.runlog import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    from quaero.config import QuaeroConfig
    from quaero.recipe.groups import GroupOutcome
    from quaero.rollout.driver import EpisodeDriver

log = get_logger(__name__)


class EmptyRunError(RuntimeError):
    """`[training] max_empty_steps` consecutive steps trained no row."""


class EnvLostError(RuntimeError):
    """An env lost episodes under `[training] on_env_loss = "stop"`."""


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
        log.warning(names.STOP_REQUESTED_EVENT, signal=signal.Signals(signum).name,
                    note="finishing this step, then checkpointing; a second Ctrl-C or SIGTERM aborts")

    def __exit__(self, *exc) -> None:
        import signal

        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        STOP_REQUESTED.clear()


def interruptible(fn: Callable[[], Any]) -> Any:
    """`fn()` (a checkpoint write) on a worker thread while the main thread waits for it: a signal's handler
    runs at once, so a second Ctrl-C or SIGTERM aborts now rather than after a long call into C (safetensors'
    write) returns. An aborted write leaves a temporary folder the next start removes. Off the main thread
    (no handler there), `fn()` itself."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - raised on the main thread below
            box["error"] = e

    worker = threading.Thread(target=run, name="quaero-checkpoint-write", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)  # a signal's handler runs here; a second stop raises KeyboardInterrupt
    if "error" in box:
        raise box["error"]
    return box["out"]


def check_env_loss(cfg: QuaeroConfig, groups: list[GroupOutcome], step: int) -> None:
    """Under `[training] on_env_loss = "stop"`: an RL step whose env lost episodes (in its `groups`: a dead
    server, timeouts past the retries) ends the run before it trains (the last checkpoint stays the resume
    point), naming the env."""
    lost: dict[str, int] = {}
    for g in groups:
        if g.dropped:
            lost[g.env] = lost.get(g.env, 0) + g.dropped
    if not lost or cfg.training.on_env_loss != "stop":
        return
    why = (f"step {step}: " + ", ".join(f"env {name!r} lost {n} episode(s)" for name, n in lost.items())
           + " ([training] on_env_loss='stop'); the step was not trained; its env_episode_dropped events in "
           f"{cfg.run_dir / names.EVENTS} say why; resume once the env is back, or set on_env_loss = "
           "'continue'")
    log.error(names.RUN_END_EVENT, status="failed", steps=step - 1, error=why)
    raise EnvLostError(why)


@dataclass
class EmptySteps:
    """The consecutive steps that trained no row (`[training] max_empty_steps`), with their drop reasons
    counted, their episodes that ended with no room left for a turn and their groups left out for a non-finite
    advantage."""

    steps: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    exhausted: int = 0
    nonfinite: int = 0

    def after(self, cfg: QuaeroConfig, drivers: dict[str, EpisodeDriver], step: int, m: dict[str, Any]
              ) -> str | None:
        """Count step `step` (its metrics `m`); why the run stops, when it does: after `max_empty_steps` steps
        without a trained row, or at once when every reset answered done=True (the env has no episode to
        give; `drivers`: each env's, by name, which kept the reason the env said)."""
        if m.get(names.EPISODES_ENDED_AT_RESET) and not m.get(names.EPISODES):
            reasons = [(name, d.reset_end_reason) for name, d in drivers.items() if d.reset_end_reason]
            said = ("; ".join(why if len(drivers) == 1 else f"{name}: {why}" for name, why in reasons)
                    or "nothing")
            ended = m[names.EPISODES_ENDED_AT_RESET]
            return (f"step {step}: every reset ({ended}) answered done=True, so there is no episode to play; "
                    f"the env said: {said.rstrip('.')}; fix what the env needs (a key, a sandbox, a dataset)")
        if m[names.ROWS]:
            self.steps, self.drops, self.exhausted, self.nonfinite = 0, {}, 0, 0
            return None
        self.steps += 1
        for kind, n in drop_reasons(m).items():
            self.drops[kind] = self.drops.get(kind, 0) + n
        self.exhausted += m.get(names.CONTEXT_EXHAUSTED, 0)
        self.nonfinite += m.get(names.GROUPS_NONFINITE_ADVANTAGE, 0)
        limit = cfg.training.max_empty_steps
        if self.steps < limit:
            return None
        steps = f"steps {step - limit + 1}-{step}" if limit > 1 else f"step {step}"
        return (f"{steps} trained no row ([training] max_empty_steps={limit}); "
                + why_no_rows(cfg, self.drops, self.exhausted, self.nonfinite))


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


def nothing_trained(cfg: QuaeroConfig, totals: dict[str, Any], steps: int) -> str | None:
    """Why a run of `steps` steps (fewer than `max_empty_steps`, every one empty) stops without a model to
    hand over (`totals`: its cumulative metrics); None when it trained a row."""
    if not steps or totals.get(names.ROWS):
        return None
    return f"the run's {steps} step(s) trained no row; " + why_no_rows(
        cfg, drop_reasons(totals), totals.get(names.CONTEXT_EXHAUSTED, 0),
        totals.get(names.GROUPS_NONFINITE_ADVANTAGE, 0))


def budget_spent(cfg: QuaeroConfig, totals: dict[str, Any], step: int) -> bool:
    """Whether RL step `step` spent `[training] rl_token_budget` (`totals`: the run's cumulative metrics, its
    generated tokens so far)."""
    budget = cfg.training.rl_token_budget
    return (budget is not None and step > cfg.training.warmup_sft_steps
            and totals.get(names.GENERATED_TOKENS, 0) >= budget)
