"""Tool calls as text (quaero/chat/toolcalls.py): written as `<tool_call>` blocks, read back as renderers'
Qwen3 parser reads them, and the tool prompt placed in the system message."""
from __future__ import annotations

import json

from quaero.chat.toolcalls import call_text, parse_tool_calls, with_calls_as_text, with_tool_prompt

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_calls_written_as_text_parse_back_to_the_same_calls():
    message = with_calls_as_text({"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, CALL]})
    assert "tool_calls" not in message and message["content"].startswith("Let me look.\n<tool_call>\n")
    assert '"Zürich"' in call_text(CALL)  # not escaped
    content, calls = parse_tool_calls(message["content"])
    assert content == "Let me look.\n"
    assert calls == [{"function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}] * 2
    as_string = {"function": {"name": "f", "arguments": json.dumps({"a": 1})}}
    assert parse_tool_calls(call_text(as_string))[1] == [{"function": {"name": "f", "arguments": {"a": 1}}}]


def test_an_unclosed_block_is_read_to_the_end_and_a_body_that_is_not_json_is_skipped():
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {}}') == (
        "", [{"function": {"name": "f", "arguments": {}}}])
    text = 'a<tool_call>{bad}</tool_call><tool_call>{"name": "g"}</tool_call>'
    assert parse_tool_calls(text) == ("a", [{"function": {"name": "g", "arguments": {}}}])
    assert parse_tool_calls("x <tool_call>{bad}</tool_call>") == ("x <tool_call>{bad}</tool_call>", None)
    assert parse_tool_calls("no calls") == ("no calls", None)


def test_the_tool_prompt_joins_the_system_message_or_comes_first():
    chat = [{"role": "user", "content": "hi"}]
    first = with_tool_prompt(chat, TOOLS)
    assert first[0]["role"] == "system" and json.dumps(TOOLS[0]) in first[0]["content"] and first[1:] == chat
    joined = with_tool_prompt([{"role": "system", "content": "Be brief."}, *chat], TOOLS)
    assert len(joined) == 2 and joined[0]["content"].startswith("Be brief.\n\n# Tools\n")
