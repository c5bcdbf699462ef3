"""Chat <-> OpenEnv mapping, model-independent: tool specs, tool-call validation, tool results,
plain actions and observation formatting."""
import pytest

from quaero.openenv_client.mapping import (
    Malformed,
    default_formatter,
    model_action_schema,
    parse_plain_action,
    parse_tool_calls,
    render_tool_result,
    tool_specs,
)

TOOLS = tool_specs([
    {"name": "add_days", "description": "Add days.", "input_schema": {
        "type": "object", "properties": {"date": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["date", "days"], "additionalProperties": False}},
    {"name": "submit_answer", "description": "Submit.", "input_schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}},
])


def _assistant(*calls, content=""):
    return {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": list(calls) or None}


def test_tool_specs_are_openai_style():
    assert TOOLS[0]["type"] == "function"
    assert TOOLS[0]["function"]["name"] == "add_days"
    assert TOOLS[0]["function"]["parameters"]["required"] == ["date", "days"]


def test_valid_calls_parse_with_or_without_the_type_key_and_with_string_arguments():
    calls = parse_tool_calls(_assistant(
        {"type": "function", "function": {"name": "add_days", "arguments": {"date": "2024-01-01", "days": 3}}},
        {"function": {"name": "submit_answer", "arguments": '{"answer": "x"}'}}), TOOLS)
    assert calls == [("add_days", {"date": "2024-01-01", "days": 3}), ("submit_answer", {"answer": "x"})]


@pytest.mark.parametrize("assistant,needle", [
    (_assistant(content="I think it is 42"), "did not call a tool"),
    (_assistant({"function": {"name": "rm_rf", "arguments": {}}}), "Unknown tool 'rm_rf'"),
    (_assistant({"function": {"name": "add_days", "arguments": {"date": "2024-01-01", "days": "x"}}}),
     "Invalid arguments for add_days (days"),
    (_assistant({"function": {"name": "add_days", "arguments": {"date": "2024-01-01"}}}), "'days' is a required"),
    (_assistant({"function": {"name": "add_days", "arguments": "{not json"}}), "not valid JSON"),
    (_assistant({"function": {"name": "submit_answer", "arguments": [1]}}), "must be a JSON object"),
])
def test_malformed_tool_calls_become_short_corrective_messages(assistant, needle):
    with pytest.raises(Malformed) as e:
        parse_tool_calls(assistant, TOOLS)
    assert needle in str(e.value) and len(str(e.value)) < 200


def test_one_bad_call_rejects_the_whole_message():
    with pytest.raises(Malformed):
        parse_tool_calls(_assistant({"function": {"name": "submit_answer", "arguments": {"answer": "1"}}},
                                    {"function": {"name": "nope", "arguments": {}}}), TOOLS)


def test_tool_results_render_as_text_data_or_error():
    text = {"result": {"content": [{"type": "text", "text": "P3 red kettle $12.50"}], "data": "ignored"}}
    assert render_tool_result(text) == "P3 red kettle $12.50"
    assert render_tool_result({"result": {"content": [], "data": {"a": 1}}}) == '{"a": 1}'
    err = {"result": None, "error": {"error_type": "execution_error",
                                     "message": "Error calling tool 'get_product': unknown product_id 'P9'"}}
    assert render_tool_result(err) == "Error: unknown product_id 'P9'"


SCHEMA = model_action_schema({"title": "A", "type": "object", "properties": {
    "guess": {"title": "Guess", "type": "integer"}, "metadata": {"type": "object"}}, "required": ["guess"]})


def test_action_schema_for_the_model_drops_metadata_and_titles():
    assert SCHEMA == {"type": "object", "properties": {"guess": {"type": "integer"}}, "required": ["guess"]}


@pytest.mark.parametrize("text,action", [
    ('{"guess": 4}', {"guess": 4}),
    ('```json\n{"guess": 5}\n```', {"guess": 5}),
    ("  7 ", {"guess": 7}),
])
def test_plain_actions_parse_from_json_fences_or_a_bare_value(text, action):
    assert parse_plain_action(text, SCHEMA) == action


def test_single_string_field_actions_wrap_raw_text():
    schema = {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}
    assert parse_plain_action("hello there", schema) == {"message": "hello there"}


@pytest.mark.parametrize("text", ["hello", "[1, 2]", ""])
def test_unparseable_plain_actions_are_malformed(text):
    with pytest.raises(Malformed, match="not a valid action"):
        parse_plain_action(text, SCHEMA)


def test_default_formatter_uses_the_question_on_reset_and_json_on_step():
    obs = {"prompt": "Guess a number.", "hint": "", "metadata": {}}
    assert default_formatter(obs, context="reset") == "Guess a number."
    assert default_formatter({"prompt": "", "hint": "higher", "metadata": {}}) == '{"hint": "higher"}'
    assert default_formatter({"metadata": {"question": "Q?"}}, context="reset") == "Q?"
