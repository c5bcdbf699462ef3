"""`TemplateRenderer`: any model's own Jinja chat template behind the `renderers` Renderer protocol.

- render / render_ids: the template's text (`quaero/chat/sandbox.py`: sandboxed, bounded, as transformers
  renders it, the tokenizer's special tokens as variables), tokenized with `encode(add_special_tokens=False)`
  as `apply_chat_template` does. Tool specs go to the template when it reads `tools`; otherwise they and the
  assistant's calls are written as text (`quaero/chat/toolcalls.py`).
- parse_response: the text before the first stop token; `<think>...</think>` read as reasoning where the
  template knows `</think>`; tool calls read in the format the template renders them (chosen at
  construction by a round trip: `quaero/chat/toolformats.py`), or as `<tool_call>` blocks where calls go as
  text.
- get_stop_token_ids: the template's close token (what follows an assistant's content, found by rendering one)
  and the tokenizer's eos.
- bridge_to_next_turn: synthesized from the template. A short history closed by an assistant turn is
  rendered extended by the new messages (with the generation prompt), under two different histories; the
  text after the assistant's close token is the delta. It is spliced onto the verbatim sampled ids (a
  completion cut before its close gets the close, as the template closes every assistant turn) only when it
  is exact: both histories give the same delta, and its tokens equal the tail of the whole render's tokens
  (no merge across the close). When the renderer rendered the previous prompt itself and the template
  re-renders the sampled reply as sampled (it is prefix-stable here), the bridged ids must also equal the
  template's render of the whole conversation. Anything else returns None with its reason in
  `last_refusal()` (counted as a bridge fallback with that reason): never a guess.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from quaero.chat.sandbox import TemplateProblem, TemplateRunner
from quaero.chat.toolcalls import (
    as_parts,
    system_folded,
    tool_results_as_user,
    with_calls_as_text,
    with_tool_prompt,
)
from quaero.chat.toolformats import FORMATS, MalformedToolCall, ToolFormat, parser, same_calls

# the variables every render sets itself: an option of the same name would collide with them
RENDER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
_SENTINEL = "Qx7bridge"  # an assistant content no template changes and no tokenizer merges with a close token
_MEMORY = 1024  # generation-prompt renders remembered (prompt ids -> messages): the bridge renders the whole
# conversation from them (a step of 16 tasks x 8 samples renders 128 prompts before it bridges any)
# the known calls of the tool-format round trip: one, then two in one message (unicode, nesting, a number)
_PROBE_TOOLS = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
    "type": "object", "properties": {k: {"type": "string"} for k in ks}}}}
    for n, ks in (("get_weather", ("city",)), ("search", ("query", "filters")))]
_PROBE_CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "São Paulo"}}},
                {"type": "function", "function": {"name": "search", "arguments": {
                    "query": "crème brûlée", "filters": {"max": 10, "vegan": False}}}}]

# the determinism probes: one user message (no tools), then nine messages with tools, calls and results
_DETERMINISM_CHATS = (
    ([{"role": "user", "content": "u"}], None),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
      *[m for i in range(3)
        for m in ({"role": "assistant", "content": f"a{i}", "tool_calls": _PROBE_CALLS[:1]},
                  {"role": "tool", "content": f"t{i}"})],
      {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}], _PROBE_TOOLS))


@dataclass(frozen=True)
class Refusal:
    reason: str  # a short metric label (`bridge_fallback_reason_<reason>`)
    detail: str


def chat_template_of(tokenizer) -> str | None:
    """The tokenizer's chat template text (the `default` one of a named set), or None."""
    src = getattr(tokenizer, "chat_template", None)
    if isinstance(src, dict):
        src = src.get("default")
    return src or None


