"""ChatEnv: one env session seen as a chat. reset -> the opening messages; step(assistant message) ->
the messages to append, the reward and done. Faults are retried here, so the episode driver only
ever sees ChatReset/ChatStep or EpisodeDropped.

A lost session (timeout, server death, dropped socket, server error) cannot resume: the retry opens
a new session and, by default, replays the episode's accepted actions from the same reset, checking
that every replayed observation equals the recorded one (`[env] on_session_loss = "replay"`); an env
that is not deterministic should use "drop", which drops the episode at the first loss. An env whose reset
takes neither seed nor index cannot be replayed, so it is dropped at the first loss whatever the setting.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

from .mapping import (
    DEFAULT_SYSTEM_PROMPT,
    INSTRUCTION_KEYS,
    Malformed,
    action_instructions,
    chat_text_field,
    chat_turns,
    env_instructions,
    parse_plain_action,
    parse_tool_calls,
    prompt_system,
    render_tool_result,
    reply_instruction,
)
from .transport import ActionRejected, EnvFault, EnvRaised, InvalidReply

if TYPE_CHECKING:
    from quaero.telemetry.counts import RolloutCounts

log = get_logger(__name__)


@dataclass
class ChatReset:
    messages: list[dict]  # [system, user(task)]
    info: dict  # task_id, split, index, seed + the env's reset metadata


@dataclass
class ChatStep:
    messages: list[dict]  # tool messages (MCP), a user message (plain), or ONE corrective user message
    reward: float
    done: bool
    malformed: bool  # messages is quaero's corrective message: never an ECHO target
    info: dict = field(default_factory=dict)


class EpisodeDropped(Exception):
    """Retries exhausted (or the episode could not be replayed): the driver drops the episode.

    kind: a short slug the drop is counted under (`drop_reason_<kind>`): an EnvFault kind (timeout,
    connection, server_error, capacity), recovery_failed, replay_diverged, else env_error. reason: the
    full story, logged."""

    def __init__(self, reason: str, kind: str = "env_error") -> None:
        super().__init__(reason)
        self.reason, self.kind = reason, kind


class ActionRefused(Exception):
    """The env raised the same error on this action twice, the second time on a healthy session
    (`ChatEnv._call`): the action is illegal where the env stands (atari's `Invalid action_id: 7`).
    str(self): the env's message."""


class EpisodeEndedAtReset(Exception):
    """The env's reset answered done=True (a sandbox without its key, a dataset without tasks): no episode to
    play. reason: the env's own words, one line (`reset_end_reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


REASON_KEYS = ("error", "reason", "message", "status", "detail", "info")
MAX_REASON_CHARS = 300


def reset_end_reason(observation: dict, formatter: Callable[..., str]) -> str:
    """Why a reset ended at once, in the env's words, on one line: a text field of its metadata named like a
    reason (`error`, `reason`, `message`, ...), else the observation's own text, else its metadata as JSON."""
    meta = observation.get("metadata") or {}
    text = next((meta[k] for k in REASON_KEYS if isinstance(meta, dict) and isinstance(meta.get(k), str)
                 and meta[k].strip()), "")
    if not text:
        try:
            text = formatter(observation, context="reset")
        except Exception:  # noqa: BLE001 - a formatter that cannot read an ended reset: the metadata says it
            text = ""
    if not text.strip():
        text = json.dumps(meta, ensure_ascii=False, default=str) if meta else "the env gave no reason"
    return one_line(text)


def one_line(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """An env's message on one line (whitespace runs made one space), cut to `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + " …"


class Transport(Protocol):
    def reset(self, kwargs: dict, timeout_s: float) -> dict: ...
    def step(self, action: dict, timeout_s: float) -> dict: ...
    def close(self) -> None: ...


class Connector(Protocol):
    """How sessions of one env are opened: in-process or on an OpenEnv server (pool.py)."""

    def connect(self) -> Transport: ...  # a new session
    def recover(self) -> None: ...  # after a fault: restart what died (local server), if anything


def _reward(payload: dict) -> float:
    """The reward of a reply that passed `check_reply`: a finite number, or 0 when the env gave none
    (null)."""
    value = payload.get("reward")
    return 0.0 if value is None else float(value)


class ResetWitness:
    """Whether two resets of one task (same seed, split and index) gave the same observation, said once each
    way: `env_resets_not_reproducible` the first time they differ (an env that ignores its seed: eval scores
    then compare different tasks, and a replay after a lost session diverges), `env_resets_reproducible` the
    first time they agree where that shows something, and never after a difference was seen. Agreement counts
    only between resets at different places of their env's history (`ordinal`, the env instance's reset
    count): fresh sessions of an env that hands out tasks in order all start on its first one, whatever the
    seed (reasoning_gym without a dataset_name), so a group's sessions agreeing on their first reset prove
    nothing. Evaluation resets its tasks again later, so a run with an eval sees it. Shared by a pool's
    sessions; remembers the first `MAX_TASKS` tasks only."""

    MAX_TASKS = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, int]] = {}
        self._said: set[bool] = set()

    def saw(self, kwargs: dict, observation: dict, ordinal: int = 0) -> None:
        key = json.dumps(kwargs, sort_keys=True, default=str)
        value = json.dumps(observation, sort_keys=True, default=str)
        with self._lock:
            previous = self._seen.get(key)
            if previous is None:
                if len(self._seen) < self.MAX_TASKS:
                    self._seen[key] = (value, ordinal)
                return
            same = previous[0] == value
            if same and (previous[1] == ordinal or False in self._said):
                return  # the same place in a fresh env's history, or a difference already seen
            if same in self._said:
                return
            self._said.add(same)
        if same:
            log.info(names.ENV_RESETS_REPRODUCIBLE_EVENT,
                     task=key, note="two resets of this task, at different points "
                     "of their sessions, gave the same observation")
        else:
            log.warning(names.ENV_RESETS_NOT_REPRODUCIBLE_EVENT, task=key, note=(
                "two resets of this task gave different observations: the env does not seed itself from "
                "seed/split/index (or its reset includes something that changes), so eval scores compare "
                "different tasks and a replay after a lost session diverges; set [env] on_session_loss = "
                "'drop' or pass the env what it seeds from in [env] reset_kwargs"))


class ChatEnv:
    """One session. The turn limit is not enforced here: the episode driver owns it
    (quaero/rollout/driver.py), since what a cut episode means (truncated, never a success) is decided where
    episodes are judged."""

    def __init__(self, cfg, connector: Connector, counts: RolloutCounts, *, tools: list[dict] | None,
                 action_schema: dict | None, formatter: Callable[..., str], replayable: bool = True,
                 witness: ResetWitness | None = None) -> None:
        self.cfg, self.connector, self.counts = cfg, connector, counts
        self.witness = witness  # the pool's: did two resets of one task agree?
        # False: reset takes no seed or index, so a replay is not the same episode
        self.replayable = replayable
        self.tools = tools  # OpenAI-style specs for MCP envs, None for plain envs
        self.action_schema = action_schema  # model-facing Action schema (plain envs)
        self.formatter = formatter
        self._transport: Transport | None = None
        self._resets = 0  # resets of the env behind this session's transport (ResetWitness's ordinal)
        self._reset_kwargs: dict | None = None
        self._history: list[tuple[dict, dict]] = []  # (action, payload) accepted in this episode
        self._task_text = ""  # the reset's system and user text
        self._done = True
        self._opening: dict | None = None  # the reset's payload, which a replay must meet again
        self._rejections: set[str] = set()  # the env's words for rejected actions, logged once each
        self._own_instructions: str | None = None  # the env's instructions the system prompt holds
        self._chat_field: str | None = None  # a chat env's one text field: replies are plain text
        self._chat_seen: list[dict] = []  # a chat env's last `messages` (it may resend its whole history)

    # -- sessions and retries -----------------------------------------------------------------------
    def connect(self) -> None:
        if self._transport is None:
            self._transport = self.connector.connect()

    def _drop_transport(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._resets = 0  # the next transport is a new session: a new env

    def _replays(self) -> bool:
        """Whether a lost session's episode is rebuilt on a new one (else the episode drops at the loss)."""
        return self.cfg.on_session_loss == "replay" and self.replayable

    def _replay(self, transport: Transport) -> None:
        """Rebuild the episode on a fresh session: same reset, same accepted actions, same results. A reset
        that answers otherwise than the recorded one is another episode (dm_control ignores its seed): the
        model's context shows the recorded one, so the episode drops rather than go on from another state."""
        opening = transport.reset(self._reset_kwargs, self.cfg.reset_timeout_s)
        self._resets += 1
        if opening != self._opening:
            raise EpisodeDropped("replay diverged at the reset: the same seed/split/index gave another "
                                 "observation (the env does not seed itself from them); set [env] "
                                 "on_session_loss = 'drop' or pass what it seeds from in [env] reset_kwargs",
                                 "replay_diverged")
        for action, recorded in self._history:
            try:
                payload = transport.step(action, self.cfg.step_timeout_s)
            except EnvRaised as e:  # an action the env took before raises now: not the same episode
                raise EpisodeDropped(f"replay diverged at {action}: the env raised {e.detail!r} where it had "
                                     "answered; set [env] on_session_loss = 'drop'",
                                     "replay_diverged") from None
            self.counts.add(names.ENV_REPLAYED_STEPS)
            if payload != recorded:
                raise EpisodeDropped(f"replay diverged at {action}: the env is not deterministic; "
                                     "set [env] on_session_loss = 'drop'", "replay_diverged")

    def _refused(self, detail: str) -> ActionRefused:
        """The step's action raised the same env error twice on the session that answered: the action's. The
        episode goes on on that session (an env checks an action before it acts on it: atari's action_id,
        dm_control's shape), so an env whose resets do not reproduce keeps its episode too. The env's words
        are logged once per session and message (`env_action_rejected`): an env that rejects every action
        with one message is missing something (a key, a service), which the model cannot fix."""
        self.counts.add(names.ENV_REJECTED_ACTIONS)
        words = one_line(detail)
        if words not in self._rejections:
            self._rejections.add(words)
            log.warning(names.ENV_ACTION_REJECTED_EVENT,
                        message=words, note="the env raised the same error twice on "
                        "this action: answered as an invalid action (malformed_reward); if it answers every "
                        "action so, the env's setup is missing something the model cannot give it")
        return ActionRefused(detail)

    def _call(self, what: str, fn: Callable[[Transport], dict]) -> dict:
        """Run fn on a live session; on a fault reconnect (replaying the episode so far), with
        exponential backoff, up to cfg.max_retries times; then EpisodeDropped. An invalid reply drops
        the episode at once.

        An env error answering a step (EnvRaised: the env's code raised, the server answered) is a fault of
        the session or a property of the action. It is asked once more on the same session, which answered
        and so is healthy, whatever max_retries. The same error again is the action's: ActionRefused, which
        the step answers as an invalid action. Anything else (a different error, a lost connection, a
        timeout) is a fault, retried as above (in replay mode on a fresh session replayed to this point;
        otherwise an env error is asked again on the same session)."""
        lost, raised, failures = False, None, 0
        while True:
            try:
                fresh = self._transport is None
                self.connect()
                if fresh and lost and what == "step":
                    self._replay(self._transport)
                return fn(self._transport)
            except (ActionRejected, EpisodeDropped):
                raise
            except InvalidReply as e:  # the env's answer itself is unusable: asking again gets the same
                self.counts.add(names.ENV_INVALID_REPLIES)
                raise EpisodeDropped(f"{what}: invalid env reply: {e}", "invalid_reply") from None
            except Exception as e:  # noqa: BLE001 - every env/transport failure is a counted fault
                fault = e if isinstance(e, EnvFault) else EnvFault("connection", f"{type(e).__name__}: {e}")
                env_error = what == "step" and isinstance(fault, EnvRaised)
                if env_error and fault.detail == raised:  # the same error for the same action, asked again
                    raise self._refused(fault.detail) from None
                first_error = env_error and raised is None
                raised = fault.detail if env_error else None
                failures += 1
                last = failures > self.cfg.max_retries + int(env_error)  # an env error is always asked again
                if fault.kind == "timeout":
                    self.counts.add(names.ENV_TIMEOUTS)
                # the session answered: ask it again as is (a different error after that is the session's
                # fault, which replay mode retries on a fresh session)
                if env_error and (first_error or not self._replays()) and not last:
                    self.counts.add(names.ENV_RETRIES)
                    log.warning(names.ENV_RETRY_EVENT, what=what, attempt=failures, fault=str(fault))
                    continue
                lost = True
                self._recover(what, fault, env_error)
                if last:
                    raise EpisodeDropped(f"{what} failed {failures} times, last: {fault}",
                                         fault.kind) from None
                self.counts.add(names.ENV_RETRIES)
                log.warning(names.ENV_RETRY_EVENT, what=what, attempt=failures, fault=str(fault))
                if not env_error:  # a server that answered needs no time to come back
                    time.sleep(self.cfg.retry_backoff_s * 2**(failures - 1))

    def _recover(self, what: str, fault: EnvFault, env_error: bool) -> None:
        """After a fault: a fresh session (the connector recovers the env), or EpisodeDropped when none can
        go on with this episode (recovery failed; a lost session under on_session_loss='drop' or not
        replayable)."""
        self._drop_transport()
        try:
            self.connector.recover()
        except Exception as err:  # noqa: BLE001 - e.g. the env server cannot start again
            raise EpisodeDropped(f"{what}: {fault}; recovery failed: {err}", "recovery_failed") from None
        if what == "step" and self.cfg.on_session_loss == "drop" and not env_error:
            raise EpisodeDropped(f"{what}: session lost ({fault}); on_session_loss='drop'",
                                 fault.kind) from None
        if what == "step" and not self.replayable and not env_error:
            raise EpisodeDropped(f"{what}: session lost ({fault}); not replayable: the env's reset "
                                 "takes no seed or index", "not_replayable") from None

    def _dropped(self, e: EpisodeDropped) -> EpisodeDropped:
        """Log the drop where its context is known; the driver, which drops the episode, counts it."""
        self._done = True
        kw = self._reset_kwargs or {}
        log.warning(names.ENV_EPISODE_DROPPED_EVENT, reason=e.reason, kind=e.kind, seed=kw.get("seed"),
                    split=kw.get("split"), index=kw.get("index"))
        return e

    # -- the chat API -------------------------------------------------------------------------------
    def reset(self, seed: int, split: str | None = None, index: int | None = None) -> ChatReset:
        split = split or self.cfg.train_split
        kwargs: dict[str, Any] = {**self.cfg.reset_kwargs, "seed": seed, "split": split}
        if index is not None:
            kwargs["index"] = index
        self._reset_kwargs, self._history, self._done = kwargs, [], False
        try:
            # a fresh session per episode would cost a connect; reusing it is safe since reset rebuilds state
            payload = self._call("reset", lambda t: t.reset(kwargs, self.cfg.reset_timeout_s))
        except EpisodeDropped as e:
            raise self._dropped(e) from None
        self._opening = payload
        self.counts.add(names.ENV_RESETS)
        self._resets += 1
        obs = payload.get("observation", {})
        if self.witness is not None:
            self.witness.saw(kwargs, obs, self._resets)
        if payload.get("done"):  # nothing to play: never sampled, stepped or trained (the driver counts it)
            self._done = True
            raise EpisodeEndedAtReset(reset_end_reason(obs, self.formatter))
        meta = obs.get("metadata") or {}
        info = {"seed": seed, "split": split, "index": index if index is not None else seed, **meta}
        info.setdefault("task_id", f"{split}/{info['index']}")
        system, turns = self._presented(obs, meta)
        messages = [{"role": "system", "content": system}, *turns]
        self._task_text = "\n".join(m["content"] for m in messages)  # what a tool result need not repeat
        return ChatReset(messages=messages, info=info)

    def _presented(self, obs: dict, meta: dict) -> tuple[str, list[dict]]:
        """The reset as the env's author wrote it: the system prompt and the opening turns.

        System prompt, the first there is: `[env] system_prompt`; the reset metadata's `system_prompt` or its
        chat prompt's system message (what `openenv import` writes); the env's own instructions (an
        `instructions` or `system_prompt` field of the observation, else of its metadata); a chat
        observation's system message; else DEFAULT_SYSTEM_PROMPT. A plain env's Action schema follows it,
        unless the observation is a chat and the Action takes one text field as `chat_text_field` reads it
        (korrel's optional `content` beside an optional `tool_calls`): a chat is answered in plain text.
        Turns: a chat observation's (`messages` with roles) as chat turns, the system message the prompt holds
        left out, its other fields as one more user turn; else the formatted observation as one user turn,
        left out when it has no text (an MCP env whose reset carries none: the tools and the system prompt
        are the task)."""
        chat = chat_turns(obs) if self.tools is None else None
        self._own_instructions, self._chat_seen = None, chat or []
        key, own = env_instructions(obs)
        chat_system = next((m["content"] for m in chat or [] if m["role"] == "system"), None)
        system = (self.cfg.system_prompt or meta.get("system_prompt") or prompt_system(meta) or own
                  or chat_system or DEFAULT_SYSTEM_PROMPT)
        if own is not None and system is own and key in obs:  # in the system prompt: not in the user turn too
            self._own_instructions, obs = own, {k: v for k, v in obs.items() if k != key}
        self._chat_field = chat_text_field(self.action_schema or {}) if chat is not None else None
        chosen = system
        if self.tools is None and self.action_schema is not None and self._chat_field is None:
            system += action_instructions(self.action_schema)
        if chat is None:
            text = self.formatter(obs, context="reset")
            return system, [{"role": "user", "content": text}] if text.strip() or self.tools is None else []
        # the system message the prompt holds is not a user turn too, whatever instructions follow it
        turns = [m for m in chat if m["role"] != "system" or m["content"] != chosen]
        turns = [m if m["role"] != "system" else {"role": "user", "content": m["content"]} for m in turns]
        rest = self.formatter({k: v for k, v in obs.items() if k != "messages"}, context="reset")
        return system, turns + ([{"role": "user", "content": rest}] if rest.strip() else [])

    def _observed(self, obs: dict, done: bool) -> list[dict]:
        """A plain env's step observation as the turns that answer the model: a chat observation's new
        messages (the env's own assistant messages, the model's reply, left out), its other fields as one
        more user turn; else the formatted observation, less the instructions the system prompt holds.
        A step that adds nothing ends the episode with no response (nothing for ECHO, no env response
        counted); mid-episode it is an empty user turn, the turn the model's next reply answers."""
        own = self._own_instructions
        if own is not None:
            obs = {k: v for k, v in obs.items() if not (k in INSTRUCTION_KEYS and v == own)}
        chat = chat_turns(obs) if self._chat_seen else None
        if chat is None:
            text = self.formatter(obs, context="step")
            return [{"role": "user", "content": text}] if text.strip() or not done else []
        seen, self._chat_seen = self._chat_seen, chat
        new = chat[len(seen):] if chat[:len(seen)] == seen else chat  # an env that sends its whole history
        new = [m for m in new if m["role"] != "assistant"]
        rest = self.formatter({k: v for k, v in obs.items() if k != "messages"}, context="step")
        turns = [{"role": "user", "content": m["content"]} for m in new]
        turns += [{"role": "user", "content": rest}] if rest.strip() else []
        return turns or ([] if done else [{"role": "user", "content": ""}])

    def step(self, assistant: dict) -> ChatStep:
        if self._reset_kwargs is None or self._done:
            raise RuntimeError("ChatEnv.step called before reset or after the episode ended (done=True)")
        try:
            result = self._step_tools(assistant) if self.tools is not None else self._step_plain(assistant)
        except Malformed as m:  # counted by the driver, which sees ChatStep.malformed
            result = ChatStep([{"role": "user", "content": str(m)}], self.cfg.malformed_reward, False, True,
                              {"malformed_reason": str(m)})
        except EpisodeDropped as e:
            raise self._dropped(e) from None
        self._done = result.done
        return result

    def _send(self, action: dict) -> dict:
        payload = self._call("step", lambda t: t.step(action, self.cfg.step_timeout_s))
        self._history.append((action, payload))
        self.counts.add(names.ENV_STEPS)
        return payload

    def _step_tools(self, assistant: dict) -> ChatStep:
        calls = parse_tool_calls(assistant, self.tools, self.cfg.no_tool_call_message)  # all validated first
        messages, reward, done, metas = [], 0.0, False, []
        for name, arguments in calls:
            try:
                payload = self._send({"type": "call_tool", "tool_name": name, "arguments": arguments})
            except ActionRejected as e:  # schema passed here but the server refused: show the model why
                self.counts.add(names.ENV_REJECTED_CALLS)
                messages.append({"role": "tool", "content": f"Error: invalid call: {e}"})
                continue
            except ActionRefused as e:  # the env raised on this call twice (counted as env_rejected_actions)
                messages.append({"role": "tool", "content": f"Error: {one_line(str(e))}"})
                continue
            obs = payload.get("observation", {})
            if obs.get("error"):
                self.counts.add(names.ENV_TOOL_ERRORS)
            shown = "\n".join([self._task_text, assistant.get("content") or "", json.dumps(arguments)])
            messages.append({"role": "tool", "content": render_tool_result(obs, shown)})
            reward += _reward(payload)
            metas.append(obs.get("metadata") or {})
            if payload.get("done"):
                done = True
                break  # calls after the episode ended are not sent
        info = {"tool_calls": [n for n, _ in calls], **{k: v for m in metas for k, v in m.items()}}
        return ChatStep(messages, reward, done, False, info)

    def _step_plain(self, assistant: dict) -> ChatStep:
        text = assistant.get("content") or ""
        if self._chat_field is not None and text.strip():  # plain text, JSON-looking or not
            action = {self._chat_field: text.strip()}
        else:
            action = parse_plain_action(text, self.action_schema or {})
        try:
            payload = self._send(action)
        except ActionRejected as e:
            raise Malformed(f"Your last message was not a valid action ({e}). "
                            f"{reply_instruction(self.action_schema or {})}") from None
        except ActionRefused as e:  # the right format, but illegal where the env stands: its own words
            raise Malformed(f"The environment rejected your last action: {one_line(str(e))}") from None
        obs = payload.get("observation", {})
        done = bool(payload.get("done"))
        return ChatStep(self._observed(obs, done), _reward(payload), done, False,
                        dict(obs.get("metadata") or {}))

    def close(self) -> None:
        self._drop_transport()
