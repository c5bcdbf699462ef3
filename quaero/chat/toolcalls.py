"""The tool-call text format of the template renderer, for chat templates that take no `tools`.

Such a template (SmolLM2's ChatML, Gemma 3's) has no place for tool specs nor for an assistant's calls, so
quaero writes both as text in the messages it gives the template (Hermes style, as Qwen3 and NousResearch's
Hermes models write them):
- the tool specs go in the system message, after its text (or in a system message of their own when the
  conversation has none): `TOOL_PROMPT` with one JSON spec a line inside `<tools></tools>`;
- an assistant's calls are appended to its content, one block each:
  `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>` (arguments given as a JSON string are
  written as given, a dict with `json.dumps(ensure_ascii=False)`);
- `parse_tool_calls` reads those blocks back from sampled text (the `hermes` format of
  `quaero/chat/toolformats.py`). A template that takes `tools` renders specs and calls itself; its calls are
  read back in the format a round trip through it finds (`quaero/chat/toolformats.py`).
- the messages fitted to a template that lacks a role or a content shape (`TemplateRenderer` finds which at
  construction): `tool_results_as_user` (no `tool` role), `system_folded` (no system role), `as_parts`
  (content read only as a list of text parts).
"""
from __future__ import annotations

import json
import re
from typing import Any

TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{specs}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def tool_prompt(tools: list[dict]) -> str:
    return TOOL_PROMPT.format(specs="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: dict) -> str:
    """One call as a `<tool_call>` block (`call`: OpenAI style, `{"function": {"name", "arguments"}}`)."""
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    name = json.dumps(fn.get("name", ""), ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {args}}}\n</tool_call>'


def with_calls_as_text(message: dict) -> dict:
    """An assistant message with its `tool_calls` written into its content (`call_text`, one a line)."""
    calls = message.get("tool_calls") or []
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    if calls:
        text = out.get("content") or ""
        out["content"] = (text + "\n" if text else "") + "\n".join(call_text(c) for c in calls)
    return out


def with_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tool prompt in the system message (appended to its text), or in a new one first."""
    prompt = tool_prompt(tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        text = messages[0]["content"]
        return [{**messages[0], "content": (text + "\n\n" if text else "") + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]] | None]:
    """(content, calls) of sampled text, as renderers' Qwen3 parser (vLLM's hermes parser) reads them: the
    content is the text before the first `<tool_call>`; each block's body is a JSON object with `name` and
    `arguments` (an unclosed last block is read to the end); a body that is not JSON is skipped, and when no
    block parses the whole text is the content. A body that is JSON but no object (`<tool_call>5</tool_call>`)
    raises TypeError: no call can be read from it (renderers' Qwen3 parser raises AttributeError there)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, None
    calls = []
    for body in _BLOCK.findall(text, start):
        try:
            parsed = json.loads(body.strip())
        except json.JSONDecodeError:
            continue
        if not isinstance(parsed, dict):
            raise TypeError(f"a <tool_call> block holds a JSON {type(parsed).__name__}, not an object")
        calls.append({"function": {"name": parsed.get("name", ""), "arguments": parsed.get("arguments", {})}})
    return (text[:start], calls) if calls else (text, None)


def tool_results_as_user(messages: list[dict]) -> list[dict]:
    """Tool results as `<tool_response>` blocks in user turns, for a template without a `tool` role: the
    results of one reply (and a user message right after them) in one user turn, as templates that
    alternate user/assistant (Gemma's) require."""
    out: list[dict] = []
    after_tool = False
    for m in messages:
        tool = m.get("role") == "tool"
        text = f"<tool_response>\n{m.get('content', '')}\n</tool_response>" if tool else m.get("content")
        if after_tool and (tool or (m.get("role") == "user" and isinstance(text, str))):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{text}"}
        else:
            out.append({"role": "user", "content": text} if tool else m)
        after_tool = tool or (after_tool and m.get("role") == "user")
    return out


def system_folded(messages: list[dict]) -> list[dict]:
    """System messages' text put at the head of the next user message (a user turn of its own where none
    follows), for a template without a system role."""
    out: list[dict] = []
    pending: list[str] = []
    for m in messages:
        if m.get("role") == "system":
            pending.append(str(m.get("content") or ""))
        elif pending and m.get("role") == "user" and isinstance(m.get("content"), str):
            out.append({**m, "content": "\n\n".join([*pending, m["content"]])})
            pending = []
        else:
            if pending:
                out.append({"role": "user", "content": "\n\n".join(pending)})
                pending = []
            out.append(m)
    return out + ([{"role": "user", "content": "\n\n".join(pending)}] if pending else [])


def as_parts(message: dict) -> dict:
    """`message` with its string content as one text part."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    return {**message, "content": [{"type": "text", "text": content}]}
