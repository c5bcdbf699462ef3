"""Episode driver: reset -> render -> sample -> parse -> step -> capture -> bridge, per turn, for groups.

Every turn samples on the normal full chat render (what message-based evaluation sees). Right after
`step` returns, its messages, the terminal step's included, are bridged onto the exact prompt + sampled
ids, so no env response is ever lost. Episodes run concurrently, one per env session; each turn, the
prompts of all running episodes go to the sampler as one batch, and env steps run in threads.
Exactness is counted in `ExactnessAudit`; `strict` turns any mismatch into an error.
"""
from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from quaero.render import BridgeFailure, RenderAdapter
from quaero.rows import EchoRow, Transition, build_rows, per_transition_tokens
from quaero.sampling import Completion, Sampler

Policy = Callable[[dict], Callable[[list[dict]], dict]]


def _episode_dropped() -> type[BaseException]:
    """The env layer's EpisodeDropped (retries exhausted); imported late so rollout stays light."""
    try:
        from quaero.openenv_client import EpisodeDropped
    except ImportError:  # env layer absent: nothing can raise it
        class EpisodeDropped(Exception):  # type: ignore[no-redef]
            pass
    return EpisodeDropped


class ExactnessError(RuntimeError):
    """An exactness mismatch under `[training] strict = true`."""


def token_identity_errors(rows: list[EchoRow], transitions: list[Transition]) -> list[str]:
    """Where a row's prompt + action tokens differ from what the sampler was given and returned."""
    by_turn = {s.turn: (row, s) for row in rows for s in row.spans if s.kind == "action"}
    errors = []
    for t in transitions:
        if not t.action_ids:
            continue
        row, span = by_turn.get(t.turn, (None, None))
        if row is None:
            errors.append(f"turn {t.turn}: no row holds its action")
        elif row.input_ids[:span.start] != t.prompt_ids or row.input_ids[span.start:span.end] != t.action_ids:
            errors.append(f"turn {t.turn}: row prompt/action ids differ from the sampled ones")
        elif row.sampler_logprobs[span.start:span.end] != list(t.action_logprobs):
            errors.append(f"turn {t.turn}: row sampler log-probs differ from the sampler's")
    return errors


class ExactnessAudit:
    """Counters of the exactness invariants, read (and reset) once per training step.

    prefix_mismatches must stay 0: a bridge that altered a sampled/prompt token. bridge_fallbacks
    (with reasons) are turns whose env response could not be appended exactly; they train as action-only.
    packing_breaks: turns whose full-render prompt did not extend the row (a new row was started).
    """

    def __init__(self, strict: bool = False):
        self.strict = strict
        self._lock = threading.Lock()
        self._c: Counter = Counter()
        self._gap_sum = 0.0
        self._gap_max = 0.0

    def add(self, name: str, k: float = 1) -> None:
        with self._lock:
            self._c[name] += k

    def bridge_failed(self, failure: BridgeFailure) -> None:
        if failure.reason == "prefix_mismatch":
            self.add("prefix_mismatches")
        self.add("bridge_fallbacks")
        self.add(f"bridge_fallback_reason_{failure.reason}")
        if self.strict:
            raise ExactnessError(f"strict exactness: bridge failed ({failure}); set [training] strict=false "
                                 "to count it and train the action only") from failure

    def record_rows(self, rows: list[EchoRow], transitions: list[Transition]) -> None:
        """Count the layout and check invariant 1 on the built rows: each turn's prompt and sampled ids
        (and sampler log-probs) sit in its row exactly as the sampler saw and returned them."""
        bad = token_identity_errors(rows, transitions)
        if bad:
            self.add("prefix_mismatches", len(bad))
            if self.strict:
                raise ExactnessError(f"strict exactness: {bad[0]}")
        self.add("rows_packed", sum(1 for r in rows if r.meta.get("layout") == "packed"))
        self.add("rows_transition", sum(1 for r in rows if r.meta.get("layout") != "packed"))
        self.add("packing_breaks", max(len(rows) - 1, 0))
        self.add("trained_tokens", sum(len(r) for r in rows))
        self.add("trained_tokens_per_transition_layout", per_transition_tokens(transitions))
        self.add("action_tokens", sum(r.num_action_tokens for r in rows))
        self.add("echo_tokens", sum(r.num_echo_tokens for r in rows))

    def record_logprob_gap(self, rows: list[EchoRow], trainer_logprobs: list[list[float]]) -> dict:
        """Sampler-vs-trainer log-prob gap on action tokens. `trainer_logprobs[i]` is aligned to row i's
        tokens (len L, entry j scores token j) or shifted (len L-1, entry j scores token j + 1)."""
        gaps = []
        for row, lps in zip(rows, trainer_logprobs):
            lps = list(lps)
            if len(lps) == len(row) - 1:
                lps = [0.0] + lps
            if len(lps) != len(row):
                raise ValueError(f"trainer log-probs have {len(lps)} entries for a {len(row)}-token row")
            gaps += [abs(lps[j] - row.sampler_logprobs[j]) for j, m in enumerate(row.action_mask) if m]
        with self._lock:
            self._c["logprob_gap_tokens"] += len(gaps)
            self._gap_sum += sum(gaps)
            self._gap_max = max([self._gap_max, *gaps])
        return {"mean": sum(gaps) / len(gaps) if gaps else 0.0, "max": max(gaps, default=0.0)}

    def snapshot_and_reset(self) -> dict:
        with self._lock:
            out = {k: 0 for k in ("episodes", "episodes_dropped", "turns", "env_responses", "terminal_responses",
                                  "bridge_fallbacks", "prefix_mismatches", "packing_breaks", "rows_packed",
                                  "rows_transition", "trained_tokens", "trained_tokens_per_transition_layout",
                                  "env_responses_captured", "truncated_completions", "malformed_actions", "action_tokens", "echo_tokens")}
            out.update(self._c)
            n = out.pop("logprob_gap_tokens", 0)
            out["logprob_gap_mean"] = self._gap_sum / n if n else 0.0
            out["logprob_gap_max"] = self._gap_max
            out["trained_tokens_per_episode"] = out["trained_tokens"] / out["episodes"] if out["episodes"] else 0.0
            self._c.clear()
            self._gap_sum = self._gap_max = 0.0
        return out


