"""Episode driver: reset -> render -> sample -> parse -> step -> capture -> bridge, per turn, for groups.

Every turn samples on the normal full chat render (what message-based evaluation sees). Right after
`step` returns, its messages, the terminal step's included, are bridged onto the exact prompt + sampled
ids, so no env response is ever lost. Episodes run concurrently, one per env session; each turn, the
prompts of all running episodes go to the sampler as one batch, and env steps run in threads.

The driver owns the turn limit (`[env] max_turns`): it judges episodes, so it is where a cut episode
becomes truncated and never a success (quaero/telemetry/counts.py). Everything is counted in one
RolloutCounts; `[rollout] strict` turns any exactness mismatch into an error.

It also owns lengths, so that no row exceeds `[model] max_seq_len`: each env message is cut to
`[env] max_observation_tokens` (`RenderAdapter.bound`, counted as the template sees the text) before it
enters the history, so the prompt and the bridge render the same cut text; a turn starts only when its
prompt leaves room for `[sampler] max_tokens`, else the episode ends truncated (`context_exhausted`); a
scripted action and a bridged env response are cut at the context's end. A transition then fits the
context, and so does every row (a packed row is as long as its last transition).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from quaero.bounded import CallTimeout, bounded_call
from quaero.chat.sandbox import TemplateProblem
from quaero.openenv_client import ChatEnv, EpisodeDropped, EpisodeEndedAtReset
from quaero.rollout.render import BridgeFailure, RenderAdapter, UnparsableAction, UnrenderableTurn
from quaero.rollout.rows import Transition, build_rows, per_transition_tokens, token_identity_errors
from quaero.rows import EchoRow
from quaero.sampling import Completion, Sampler
from quaero.telemetry import names
from quaero.telemetry.counts import RolloutCounts
from quaero.telemetry.proofs import MAX_SAMPLER_LOGPROB
from quaero.telemetry.runlog import get_logger
from trainers.spec import reads

log = get_logger(__name__)

Policy = Callable[[dict], Callable[[list[dict]], dict]]


class ExactnessError(RuntimeError):
    """An exactness mismatch under `[rollout] strict = true`."""


class Recorded(Protocol):
    """Recorded episodes a guide replays (quaero/rollout/traces.py `RecordedActions`)."""

    def action(self, prompt_ids: list[int]) -> list[int] | None: ...


@dataclass(frozen=True)
class GuidePlay:
    """How a guide (the run's `policy`, the env's oracle, `[guidance] mode`) plays: the first `turns`
    turns of each episode (None: every turn; then the sampler plays the rest), its actions marked guided in
    the rows. Each of its calls is bounded by `timeout_s` seconds; a guide that raises or overruns drops its
    episode (drop kinds `guide_failed`, `guide_timeout`), never the run."""

    turns: int | None = None
    timeout_s: float = 60.0
    # recorded episodes replayed instead of a policy (`[guidance] traces`; quaero/rollout/traces.py
    # `RecordedActions`): `action(prompt_ids)` gives the recorded action ids after exactly that prompt, or
    # None (then the member is dropped, `guide_unmatched`)
    recorded: Recorded | None = None


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
    # cut by the turn limit or the context, or marked truncated by the env: never a success
    truncated: bool = False
    drop_kind: str = ""  # why it was dropped, as counted (`episodes_dropped_<kind>`; a guide's: guide_failed)
    malformed: int = 0  # its actions the env judged malformed (no tool call, unparsable): its format


@dataclass
class _Live:
    """One running episode bound to one env session."""

    task_index: int
    env: ChatEnv  # or any object with its reset/step (the tests' toy envs)
    task: dict
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    info: dict = field(default_factory=dict)
    act: Callable[[list[dict]], dict] | None = None
    transitions: list[Transition] = field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    truncated: bool = False
    done: bool = False
    dropped: str = ""
    drop_kind: str = ""
    ended_at_reset: str = ""  # the env's reason when its reset answered done=True: no episode
    malformed: int = 0  # its actions the env judged malformed
    guide: GuidePlay | None = None  # `act` is a guide's: its turns, its bound

    @property
    def scripted(self) -> bool:
        """This turn's action is `act`'s or a recording's (the warm start's oracle; a guide in its turns)."""
        if self.act is None and (self.guide is None or self.guide.recorded is None):
            return False
        return self.guide is None or self.guide.turns is None or len(self.transitions) < self.guide.turns


@dataclass(frozen=True)
class DriverSettings:
    """The settings the driver reads, of one env (a mixture's envs each have their own): its turn limit and
    message budget, the context and completion budgets, how rows are built, strictness and the seed. Each
    field names the config key it reads (`reads`); `quaero.config.settings_of(DriverSettings, view)` builds
    it from a one-env config (a mixture env's view, `QuaeroConfig.views`)."""

    max_turns: int = reads("env.max_turns")
    # [env] max_observation_tokens, else half the context
    observation_token_limit: int = reads("observation_token_limit")
    max_tokens: int = reads("sampler.max_tokens")
    max_seq_len: int = reads("model.max_seq_len")
    packing: bool = reads("rollout.packing", True)
    include_scaffold: bool = reads("echo.include_scaffold", False)
    strict: bool = reads("rollout.strict", False)
    seed: int = reads("run.seed", 0)  # the sampler seeds of a run() without its own
    # a scripted policy's (the oracle's: a warm start's demonstrator, a guide) bound on one call, user code as
    # an env step is (None: unbounded)
    policy_timeout_s: float | None = reads("env.step_timeout_s", None)


class EpisodeDriver:
    def __init__(self, render: RenderAdapter, sampler: Sampler, settings: DriverSettings,
                 counts: RolloutCounts):
        self.render = render
        self.sampler = sampler
        self.settings = settings
        self.counts = counts
        self.strict = settings.strict
        self._seed = settings.seed
        self._sample_calls = 0
        self.reset_end_reason = ""  # the latest reset that answered done=True, in the env's words
        self._reset_end_said = False
        self._truncation_said = False

    def run(self, envs: list, tasks: list[dict], *, group_size: int, greedy: bool = False,
            policy: Policy | None = None, seed: int | None = None,
            on_group_done: Callable[[int, int], None] | None = None, guide: GuidePlay | None = None
            ) -> list[list[Episode]]:
        """G episodes per task, one group per task (in task order). Dropped episodes are marked, not trained.
        `guide`: `policy` is a guide, playing as it says (its actions marked guided); else `policy` scripts
        every turn (the warm start) and None samples every turn.

        seed: the sampler seeds of this call derive from it alone (a resumed run replays a step exactly);
        None continues the driver's own sequence from its settings' seed. on_group_done(done, total) is called
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
                    ep = _Live(key[0], free.pop(0), tasks[key[0]], guide=guide)
                    order[id(ep)] = key
                    starting.append(ep)
                list(pool.map(lambda ep: self._reset(ep, policy), starting))
                for ep in starting:  # tokenizer work stays on this thread
                    ep.messages = self._bounded(ep.messages)
                live += starting
                running = [ep for ep in live if not ep.done]
                prompts = [self._prompt(ep) for ep in running]
                running = [ep for ep, p in zip(running, prompts) if p is not None]
                running, prompts = self._with_room(running, [p for p in prompts if p is not None])
                if running:
                    acted = self._act(running, prompts, greedy)  # None: a failed guide (its episode dropped)
                    kept = [i for i, c in enumerate(acted) if c is not None]
                    running, prompts = [running[i] for i in kept], [prompts[i] for i in kept]
                    actions = [acted[i] for i in kept]
                    assistants = [self._parse(c.token_ids, ep.tools) for ep, c in zip(running, actions)]
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
        except EpisodeDropped as e:
            ep.done, ep.dropped, ep.drop_kind = True, f"reset: {e.reason}", e.kind
            return
        except EpisodeEndedAtReset as e:
            ep.done, ep.ended_at_reset = True, e.reason
            return
        ep.messages, ep.info = list(r.messages), dict(r.info)
        ep.tools = getattr(ep.env, "tools", None)
        if policy is None:
            return
        try:
            ep.act = self._policy_call(ep, lambda: policy(ep.info), "policy(info)")
        except Exception as err:
            if ep.guide is None:
                raise
            self._guide_failed(ep, err)

    def _policy_call(self, ep: _Live, call: Callable[[], object], what: str):
        """A scripted policy's call (`what`), user code, on a thread (quaero/bounded.py) and ended by a stop
        request: the warm start's demonstrator bounded by `[env] step_timeout_s` (past it the run stops,
        named), a guide by `[guidance] timeout_s` (past it its episode is dropped, counted)."""
        if ep.guide is None:
            return bounded_call(call, f"the scripted policy's {what} (the env's oracle)",
                                timeout_s=self.settings.policy_timeout_s, bound="[env] step_timeout_s")
        return bounded_call(call, f"the guide's {what} (the env's oracle)", timeout_s=ep.guide.timeout_s,
                            bound="[guidance] timeout_s")

    def _bounded(self, messages: list[dict]) -> list[dict]:
        """Env messages with every text content cut to `[env] max_observation_tokens` (counted, and said once
        per driver in `observation_truncated`). A formatted observation (FieldText) is cut field by field
        (`_fit_parts`), so the fields after a huge one survive; any other text loses its tail."""
        limit, out = self.settings.observation_token_limit, []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str):
                parts = getattr(content, "parts", ())
                cut, cuts = self.render.bound(content, limit), []
                if cut is not content and len(parts) > 1:
                    lines, cuts = self._fit_parts([line for _, line in parts], limit)
                    cut = self.render.bound("\n".join(lines), limit)  # a merge across lines: the guard
                    cuts = [(parts[i][0], len(parts[i][1]), n) for i, n in cuts]
                elif cut is not content:
                    cuts = [(None, len(content), len(cut))]
                if cut is not content:
                    self.counts.add(names.OBSERVATIONS_TRUNCATED)
                    self._say_truncated(cuts, limit, len(parts))
                    m = {**m, "content": str(cut)}
            out.append(m)
        return out

    def _fit_parts(self, lines: list[str], limit: int) -> tuple[list[str], list[tuple[int, int]]]:
        """`lines` fitted into `limit` tokens together: the lines that fit an even share of what is left are
        kept whole (again with the larger share they leave, until none more fits), the others share the rest,
        each cut with its marker. Returns the lines and (index, characters kept) of each cut one."""
        room = limit - (len(lines) - 1)  # a newline between two lines
        pending = list(range(len(lines)))
        while pending:
            share = max(room // len(pending), 1)
            whole = [i for i in pending if self.render.bound(lines[i], share) is lines[i]]
            if not whole:
                break
            for i in whole:
                room -= self.render.count(lines[i])
                pending.remove(i)
        out, cuts = list(lines), []
        for i in pending:
            out[i] = self.render.bound(lines[i], max(room // len(pending), 1))
            cuts.append((i, len(out[i])))
        return out, cuts

    def _say_truncated(self, cuts: list[tuple[str | None, int, int]], limit: int, fields: int) -> None:
        if self._truncation_said or not cuts:
            return
        self._truncation_said = True
        what = "; ".join(f"{name or 'the message'}: {before:,} -> {after:,} characters"
                         for name, before, after in cuts)
        log.warning(names.OBSERVATION_TRUNCATED_EVENT, limit=limit, cut=what, note=(
            f"an env message exceeded [env] max_observation_tokens={limit}: {what}"
            + (f" (the other of its {fields} fields kept whole)" if fields > 1 else "")
            + "; counted as observations_truncated, said once; raise the bound or leave the field out with a "
              "[env] formatter"))

    def _with_room(self, running: list[_Live], prompts: list[list[int]]) -> tuple[list[_Live],
                                                                                  list[list[int]]]:
        """The episodes whose prompt leaves room for a full completion; the others end truncated, never a
        success: a completion cut by the context rather than by the model is not a turn worth judging."""
        keep = []
        for ep, prompt in zip(running, prompts):
            if len(prompt) + self.settings.max_tokens <= self.settings.max_seq_len:
                keep.append((ep, prompt))
            else:
                ep.done, ep.truncated, ep.success = True, True, False
                self.counts.add(names.CONTEXT_EXHAUSTED)
        return [ep for ep, _ in keep], [p for _, p in keep]

    def _act(self, running: list[_Live], prompts: list[list[int]], greedy: bool) -> list[Completion | None]:
        """Each running episode's action: a scripted one's (`_scripted`), else the sampler's, in one batch;
        None for a guide that failed (its episode dropped)."""
        scripted = [ep.scripted for ep in running]
        out: list[Completion | None] = [None] * len(running)
        for i, ep in enumerate(running):
            if not scripted[i]:
                continue
            if ep.guide is not None and ep.guide.recorded is not None:
                out[i] = self._replayed(ep, prompts[i])
                continue
            try:  # the call bounded on a thread; the tokenizer's work stays on this one
                message = self._policy_call(ep, lambda ep=ep: ep.act(list(ep.messages)), "act(messages)")
            except Exception as err:
                if ep.guide is None:
                    raise
                self._guide_failed(ep, err)
                continue
            try:
                out[i] = self._scripted(ep, prompts[i], message)
            except TemplateProblem as err:  # a demo the template cannot render (two calls on Llama 3.x)
                self._template_raised(ep, err)
            except UnrenderableTurn as err:  # nor as sampled ids (no close token in its render)
                self._template_raised(ep, err, "demo_unrenderable")
        sampled = [i for i, s in enumerate(scripted) if not s]
        if sampled:
            seed = self._seed * 100_003 + self._sample_calls
            self._sample_calls += 1
            comps = self.sampler.generate([prompts[i] for i in sampled], n=1, greedy=greedy, seed=seed)
            for name, n in getattr(self.sampler, "take_counts", dict)().items():  # the hf engine's KV reuse
                self.counts.add(name, n)
            for i, c in zip(sampled, comps):
                out[i] = c[0]
        return out

    def _scripted(self, ep: _Live, prompt: list[int], message: dict) -> Completion:
        """A scripted policy's action `message`: the ids a model would have sampled, log-prob 0, cut where a
        sampler would have stopped; reasoning a thinking-off template renders nowhere there is left out."""
        try:
            ids = self.render.encode_assistant(ep.messages, ep.tools, message)
        except UnrenderableTurn:  # the generation prompt closes an empty think block: the demo's calls kept
            if not message.get("reasoning_content"):
                raise
            ids = self.render.encode_assistant(ep.messages, ep.tools, {**message, "reasoning_content": None})
            self.counts.add(names.DEMO_REASONING_DROPPED)
        return self._unsampled(prompt, ids)

    def _unsampled(self, prompt: list[int], ids: list[int]) -> Completion:
        """Action ids no sampler chose (a scripted policy's, a recording's): log-prob 0, cut where a sampler
        would have stopped at the context's end."""
        room = self.settings.max_seq_len - len(prompt)
        return Completion(ids[:room], [0.0] * len(ids[:room]), "stop" if len(ids) <= room else "length")

    def _replayed(self, ep: _Live, prompt: list[int]) -> Completion | None:
        """A recorded guide's action: the recorded ids after exactly `prompt`, verbatim (log-prob 0: never
        sampled); None where no recording reached this prompt (its episode dropped, `guide_unmatched`)."""
        ids = ep.guide.recorded.action(prompt)
        if ids is None:
            ep.done, ep.drop_kind = True, "guide_unmatched"
            ep.dropped = (f"step {len(ep.transitions)}: no recorded action follows this prompt "
                          f"({len(prompt)} tokens): the task was not recorded, or the env answered "
                          "otherwise than in the recording")
            return None
        return self._unsampled(prompt, ids)

    def _prompt(self, ep: _Live) -> list[int] | None:
        """The episode's next sampling prompt; None where the chat template raises on its conversation."""
        try:
            return self.render.prompt_ids(ep.messages, ep.tools)
        except TemplateProblem as err:
            self._template_raised(ep, err)
            return None

    def _template_raised(self, ep: _Live, err: Exception, kind: str = "template_raised") -> None:
        """A chat template (quaero/chat/template.py) that raises on this episode's conversation: nothing of
        it can be rendered exactly, so the episode is dropped (kind `template_raised`; `demo_unrenderable`: a
        scripted reply it cannot render as sampled ids), never the run."""
        ep.done, ep.drop_kind = True, kind
        ep.dropped = f"step {len(ep.transitions)}: {err}"[:300]

    def _guide_failed(self, ep: _Live, err: Exception) -> None:
        kind = "guide_timeout" if isinstance(err, CallTimeout) else "guide_failed"
        reason = f"step {len(ep.transitions)}: {type(err).__name__}: {err}"[:300]
        ep.done, ep.dropped, ep.drop_kind = True, reason, kind

    def _parse(self, ids: list[int], tools: list[dict] | None) -> dict:
        """The assistant message of sampled ids; a reply the renderer's parser raises on is counted
        (`unparsable_actions`) and goes to the env as text without a tool call: a malformed action with its
        corrective message, never the end of a run."""
        try:
            return self.render.parse(ids, tools)
        except UnparsableAction as e:
            self.counts.add(names.UNPARSABLE_ACTIONS)
            log.warning(names.UNPARSABLE_ACTION_EVENT, error=str(e)[:200])
            return e.message

    def _env_step(self, ep: _Live, assistant: dict):
        try:
            return ep.env.step(assistant)
        except EpisodeDropped as e:
            ep.done, ep.dropped, ep.drop_kind = True, f"step {len(ep.transitions)}: {e.reason}", e.kind
            return None

    def _capture(self, ep: _Live, prompt: list[int], comp: Completion, assistant: dict, res) -> None:
        """Bridge this step's env response (the terminal one included) onto the exact prompt + sampled ids."""
        if res is None:  # dropped
            return
        turn = len(ep.transitions)
        impossible = [lp for lp in comp.logprobs if not (math.isfinite(lp) and lp <= MAX_SAMPLER_LOGPROB)]
        if impossible:  # a sampler (a foreign server, a broken kernel) whose ratios would train on noise
            ep.done, ep.dropped, ep.drop_kind = True, (f"step {turn}: sampler log-prob {impossible[0]} is "
                                                       f"impossible (log p <= 0)"), "impossible_logprobs"
            return
        if comp.finish_reason != "stop":
            self.counts.add(names.TRUNCATED_COMPLETIONS)  # still parsed and stepped: the env judges it
        response, kinds = [], []
        messages = self._bounded(res.messages)
        if messages:
            self.counts.add(names.ENV_RESPONSES)
            self.counts.add(names.TERMINAL_RESPONSES, int(res.done))
            try:
                b = self.render.bridge(prompt, comp.token_ids, messages, ep.tools,
                                       content_kind="corrective" if res.malformed else "env")
                room = max(self.settings.max_seq_len - len(prompt) - len(comp.token_ids), 0)
                if len(b.response_ids) > room:  # the tail past the context is lost; the tokens kept are exact
                    self.counts.add(names.ENV_RESPONSES_CLIPPED)
                response, kinds = b.response_ids[:room], b.response_kinds[:room]
                self.counts.add(names.ENV_RESPONSES_CAPTURED)
            except BridgeFailure as f:
                self.counts.bridge_fallback(f.reason)  # falls back to an action-only transition
                if self.strict:
                    raise ExactnessError(f"strict exactness: bridge failed ({f}); set [rollout] "
                                         "strict=false to count it and train the action only") from f
        guided = ep.guide is not None and ep.scripted
        ep.transitions.append(Transition(turn, prompt, list(comp.token_ids), list(comp.logprobs), response,
                                         kinds, comp.finish_reason, guided))
        self.counts.add(names.TURNS)
        self.counts.add(names.MALFORMED_ACTIONS, int(res.malformed))
        ep.malformed += int(res.malformed)
        ep.messages += [assistant, *messages]
        ep.reward += float(res.reward)
        if not math.isfinite(ep.reward):  # finite rewards (check_reply) that overflow when summed
            ep.done, ep.dropped, ep.drop_kind = (
                True,
                f"step {turn}: reward sum {ep.reward} is not finite",
                "nonfinite_reward",
            )
            return
        at_limit = not res.done and len(ep.transitions) >= self.settings.max_turns
        ep.truncated = at_limit or bool(res.info.get("truncated"))
        if res.done and not ep.truncated:
            ep.success = bool(res.info["success"]) if "success" in res.info else res.reward > 0
        ep.info.update({k: v for k, v in res.info.items() if k not in ("success",)})
        ep.done = res.done or at_limit

    def _finish(self, ep: _Live) -> Episode:
        if ep.ended_at_reset:  # not an episode: counted apart, marked dropped so nothing trains or scores it
            self.counts.add(names.EPISODES_ENDED_AT_RESET)
            self.reset_end_reason = ep.ended_at_reset
            if not self._reset_end_said:  # once per driver: every reset of a broken env says the same
                self._reset_end_said = True
                log.warning(names.ENV_RESET_ENDED_EVENT, task=ep.task, reason=ep.ended_at_reset,
                            note="the env's reset answered done=True: no episode to play (never sampled or "
                                 "trained; counted as episodes_ended_at_reset)")
            return Episode([], 0.0, False, 0, ep.info, [], True, f"ended at reset: {ep.ended_at_reset}")
        if ep.dropped:
            self.counts.episode_dropped(ep.drop_kind)
            return Episode([], 0.0, False, len(ep.transitions), ep.info, ep.messages, True, ep.dropped,
                           ep.transitions, drop_kind=ep.drop_kind, malformed=ep.malformed)
        rows = build_rows(ep.transitions, packing=self.settings.packing,
                          include_scaffold=self.settings.include_scaffold,
                          max_seq_len=self.settings.max_seq_len)
        bad = token_identity_errors(rows, ep.transitions)  # invariant 1 on the built rows
        if bad:
            self.counts.add(names.PREFIX_MISMATCHES, len(bad))
            if self.strict:
                raise ExactnessError(f"strict exactness: {bad[0]}")
        row_tokens, flat_tokens = sum(len(r) for r in rows), per_transition_tokens(ep.transitions)
        packed = sum(1 for r in rows if r.meta.get("layout") == "packed")
        for row in rows[1:]:  # each new row's reason (quaero/rollout/rows.py split_reason)
            self.counts.add(names.PACKING_BREAK_REASON + row.meta["split"])
        self.counts.rows_built(packed=packed, transition=len(rows) - packed, row_tokens=row_tokens,
                              per_transition_tokens=flat_tokens,
                              action_tokens=sum(r.num_action_tokens for r in rows),
                              echo_tokens=sum(r.num_echo_tokens for r in rows))
        self.counts.episode_finished(reward=ep.reward, success=ep.success, truncated=ep.truncated,
                                    turns=len(ep.transitions))
        info = {**ep.info, "trained_tokens": row_tokens, "trained_tokens_per_transition_layout": flat_tokens}
        return Episode(rows, ep.reward, ep.success, len(ep.transitions), info, ep.messages,
                       transitions=ep.transitions, truncated=ep.truncated, malformed=ep.malformed)
