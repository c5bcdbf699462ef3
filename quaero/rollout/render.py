"""Render adapter over a renderer (`renderers==0.1.7`'s families, or quaero's template renderer: chosen in
quaero/chat/registry.py): sampling prompts, parsing, and the exact bridge.

- The sampling prompt of every turn is the normal full chat render with the generation prompt.
- The environment response is appended to the exact `prompt_ids + action_ids` by the renderer's
  `bridge_to_next_turn`, which never re-tokenizes the prefix. Its result carries no per-token roles
  (0.1.7 returns empty `message_indices`), so content tokens are found counterfactually: re-bridge
  with one message's content swapped for a sentinel; the tokens that change are that message's
  content (boundary tokens that BPE merged with content included). Everything else the bridge
  added is template scaffolding.
- The next turn's generation prompt is stripped from the response: it is not the environment's.
- Text is text: system, user and tool messages, the tool specs and scripted assistant messages are
  defused before they reach the template, and sampled text that spells an added token is parsed
  defused, so a special-token string written by an environment, a tool, a user or a policy never
  becomes a special id (see `defuse`).
- Long text is cut: the episode driver bounds each environment message with `bound` (its tokens as the
  template sees them, defused) before the message enters the history, so the prompt and the bridge
  render the same cut text.
"""
from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from quaero.config import ModelConfig
from quaero.rollout.env_text import added_token_pattern, bound_text, defuse, marker_vocab, probe_markers

# Two sentinels: when real content starts/ends with the same token as one, the other still differs.
_SENTINELS = ("A", "Z")

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # a reasoning block: no call inside it is an action


class UnparsableAction(Exception):
    """The renderer's parser raised on a sampled reply; `.message` is the reply as plain assistant text
    (no tool calls), which the env session answers with its corrective message like any malformed action."""

    def __init__(self, detail: str, message: dict):
        super().__init__(detail)
        self.message = message


def _call_shape_error(calls: list[dict]) -> str:
    """Why a parsed call is no call ("" when all are): a name that is not a string, or arguments neither an
    object nor a string (as the template path rules, quaero/chat/toolformats.py `call`; an empty name stays a
    call, which the env rejects)."""
    for c in calls:
        fn = c["function"] if isinstance(c.get("function"), dict) else {}
        name, arguments = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
            return (f"a call needs a name and an object of arguments, got name {name!r} and arguments "
                    f"{type(arguments).__name__}")
    return ""


def _unencodable(value, where: str = "reply") -> str | None:
    """Where in a parsed reply (`reply.tool_calls[0].function.arguments.x`) a string holds a code point UTF-8
    cannot encode (a lone surrogate), or None when every string encodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple)
             else ())
    for key, item in items:
        bad = (_unencodable(key, f"{where} key") if isinstance(key, str) else None) or _unencodable(
            item, f"{where}[{key}]" if isinstance(key, int) else f"{where}.{key}")
        if bad is not None:
            return bad
    return None


class UnrenderableTurn(ValueError):
    """A scripted assistant message (a demo) that the renderer cannot render as ids a sampler would return
    after the prompt (no close token in its render, or a render that does not extend the generation prompt:
    reasoning given to a template with thinking off, which the driver then renders without it)."""


class BridgeFailure(Exception):
    """The renderer could not append the env response exactly; `.reason` is a short metric label."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass
class Bridged:
    """Tokens the bridge appended after prompt + action, up to (not including) the next generation prompt."""

    response_ids: list[int]
    response_kinds: list[str]  # per token: "scaffold" | "env" | "corrective"


def create_renderer(tokenizer, model_cfg: ModelConfig):
    """(renderer, choice): the renderer `[model] renderer` picks for this tokenizer and model
    (quaero/chat/registry.py), built with `[model] renderer_options`."""
    from quaero.chat import registry
    from quaero.models.load import config_fields

    fields = config_fields(model_cfg.name) or {}
    choice = registry.choose(tokenizer, model_cfg.renderer, fields.get("model_type"))
    return registry.build(tokenizer, choice, model_cfg.options), choice


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _changed_range(full: list[int], other: list[int]) -> tuple[int, int]:
    """[start, stop) of `full` that differs from `other` (common prefix and suffix removed)."""
    start = _common_prefix(full, other)
    limit = min(len(full), len(other)) - start
    suffix = 0
    while suffix < limit and full[-1 - suffix] == other[-1 - suffix]:
        suffix += 1
    return start, len(full) - suffix