@dataclass
class Episode:
    rows: list[EchoRow]
    reward: float
    success: bool
    turns: int
    info: dict
    messages: list[dict]
    dropped: bool = False
    drop_reason: str = ""
    transitions: list[Transition] = field(default_factory=list)


@dataclass
class _Live:
    """One running episode bound to one env session."""

    task_index: int
    env: object
    task: dict
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    info: dict = field(default_factory=dict)
    act: Callable[[list[dict]], dict] | None = None
    transitions: list[Transition] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    done: bool = False
    dropped: str = ""


class EpisodeDriver:
    def __init__(self, render: RenderAdapter, sampler: Sampler, cfg, audit: ExactnessAudit):
        self.render = render
        self.sampler = sampler
        self.cfg = cfg
        self.audit = audit
        self._seed = cfg.run.seed
        self._sample_calls = 0

    def run(self, envs: list, tasks: list[dict], *, group_size: int, greedy: bool = False,
            policy: Policy | None = None, seed: int | None = None,
            on_group_done: Callable[[int, int], None] | None = None) -> list[list[Episode]]:
        """G episodes per task, one group per task (in task order). Dropped episodes are marked, not trained.

        seed: the sampler seeds of this call derive from it alone (a resumed run replays a step exactly);
        None continues the driver's own sequence from `cfg.run.seed`. on_group_done(done, total) is called
        each time a task's whole group has finished (progress for long rollouts)."""
        if seed is not None:
            self._seed, self._sample_calls = seed, 0
        pending = deque((ti, g) for ti in range(len(tasks)) for g in range(group_size))
        free = list(envs)
        live: list[_Live] = []
        finished: dict[tuple[int, int], Episode] = {}
        order: dict[int, tuple[int, int]] = {}
        groups_done = 0
        with ThreadPoolExecutor(max_workers=max(len(envs), 1)) as pool:
            while pending or live:
                starting = []
                while pending and free:
                    key = pending.popleft()
                    ep = _Live(key[0], free.pop(0), tasks[key[0]])
                    order[id(ep)] = key
                    starting.append(ep)
                list(pool.map(lambda ep: self._reset(ep, policy), starting))
                live += starting
                running = [ep for ep in live if not ep.done]
                if running:
                    prompts = [self.render.prompt_ids(ep.messages, ep.tools) for ep in running]
                    actions = self._act(running, prompts, greedy)
                    assistants = [self.render.parse(c.token_ids) for c in actions]
                    # env steps run concurrently (servers, tools); tokenizer work stays on this thread
                    steps = list(pool.map(self._env_step, running, assistants))
                    for args in zip(running, prompts, actions, assistants, steps):
                        self._capture(*args)
                for ep in [ep for ep in live if ep.done]:
                    live.remove(ep)
                    free.append(ep.env)
                    finished[order[id(ep)]] = self._finish(ep)
                    task = order[id(ep)][0]
                    if all((task, g) in finished for g in range(group_size)):
                        groups_done += 1
                        if on_group_done is not None:
                            on_group_done(groups_done, len(tasks))
        return [[finished[(ti, g)] for g in range(group_size)] for ti in range(len(tasks))]

    # ── one episode's lifecycle ──────────────────────────────────────────────────────────────────

    def _reset(self, ep: _Live, policy: Policy | None) -> None:
        try:
            r = ep.env.reset(seed=ep.task.get("seed"), split=ep.task.get("split"), index=ep.task.get("index"))
        except _episode_dropped() as e:
            ep.done, ep.dropped = True, f"reset: {getattr(e, 'reason', e)}"
            return
        ep.messages, ep.info = list(r.messages), dict(r.info)
        ep.tools = getattr(ep.env, "tools", None)
        ep.act = policy(ep.info) if policy is not None else None

    def _act(self, running: list[_Live], prompts: list[list[int]], greedy: bool) -> list[Completion]:
        scripted = [ep.act is not None for ep in running]
        out: list[Completion | None] = [None] * len(running)
        for i, ep in enumerate(running):
            if ep.act is not None:  # scripted policy: the ids a model would have sampled, log-prob 0
                ids = self.render.encode_assistant(ep.messages, ep.tools, ep.act(list(ep.messages)))
                out[i] = Completion(ids, [0.0] * len(ids), "stop")
        sampled = [i for i, s in enumerate(scripted) if not s]
        if sampled:
            seed = self._seed * 100_003 + self._sample_calls
            self._sample_calls += 1
            comps = self.sampler.generate([prompts[i] for i in sampled], n=1, greedy=greedy, seed=seed)
            for i, c in zip(sampled, comps):
                out[i] = c[0]
        return out  # type: ignore[return-value]

    def _env_step(self, ep: _Live, assistant: dict):
        try:
            return ep.env.step(assistant)
        except _episode_dropped() as e:
            ep.done, ep.dropped = True, f"step {len(ep.transitions)}: {getattr(e, 'reason', e)}"
            return None

    def _capture(self, ep: _Live, prompt: list[int], comp: Completion, assistant: dict, res) -> None:
        """Bridge this step's env response (the terminal one included) onto the exact prompt + sampled ids."""
        if res is None:  # dropped
            return
        turn = len(ep.transitions)
        if comp.finish_reason != "stop":
            self.audit.add("truncated_completions")  # still parsed and stepped: the env judges it
        response, kinds = [], []
        if res.messages:
            self.audit.add("env_responses")
            self.audit.add("terminal_responses", int(res.done))
            try:
                b = self.render.bridge(prompt, comp.token_ids, res.messages, ep.tools,
                                       content_kind="corrective" if res.malformed else "env")
                response, kinds = b.response_ids, b.response_kinds
                self.audit.add("env_responses_captured")
            except BridgeFailure as f:
                self.audit.bridge_failed(f)  # falls back to an action-only transition
        ep.transitions.append(Transition(turn, prompt, list(comp.token_ids), list(comp.logprobs), response, kinds,
                                         comp.finish_reason))
        self.audit.add("turns")
        self.audit.add("malformed_actions", int(res.malformed))
        ep.messages += [assistant, *res.messages]
        ep.reward += float(res.reward)
        if res.done:
            ep.success = bool(res.info.get("success", res.reward > 0))
        ep.info.update({k: v for k, v in res.info.items() if k not in ("success",)})
        ep.done = res.done or len(ep.transitions) >= self.cfg.env.max_turns

    def _finish(self, ep: _Live) -> Episode:
        self.audit.add("episodes")
        if ep.dropped:
            self.audit.add("episodes_dropped")
            return Episode([], 0.0, False, len(ep.transitions), ep.info, ep.messages, True, ep.dropped,
                           ep.transitions)
        rows = build_rows(ep.transitions, packing=self.cfg.training.packing,
                          include_scaffold=self.cfg.echo.include_scaffold)
        self.audit.record_rows(rows, ep.transitions)
        info = {**ep.info, "trained_tokens": sum(len(r) for r in rows),
                "trained_tokens_per_transition_layout": per_transition_tokens(ep.transitions)}
        return Episode(rows, ep.reward, ep.success, len(ep.transitions), info, ep.messages,
                       transitions=ep.transitions)