def _vocabulary_ids(tokenizer, text: str) -> list[int] | None:
    """`text`'s ids by the tokenizer's model alone, added tokens aside (None: no fast backend to ask)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pre = backend.pre_tokenizer
    pieces = pre.pre_tokenize_str(text) if pre is not None else [(text, None)]
    return [t.id for piece, _ in pieces for t in backend.model.tokenize(piece)]


def _check_stop_token(tokenizer, eos: int | None) -> None:
    """The tokenizer's eos, a stop token of every reply, must be one of its added (special) tokens: an
    ordinary one (a word of the vocabulary, e.g. eos_token = "the") would cut every reply where the model
    first writes it. (Read from `added_tokens_decoder`, which changes nothing: encoding with
    `split_special_tokens` would leave the tokenizer splitting special tokens from then on.)"""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(eos, int) or not isinstance(added, dict) or not added:
        return
    # transformers makes a tokenizer_config's eos_token an added token on load, a word too: such a word is
    # one the vocabulary itself spells (the model's own tokenization of its text is that one id)
    if eos in added and _vocabulary_ids(tokenizer, getattr(added[eos], "content", str(added[eos]))) != [eos]:
        return
    raise TemplateProblem(f"the tokenizer's eos_token {tokenizer.eos_token!r} (id {eos}) is an ordinary "
                          "token of its vocabulary, not a special one: every reply would stop where the "
                          "model first writes it; set eos_token to the model's end-of-text token")


class TemplateRenderer:
    """The Renderer protocol over the tokenizer's chat template.

    tool_format: "auto" (the template's own when it reads `tools` and its calls parse back through one of
    `quaero/chat/toolformats.py`'s formats, else text), "template" or "prompt". The format chosen is
    `tool_format_chosen` (with why: `tool_format_why`); `max_calls` is how many calls one message may hold
    (1 where the template raises on two, as Llama 3.x's does; None: any). Every other keyword is a template
    variable (e.g. `enable_thinking`, `date_string`)."""

    def __init__(self, tokenizer, *, chat_template: str | None = None, tool_format: str = "auto",
                 **template_variables: Any):
        if chat_template is not None and not chat_template.strip():  # never silently the tokenizer's own
            raise TemplateProblem("[model] renderer_options.chat_template is empty; give the template's "
                                  "text, or drop the option to use the tokenizer's own")
        source = chat_template if chat_template is not None else chat_template_of(tokenizer)
        if not source:
            raise TemplateProblem("the tokenizer has no chat template")
        if not source.strip():
            raise TemplateProblem("the tokenizer's chat template is empty (whitespace only)")
        if tool_format not in ("auto", "template", "prompt"):
            raise ValueError(f"tool_format={tool_format!r} is not 'auto', 'template' or 'prompt'")
        self._tokenizer = tokenizer
        self._runner = TemplateRunner(source)
        special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        self.template_variables = {**special, **template_variables}
        self.tools_in_template = (tool_format == "template"
                                  or (tool_format == "auto" and "tools" in self._runner.variables))
        self._thinks = "</think>" in source or "<think>" in source  # (DeepSeek R1 opens one it never closes)
        self._parts = self._wants_parts()
        self._system_role = self._renders_system_role()
        self._tool_role = self._renders_tool_role()
        # how quaero fits the conversation to the template (`quaero check` says each)
        self.adaptations = [text for ok, text in (
            (self._system_role, ("system prompt folded into the first user turn (the template has no system "
                                "role)")),
            (self._tool_role, "tool results sent as user turns (the template has no `tool` role)"),
            (not self._parts, ("message text sent as a list of text parts (the template reads no plain "
                              "string content)"))) if not ok]
        self._check_deterministic()
        self.close_text, self.close_id = self._find_close()
        self._format, self.max_calls, self.tool_format_why = self._choose_tool_format(tool_format)
        self.tool_format_chosen = self._format.name
        eos = getattr(tokenizer, "eos_token_id", None)
        _check_stop_token(tokenizer, eos)
        self._stop = [t for t in dict.fromkeys([self.close_id, eos]) if isinstance(t, int)]
        self._memory: OrderedDict[tuple[int, ...], tuple[list[dict], list[dict] | None, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._checked: tuple | None = None

    # ── rendering ────────────────────────────────────────────────────────────────────────────────

    def template_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """Messages as the template gets them: keys set to None dropped; without `tools` in the template, the
        tool prompt in the system message, calls as text, and tool results as `<tool_response>` user turns
        where the template cannot render a `tool` role."""
        out = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if not self.tools_in_template:
            out = [with_calls_as_text(m) if m.get("role") == "assistant" else m for m in out]
            if not self._tool_role:
                out = tool_results_as_user(out)
            out = with_tool_prompt(out, tools) if tools else out
        out = out if self._system_role else system_folded(out)
        return [as_parts(m) for m in out] if self._parts else out

    def render_text(self, messages: list[dict], *, tools: list[dict] | None = None,
                    add_generation_prompt: bool = False) -> str:
        return self._runner.render(messages=self.template_messages(messages, tools),
                                   tools=tools if self.tools_in_template else None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **self.template_variables)

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False) if text else []

    def render_ids(self, messages: list[dict], *, tools: list[dict] | None = None,
                   add_generation_prompt: bool = False) -> list[int]:
        text = self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        ids = self._encode(text)
        if add_generation_prompt:
            with self._lock:
                self._memory[tuple(ids)] = (list(messages), tools, text)
                while len(self._memory) > _MEMORY:
                    self._memory.popitem(last=False)
        return ids

    def render(self, messages: list[dict], *, tools: list[dict] | None = None,
               add_generation_prompt: bool = False):
        """RenderedTokens with each token's message index: message k owns the text its render adds to the
        render of the messages before it (-1: scaffolding, or text a later message rewrote)."""
        from renderers import RenderedTokens

        text = self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        enc = self._tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
        owner = [-1] * len(text)
        done = 0
        for k in range(len(messages)):
            part = self.render_text(messages[:k + 1], tools=tools)
            end = len(part) if text.startswith(part) else done
            owner[done:end] = [k] * (end - done)
            done = max(done, end)
        indices = [owner[start] if start < len(owner) else -1 for start, _ in enc.offsets]
        return RenderedTokens(token_ids=list(enc.ids), message_indices=indices)

    # ── parsing and stopping ─────────────────────────────────────────────────────────────────────

    def get_stop_token_ids(self) -> list[int]:
        return list(self._stop)

    def parse_response(self, token_ids: list[int], tools: list[dict] | None = None):
        """The reply's content, reasoning and calls; `tools` (the conversation's specs) type a call's
        arguments where the template writes a string and a number alike (Qwen3.5's XML: "178.1", 178.1)."""
        from renderers import ParsedResponse

        ids = list(token_ids)
        stops = [i for i, t in enumerate(ids) if t in self._stop]
        text = self._tokenizer.decode(ids[:stops[0]] if stops else ids, skip_special_tokens=False)
        reasoning = None
        if self._thinks and "</think>" in text:
            before, _, text = text.partition("</think>")
            reasoning = before.replace("<think>", "").strip("\n").strip() or None
            text = text.strip("\n")
        content, calls = self._read_calls(text, tools)
        return ParsedResponse(content=content.strip(), reasoning_content=reasoning, tool_calls=calls)

    def _read_calls(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[dict] | None]:
        """(content, calls) in the chosen format; raises MalformedToolCall on a call it cannot read, or on
        more calls than the template renders in one message (the reply then goes to the env as text)."""
        found = self._format.parse(text, tools)
        if found is None:
            return text, None
        if self.max_calls is not None and len(found[1]) > self.max_calls:
            raise MalformedToolCall(f"{len(found[1])} tool calls in one reply: this chat template renders at "
                                    f"most {self.max_calls} in a message")
        return found

    # ── the tool-call format: a round trip through the template ──────────────────────────────────

    def _choose_tool_format(self, requested: str) -> tuple[ToolFormat, int | None, str]:
        """The format whose parser reads back, exactly, a known call the template rendered (and how many
        calls a message may hold: None, any, when two in one message round-trip too, else 1). Where the
        template's own calls round-trip through none and `requested` is "auto", calls go as text
        (tool_format "prompt"); where that fails as well, TemplateProblem."""
        if self.tools_in_template:
            found = self._round_trip(list(FORMATS))
            if found is not None:
                return (*found, f"{found[0].name}: the template's own tool calls parse back exactly")
            if requested == "template":
                raise TemplateProblem(f"the chat template's own tool calls parse back through none of the "
                                      f"tool-call formats ({', '.join(FORMATS)}); set tool_format = 'prompt'")
            self.tools_in_template = False
            why = (f"prompt (auto: the template's own tool calls parse back through none of "
                   f"{', '.join(FORMATS)}, so calls and tool specs go as text)")
        else:
            why = "prompt (tool_format = 'prompt')" if requested == "prompt" else \
                "prompt (auto: the template reads no `tools`, so calls and tool specs go as text)"
        found = self._round_trip(["hermes"])
        if found is None:
            raise TemplateProblem("tool calls round-trip through this chat template neither in its own "
                                  "format nor as text: a rendered call does not parse back to itself"
                                  + self._probe_error)
        return found[0], found[1], why

    def _round_trip(self, names: list[str]) -> tuple[ToolFormat, int | None] | None:
        """The first of the formats `names` that reads the known call back exactly, and its `max_calls`."""
        self._probe_error = ""
        one = self._rendered_reply(_PROBE_CALLS[:1])
        for name in names if one is not None else []:
            fmt = parser(name)
            if same_calls(self._probe_parse(one, fmt), _PROBE_CALLS[:1]):
                two = self._rendered_reply(_PROBE_CALLS)
                both = two is not None and same_calls(self._probe_parse(two, fmt), _PROBE_CALLS)
                return fmt, None if both else 1
        return None

    def _probe_parse(self, text: str, fmt: ToolFormat) -> list[dict] | None:
        if self._thinks and "</think>" in text:
            text = text.partition("</think>")[2].strip("\n")
        try:
            found = fmt.parse(text.strip())
        except MalformedToolCall:
            return None
        return found[1] if found else None

    def _rendered_reply(self, calls: list[dict]) -> str | None:
        """The text the template renders for an assistant message of `calls` after its generation prompt, up
        to its close token (None: the template raises)."""
        chat = [{"role": "user", "content": "Qx7ask"}]
        try:
            prompt = self.render_text(chat, tools=_PROBE_TOOLS, add_generation_prompt=True)
            whole = self.render_text([*chat, {"role": "assistant", "content": "", "tool_calls": calls}],
                                     tools=_PROBE_TOOLS)
        except TemplateProblem as e:
            self._probe_error = f" (the template raised on it: {e})"
            return None
        if whole.startswith(prompt):
            reply = whole[len(prompt):]
        else:  # the generation prompt is not a prefix of the turn (`<think>\n` vs `<tool_call>`: refused or
            # handled elsewhere): the call is read from the token where the two renders part
            a, b = self._encode(prompt), self._encode(whole)
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            reply = self._tokenizer.decode(b[at:], skip_special_tokens=False)
        return reply.partition(self.close_text)[0] if self.close_text else reply

    # ── probes at construction ───────────────────────────────────────────────────────────────────

    def _wants_parts(self) -> bool:
        """True where the template renders a message's text only from a list of text parts (`[{"type":
        "text", "text": ...}]`, the multimodal templates': SmolVLM's, Idefics3's, LLaVA-NeXT's)."""
        def shows(content) -> bool:
            chat = [{"role": "user", "content": content}]
            try:
                return "Qx7u" in self._runner.render(messages=chat, tools=None, documents=None,
                                                     add_generation_prompt=True, **self.template_variables)
            except TemplateProblem:
                return False
        return not shows("Qx7u") and shows([{"type": "text", "text": "Qx7u"}])

    def _renders_system_role(self) -> bool:
        """False where the template raises on a system message but renders the same chat without it (Gemma's
        first template: "System role not supported"); an error on any chat is not about the system role."""
        def renders(chat: list[dict]) -> bool:
            try:
                self._runner.render(messages=[as_parts(m) if self._parts else m for m in chat], tools=None,
                                    documents=None, add_generation_prompt=True, **self.template_variables)
            except TemplateProblem:
                return False
            return True
        user = {"role": "user", "content": "u"}
        return renders([{"role": "system", "content": "s"}, user]) or not renders([user])

    def _renders_tool_role(self) -> bool:
        try:
            chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                    {"role": "tool", "content": "Qx7tool"}]
            text = self._runner.render(messages=[as_parts(m) if self._parts else m for m in chat],
                                       tools=None, documents=None, add_generation_prompt=False,
                                       **self.template_variables)
        except TemplateProblem:
            return False
        return "Qx7tool" in text

    def _check_deterministic(self) -> None:
        """TemplateProblem where a conversation renders differently on each render, or renders as nothing.
        Probed on one user message and on a longer one with tool calls and results (a template's randomness
        can hide behind a message count or a role); the longer one is skipped where the template raises on
        it (the tool-format round trip and the bridge judge that)."""
        for chat, tools in _DETERMINISM_CHATS:
            try:
                texts = {self.render_text(chat, tools=tools, add_generation_prompt=True) for _ in range(3)}
            except TemplateProblem:
                if len(chat) == 1:
                    raise
                continue
            if len(texts) > 1:
                seen = "" if len(chat) == 1 else f": {len(chat)} messages with tool calls and results"
                raise TemplateProblem("the chat template renders the same conversation differently each time "
                                      f"(it is not deterministic){seen}")
            if not next(iter(texts)).strip():
                raise TemplateProblem(f"the chat template renders nothing for a conversation of {len(chat)} "
                                      "message(s)")

    def _find_close(self) -> tuple[str | None, int | None]:
        """The added token right after an assistant's content in the template's render (None: none there)."""
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}]
        for tail in ([], [{"role": "user", "content": "Bye"}]):
            text = self.render_text(chat + tail)
            at = text.find(_SENTINEL)
            after = self._encode(text[at + len(_SENTINEL):]) if at >= 0 else []
            added = self._tokenizer.get_added_vocab()
            if after and after[0] in added.values():
                return self._tokenizer.convert_ids_to_tokens(after[0]), after[0]
        return None, None

    # ── the bridge ───────────────────────────────────────────────────────────────────────────────

    def last_refusal(self) -> Refusal | None:
        """Why this thread's latest bridge_to_next_turn returned None (None after one that bridged)."""
        return getattr(self._local, "refusal", None)

    def _refuse(self, reason: str, detail: str) -> None:
        self._local.refusal = Refusal(reason, detail)

    def _delta(self, new_messages: list[dict], tools: list[dict] | None) -> tuple[str, list[int]] | Refusal:
        """The text and ids the template adds after a closed assistant turn: `new_messages`, the generation
        prompt. The close is an added token, so the tokenizer splits there: the tail's ids are its own, which
        `encode(close + tail) == [close] + encode(tail)` confirms (a tokenizer that marks the start of a text,
        e.g. SentencePiece's prefix space, fails it)."""
        def turn(name: str | None) -> dict:
            """The closed assistant turn: the sentinel as its content (and as its calls' names where the
            template shows calls only, as Llama 3's does), with a call per tool result it answers."""
            calls = [{"type": "function", "id": m.get("tool_call_id") or f"call_{i}",
                      "function": {"name": name or m.get("name") or "tool", "arguments": {}}}
                     for i, m in enumerate(new_messages) if m.get("role") == "tool"]
            return {"role": "assistant", "content": _SENTINEL, **({"tool_calls": calls} if calls else {})}

        tails = []
        for history in ([{"role": "user", "content": "Hi"}],
                        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                         {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Go on"}]):
            for name in (None, _SENTINEL):
                try:
                    text = self.render_text([*history, turn(name), *new_messages], tools=tools,
                                            add_generation_prompt=True)
                except TemplateProblem as e:
                    return Refusal("template_raised", str(e))
                if _SENTINEL in text:
                    break
            at = text.find(_SENTINEL)  # the history holds none: the first is the closed turn's
            close = text.find(self.close_text, at) if at >= 0 else -1
            if close < 0:
                return Refusal("template_no_close", "the assistant turn's close token is not in the render")
            tails.append(text[close + len(self.close_text):])
        if tails[0] != tails[1]:
            return Refusal("template_history_dependent", "the template renders the new messages differently "
                                                         "after different histories")
        ids = self._encode(tails[0])
        if self._encode(self.close_text + tails[0]) != [self.close_id, *ids]:
            return Refusal("template_token_merge", "the new messages' tokens merge across the close")
        return tails[0], ids

    def bridge_to_next_turn(self, previous_prompt_ids: list[int], previous_completion_ids: list[int],
                            new_messages: list[dict], *, tools: list[dict] | None = None):
        from renderers import RenderedTokens

        self._local.refusal = None
        prompt, completion = list(previous_prompt_ids), list(previous_completion_ids)
        if not prompt or not new_messages:
            return self._refuse("empty", "no previous prompt or no new messages")
        if any(m.get("role") == "assistant" for m in new_messages):
            return self._refuse("assistant_in_extension", "an assistant message would re-render sampled text")
        if self.close_id is None:
            return self._refuse("template_no_close", "no added token closes an assistant turn here")
        if self.close_id in completion:
            if completion.index(self.close_id) != len(completion) - 1:
                return self._refuse("after_close", "the completion goes on after its close token")
            head = prompt + completion
        elif completion and completion[-1] in self._stop:
            return self._refuse("foreign_stop", "the completion ended on a stop token that is not the close")
        else:  # cut by max_tokens: the template closes every assistant turn with its close token
            head = prompt + completion + [self.close_id]
        whole = self._whole_tail(prompt, head[len(prompt):], new_messages)
        if isinstance(whole, Refusal):
            return self._refuse(whole.reason, whole.detail)
        if whole is not None:  # the template's render of this very conversation: the tail it adds
            ids = self._encode(whole)
            if self._encode(self.close_text + whole) != [self.close_id, *ids]:
                return self._refuse("template_token_merge", "the new messages' tokens merge across the close")
            return RenderedTokens(token_ids=head + ids)
        delta = self._delta(new_messages, tools)
        if isinstance(delta, Refusal):
            return self._refuse(delta.reason, delta.detail)
        return RenderedTokens(token_ids=head + delta[1])

    def _whole_tail(self, prompt: list[int], reply: list[int],
                    new_messages: list[dict]) -> str | Refusal | None:
        """What the template's render of the whole conversation (the known history of `prompt`, which this
        renderer rendered; the parsed reply; `new_messages`; the generation prompt) adds after the reply:
        after the prompt's text and the reply's where it starts with them, else after the reply's close as
        rendered there (a think block dropped: the next turn starts a new row). The truth where it applies
        (DeepSeek R1 writes `<｜tool▁outputs▁begin｜>` before a conversation's first tool result only); None
        where not (the tail is then `_delta`'s). A template that raises on the whole conversation is a
        refusal (`template_raised`): a tail from elsewhere would be a guess. Text: the reply's ids are the
        sampler's, the tail's its own."""
        with self._lock:
            known = self._memory.get(tuple(prompt))
        if known is None:
            return None
        history, tools, prompt_text = known
        key = (hash(tuple(prompt)), hash(tuple(reply)))
        checked = self._checked
        if checked is None or checked[0] != key:  # once a reply (the adapter re-bridges it to attribute)
            try:
                parsed = self.parse_response(reply, tools)
                calls = [{"type": "function", "function": c["function"]} for c in parsed.tool_calls or []]
                message = {"role": "assistant", "content": parsed.content,
                           "reasoning_content": parsed.reasoning_content, "tool_calls": calls or None}
            except MalformedToolCall:  # the adapter sends such a reply on as text, without calls
                kept = [t for t in reply if t not in self._stop]
                message = {"role": "assistant", "content": self._tokenizer.decode(kept)}
            checked = self._checked = (key, message)
        message = checked[1]
        try:
            whole = self.render_text([*history, message, *new_messages], tools=tools,
                                     add_generation_prompt=True)
        except TemplateProblem as e:
            return Refusal("template_raised", f"the template raises on the whole conversation: {e}")
        head = prompt_text + self._tokenizer.decode(reply, skip_special_tokens=False)
        if whole.startswith(head):
            return whole[len(head):]
        try:  # the next prompt renders the reply otherwise (its think block dropped): the tail after the
            # reply's close as the whole conversation renders it, where it follows the reply so rendered
            turn = self.render_text([*history, message], tools=tools)
        except TemplateProblem:
            return None
        end = turn.rfind(self.close_text) + len(self.close_text) if self.close_text in turn else 0
        return whole[end:] if end and whole[:end] == turn[:end] else None