# the tool history `RenderAdapter._check_defusing` renders
CHECK_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "probe", "parameters": {
    "type": "object", "properties": {"x": {"type": "string"}}}}}]
CHECK_CALL = {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "probe", "arguments": {"x": "y"}}}]}


class RenderAdapter:
    def __init__(self, tokenizer, model_cfg: ModelConfig):
        self.tokenizer = tokenizer
        self.renderer, self.choice = create_renderer(tokenizer, model_cfg)
        self._added = added_token_pattern(tokenizer)
        self._added_ids = set(marker_vocab(tokenizer).values())
        self.stop_token_ids: list[int] = list(self.renderer.get_stop_token_ids())
        probe = [{"role": "user", "content": "x"}]
        bare = self.renderer.render_ids(probe)
        with_gen = self.renderer.render_ids(probe, add_generation_prompt=True)
        # a template may end a conversation without a generation prompt with eos (Phi-3's): that text is
        # never in a prompt, so the generation prompt is what follows the part the two renders share
        at = _common_prefix(bare, with_gen)
        assert all(t in self.stop_token_ids for t in bare[at:]), \
            "renderer's generation prompt is not an append"
        self.generation_prompt: list[int] = with_gen[at:]
        self._conversation_end = bare[at:]  # what such a template writes after the last turn (Phi-3's eos)
        self._check_defusing()

    def _check_defusing(self) -> None:
        """ValueError when the renderer undoes `defuse`: a template that strips the joiner from content (or
        rewrites it) would make env text that spells `<|im_end|>` chat structure. Probed at construction
        (check, train, eval) with the added-token strings (`probe_markers`) in system, user and tool text, in
        a short and a long history: the render must hold the added ids the same history with plain text
        holds."""
        spelled = " ".join(probe_markers(self.tokenizer))
        if not spelled:
            return
        turns = [m for _ in range(5) for m in ({"role": "user", "content": "x"},
                                              {"role": "assistant", "content": "a"})]
        histories = [[{"role": "system", "content": "x"}, *turns, {"role": "user", "content": "x"}],
                     [{"role": "user", "content": "x"}, CHECK_CALL, {"role": "tool", "content": "x"}]]
        for plain in histories:
            spelt = [m if m["role"] == "assistant" else {**m, "content": spelled} for m in plain]
            try:
                counts = [sum(t in self._added_ids for t in self.renderer.render_ids(self._text(h),
                                                                                     tools=CHECK_TOOLS))
                          for h in (plain, spelt)]
            except Exception:  # noqa: BLE001, S112 - a history the renderer cannot render proves nothing
                continue
            if counts[0] != counts[1]:
                raise ValueError(
                    "the chat template turns message text that spells an added token (e.g. '<|im_end|>', "
                    "which quaero defuses with U+2060 WORD JOINER) into that token: it strips or rewrites "
                    "the content, so an env's text would become chat structure; use a template that renders "
                    "message content as given")

    def bound(self, text: str, max_tokens: int) -> str:
        """`text` cut to `max_tokens` tokens as the template will see it (`bound_text` on defused text)."""
        return bound_text(text, max_tokens, self.tokenizer, self._added)

    def count(self, text: str) -> int:
        """Tokens `text` holds as the template will see it (defused); for short texts (encoded whole)."""
        encode = self.tokenizer.backend_tokenizer.encode
        return len(encode(defuse(text, self._added), add_special_tokens=False).ids)

    def _defused(self, value: Any) -> Any:
        """`value` (a message, tool specs) with every string defused, keys included (tool specs are
        dumped as JSON)."""
        if isinstance(value, str):
            return defuse(value, self._added)
        if isinstance(value, dict):
            return {self._defused(k): self._defused(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._defused(v) for v in value]
        return value

    def _text(self, messages: list[dict]) -> list[dict]:
        """Messages as the template may see them: system, user and tool messages (written by the
        environment, its tools or a user) defused. Assistant messages stay as parsed: they come from
        the model's sampled ids, where an added token is one the model emitted, so rendering it back
        keeps the next prompt an extension of the sampled row."""
        return [m if m.get("role") == "assistant" else self._defused(m) for m in messages]

    def _plain(self, value: Any) -> Any:
        """`value` (a message, tool specs) with every added-token string a plain word (`x`): the text a
        template that renders content as given turns into no added id, defused or not."""
        if isinstance(value, str):
            return self._added.sub("x", value)
        if isinstance(value, dict):
            return {self._plain(k): self._plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._plain(v) for v in value]
        return value

    def _undone(self, ids: list[int], messages: list[dict], tools: list[dict] | None, shown: list[dict],
                specs: list[dict] | None, render) -> str:
        """Which added tokens a render of defused text holds that the same render of plain text does not
        ("" when none): the construction probe (`_check_defusing`) cannot see every condition a template
        may strip the joiner under (past the probe's messages, on a word the env writes), so a render whose
        text was defused is held against `render` of the same messages with each added-token string a
        plain word. Costs a second render only where some text spells an added token."""
        if shown == messages and specs == tools:  # `shown`, `specs`: what was rendered (`_text`, `_defused`)
            return ""
        plain = render([m if m.get("role") == "assistant" else self._plain(m) for m in messages],
                       self._plain(tools) or None)
        got, want = [t for t in ids if t in self._added_ids], [t for t in plain if t in self._added_ids]
        if got == want:
            return ""
        extra = set(Counter(got) - Counter(want)) or set(got)  # the same ids in another order: all named
        return str(sorted(self.tokenizer.convert_ids_to_tokens(t) for t in extra))

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The sampling prompt: the full chat render with the generation prompt. TemplateProblem where the
        template turned text that spells an added token into that token (`_undone`): the episode is
        dropped, nothing of it trains."""
        def render(msgs: list[dict], specs: list[dict] | None) -> list[int]:
            return list(self.renderer.render_ids(msgs, tools=specs, add_generation_prompt=True))

        shown, specs = self._text(messages), self._defused(tools)
        ids = render(shown, specs or None)
        undone = self._undone(ids, messages, tools, shown, specs, render)
        if undone:
            from quaero.chat.sandbox import TemplateProblem

            raise TemplateProblem(f"the chat template turned message text that spells an added token "
                                  f"({undone}) into that token: it strips or rewrites quaero's U+2060 "
                                  "defusing under some condition, so env text would become chat structure; "
                                  "use a template that renders message content as given")
        return ids

    def _spelled_defused(self, ids: list[int]) -> list[int]:
        """`ids` with each run of ordinary tokens whose text spells an added token (the model wrote
        `<`, `|im`, `_start`, `|>`, not the id) re-encoded defused: its text then renders back as text,
        while an added token the model did emit stays that id."""
        out: list[int] = []
        run: list[int] = []
        for t in [*ids, None]:
            if t is not None and t not in self._added_ids:
                run.append(t)
                continue
            text = self.tokenizer.decode(run) if run else ""
            if self._added.search(text):
                out += self.tokenizer.encode(defuse(text, self._added), add_special_tokens=False)
            else:
                out += run
            run = []
            if t is not None:
                out.append(t)
        return out

    def parse(self, completion_ids: list[int], tools: list[dict] | None = None) -> dict:
        """Sampled ids -> the assistant message that goes into the history and to the environment.
        Raises UnparsableAction (carrying the reply as plain text) when the renderer's parser fails.
        Text the model spelled like an added token is defused (`_spelled_defused`), so the next sampling
        prompt holds no special id the model did not sample; the env receives it with the joiner. `tools`
        (the episode's specs) type the arguments where the template writes a string and a number alike."""
        ids = self._spelled_defused(list(completion_ids))
        try:
            content, reasoning, calls = self._parsed(ids, tools)
        except Exception as e:
            # `<tool_call>5</tool_call>` (valid JSON, not an object); any parser error is a malformed reply
            raise self._unparsable(ids, f"{type(e).__name__}: {e}") from e
        calls = [{"type": "function", "function": tc.get("function", tc)} for tc in calls or []]
        message = {"role": "assistant", "content": content or "", "reasoning_content": reasoning or None,
                   "tool_calls": calls or None}
        shape = _call_shape_error(calls)
        if shape:
            # renderers' parser passes any JSON value through as a call's name: rendered into the next prompt,
            # a non-string name raises inside the renderer, so it is a malformed reply, as the template's are
            raise self._unparsable(ids, shape)
        bad = _unencodable(message)
        if bad is not None:
            # valid JSON can spell a lone surrogate (`"\ud800"`): in the history it would make the next
            # prompt's tokenizer call raise, so it is a malformed reply, whichever format parsed it
            raise self._unparsable(ids, f"UnicodeEncodeError: {bad} cannot be encoded as UTF-8")
        return message

    def _unparsable(self, ids: list[int], detail: str) -> UnparsableAction:
        text = self.tokenizer.decode([t for t in ids if t not in self.stop_token_ids])
        return UnparsableAction(detail, {"role": "assistant", "content": text, "reasoning_content": None,
                                         "tool_calls": None})

    def _parsed(self, ids: list[int], tools: list[dict] | None) -> tuple[str | None, str | None, list | None]:
        """(content, reasoning, calls) of a reply by the renderer's parser, where a call written inside the
        reasoning (`<think>` .. `</think>`, or after a `<think>` never closed) is no action: the renderers'
        parsers read calls anywhere in the reply. Where the reply's calls outside its reasoning differ from
        the parser's, they are read from the text after the reasoning alone, the reasoning kept as text."""
        read = (self.renderer.parse_response if not tools or self.choice.name != "template"
                else lambda x: self.renderer.parse_response(x, tools=tools))  # the template's: typed by tools
        stop = next((i for i, t in enumerate(ids) if t in self.stop_token_ids), len(ids))
        text = self.tokenizer.decode(ids[:stop], skip_special_tokens=False)
        if THINK_CLOSE in text:
            reasoning, _, rest = text.partition(THINK_CLOSE)
        elif THINK_OPEN in text:
            rest, _, reasoning = text.partition(THINK_OPEN)
        else:
            parsed = read(ids)
            return parsed.content, parsed.reasoning_content, parsed.tool_calls
        try:
            parsed = read(ids)
        except Exception:  # noqa: BLE001 - a malformed call inside the reasoning: the rest alone decides
            parsed = None
        after = read(self.tokenizer.encode(rest, add_special_tokens=False) + ids[stop:])
        if parsed is not None and len(parsed.tool_calls or []) == len(after.tool_calls or []):
            return parsed.content, parsed.reasoning_content, parsed.tool_calls
        return after.content, reasoning.replace(THINK_OPEN, "").strip() or None, after.tool_calls

    def encode_assistant(self, messages: list[dict], tools: list[dict] | None, assistant: dict) -> list[int]:
        """Token ids a model would have sampled to produce `assistant` after `messages` (scripted policies):
        the rendered assistant turn after the generation prompt, through its close token. The message is
        defused: a scripted policy copies env text (a tool result into an answer), and an `<|im_end|>`
        in it would end the demonstrated turn mid-call."""
        prompt = self.prompt_ids(messages, tools)
        full = list(self.renderer.render_ids(self._text(messages) + [self._defused(assistant)],
                                             tools=self._defused(tools) or None))
        if full[:len(prompt)] == prompt:
            ids = full[len(prompt):]
        else:  # the turn's first tokens merge with the prompt's last (`<think>\n` + `\n</think>`): the ids a
            # model samples after the prompt are its text's own, where the text extends the prompt's
            ids = self._reply_after(prompt, full, assistant.get("reasoning_content"))
        end = self._conversation_end
        ids = ids[:len(ids) - len(end)] if end and ids[len(ids) - len(end):] == end else ids
        closes = [i for i, t in enumerate(ids) if t in self.stop_token_ids]
        if not closes:
            raise UnrenderableTurn("encode_assistant: rendered assistant turn has no close token")
        return ids[:closes[-1] + 1]

    def _reply_after(self, prompt: list[int], full: list[int], reasoning: str | None = None) -> list[int]:
        """The ids of `full`'s text after `prompt`'s, encoded on their own (ValueError: the text of `full`
        does not start with `prompt`'s, so no reply sampled after that prompt renders as this turn).

        A generation prompt that opens a think block the finished turn does not render (DeepSeek R1/V3's
        `<｜Assistant｜><think>\n` before a turn rendered without it; Nemotron 3's `<think>\n` before
        `<think></think>`): the reply closes the block it was given, `reasoning\n</think>\n\n` (empty where
        the demo has none: the canonical empty block), then the turn's text after its own think block. The
        template re-renders such a reply otherwise in the next prompt, so that turn starts a new row
        (`quaero/rollout/rows.py split_reason`): exact, never a guessed render."""
        text = self.tokenizer.decode(full, skip_special_tokens=False)
        head = self.tokenizer.decode(prompt, skip_special_tokens=False)
        base, opened, given = head.rpartition(THINK_OPEN)
        if opened and not given.strip() and text.startswith(base) and not text.startswith(head):
            turn = text[len(base):]
            if turn.startswith(THINK_OPEN):  # the turn's own (empty) block, dropped with its reasoning
                turn = turn.partition(THINK_CLOSE)[2]
            closed = f"{reasoning.strip()}\n" if reasoning and reasoning.strip() else "\n"
            return self.tokenizer.encode(f"{closed}{THINK_CLOSE}\n\n{turn}", add_special_tokens=False)
        if not text.startswith(head):
            turn = text[len(os.path.commonprefix([text, head])):][:60]
            raise UnrenderableTurn(
                "encode_assistant: the assistant turn does not extend the generation prompt: the template "
                f"renders the turn as {turn!r} where the generation prompt ends {head[-30:]!r} (e.g. "
                "reasoning with enable_thinking=false)")
        return self.tokenizer.encode(text[len(head):], add_special_tokens=False)

    def _bridge_ids(self, prompt_ids: list[int], action_ids: list[int], messages: list[dict],
                    tools: list[dict] | None) -> list[int]:
        try:
            out = self.renderer.bridge_to_next_turn(list(prompt_ids), list(action_ids), messages,
                                                    tools=tools or None)
        except Exception as e:  # a renderer bug must not kill a run: counted as a fallback
            raise BridgeFailure("exception", f"{type(e).__name__}: {e}") from e
        if out is None:
            refusal = getattr(self.renderer, "last_refusal", lambda: None)()  # the template renderer says why
            if refusal is not None:
                raise BridgeFailure(refusal.reason, refusal.detail)
            raise BridgeFailure("unsupported", "renderer returned None (no bridge for these messages)")
        ids = list(out.token_ids)
        prefix = len(prompt_ids) + len(action_ids)
        if ids[:prefix] != list(prompt_ids) + list(action_ids):
            raise BridgeFailure("prefix_mismatch", "bridge changed or dropped prompt/action tokens")
        return ids

    def bridge(self, prompt_ids: list[int], action_ids: list[int], messages: list[dict],
               tools: list[dict] | None, *, content_kind: str = "env") -> Bridged:
        """Append `messages` (the env response to this action) to the exact prompt + action ids.

        `content_kind` labels the messages' content tokens: "env" (ECHO target) or "corrective"."""
        start = len(prompt_ids) + len(action_ids)
        shown, specs = self._text(messages), self._defused(tools)
        full = self._bridge_ids(prompt_ids, action_ids, shown, specs)
        def plain_render(msgs: list[dict], plain: list[dict] | None) -> list[int]:
            return self._bridge_ids(prompt_ids, action_ids, msgs, plain)[start:]

        undone = self._undone(full[start:], messages, tools, shown, specs, plain_render)
        if undone:
            raise BridgeFailure("defusing_undone", f"the chat template turned env text that spells {undone} "
                                "into that token")
        messages, tools = shown, specs
        kinds = ["scaffold"] * (len(full) - start)
        for i, msg in enumerate(messages):
            if not isinstance(msg.get("content"), str) or not msg["content"]:
                continue
            lo, hi = len(full), start
            for sentinel in _SENTINELS:
                swapped = [*messages[:i], {**msg, "content": sentinel}, *messages[i + 1:]]
                a, b = _changed_range(full, self._bridge_ids(prompt_ids, action_ids, swapped, tools))
                lo, hi = min(lo, a), max(hi, b)
            if lo < start:
                raise BridgeFailure("attribution", "content change reached into the prefix")
            kinds[lo - start:hi - start] = [content_kind] * (hi - lo)
        end = len(full)
        gen = self.generation_prompt
        if gen and full[-len(gen):] == gen and all(k == "scaffold" for k in kinds[len(kinds) - len(gen):]):
            end -= len(gen)
        return Bridged(full[start:end], kinds[:end - start])
