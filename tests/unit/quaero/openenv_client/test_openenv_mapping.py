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
    return {"role": "assistant", "content": content, "reasoning_content": None,
            "tool_calls": list(calls) or None}


def test_tool_specs_are_openai_style():
    assert TOOLS[0]["type"] == "function"
    assert TOOLS[0]["function"]["name"] == "add_days"
    assert TOOLS[0]["function"]["parameters"]["required"] == ["date", "days"]


def test_valid_calls_parse_with_or_without_the_type_key_and_with_string_arguments():
    calls = parse_tool_calls(_assistant(
        {"type": "function", "function": {"name": "add_days", "arguments": {"date": "2024-01-01",
                                                                            "days": 3}}},
        {"function": {"name": "submit_answer", "arguments": '{"answer": "x"}'}}), TOOLS)
    assert calls == [("add_days", {"date": "2024-01-01", "days": 3}), ("submit_answer", {"answer": "x"})]


@pytest.mark.parametrize("assistant,needle", [
    (_assistant(content="I think it is 42"), "did not call a tool"),
    (_assistant({"function": {"name": "rm_rf", "arguments": {}}}), "Unknown tool 'rm_rf'"),
    (_assistant({"function": {"name": "add_days", "arguments": {"date": "2024-01-01", "days": "x"}}}),
     "Invalid arguments for add_days (days"),
    (_assistant({"function": {"name": "add_days", "arguments": {"date": "2024-01-01"}}}), ("'days' is a "
                                                                                          "required")),
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


def test_default_formatter_puts_the_question_first_then_every_informative_field():
    obs = {"metadata": {"seed": 3}, "question": "Which position holds the largest card?", "context": "cards: "
                                                                                                     "4 9 2",
           "legal_moves": [0, 1, 2], "scores": {"a": 1}, "board": "X O\n. X", "empty": "", "none": None,
           "count": 0}
    assert default_formatter(obs, context="reset") == (
        "Which position holds the largest card?\ncontext: cards: 4 9 2\nlegal_moves: [0, 1, 2]\n"
        'scores: {"a": 1}\nboard:\nX O\n. X\ncount: 0')  # declaration order; bookkeeping and empties left out
    assert default_formatter({"prompt": "Guess a number.", "hint": "", "metadata": {}}, context="reset") == \
        "Guess a number."
    assert default_formatter({"prompt": "", "hint": "higher", "metadata": {}}) == "hint: higher"


def test_default_formatter_reads_a_metadata_question_on_reset_only():
    assert default_formatter({"metadata": {"question": "Q?", "task_id": "t1"}}, context="reset") == "Q?"
    assert default_formatter({"metadata": {"question": "Q?"}, "result": "ok"}, context="step") == "result: ok"


def test_a_multi_field_reset_observation_reaches_the_rendered_prompt(qwen3_render):
    obs = {"question": "Which position holds the largest card?", "context": "cards: 41 97 23 8",
           "legal_moves": [0, 1]}
    messages = [
        {"role": "system", "content": "Play."},
        {"role": "user", "content": default_formatter(obs, "reset")},
    ]
    prompt = qwen3_render.tokenizer.decode(qwen3_render.prompt_ids(messages, None))
    assert "largest card?\ncontext: cards: 41 97 23 8\nlegal_moves: [0, 1]" in prompt


def test_a_reply_without_a_tool_call_names_this_env_s_tools_or_the_configured_message():
    with pytest.raises(Malformed) as e:
        parse_tool_calls(_assistant(content="42"), TOOLS[:1])
    assert str(e.value) == "Your last message did not call a tool. Call one of the tools: add_days."
    with pytest.raises(Malformed, match="^Call a tool, then finish.$"):
        parse_tool_calls(_assistant(content="42"), TOOLS, "Call a tool, then finish.")


# -- the Action class of a plain env (quaero/openenv_client/loading.py)
# ------------------------------------------
def test_action_comes_from_type_parameters_or_a_step_annotation():
    from fixtures.basegame.models import PickAction

    from quaero.openenv_client.loading import load_entry

    assert load_entry("fixtures.guess:GuessEnv").action_source == "its type parameters"
    spec = load_entry("fixtures.untyped:AnnotatedPickEnv")
    assert spec.action_cls is PickAction and spec.action_source == "its step annotation"


def test_a_base_action_env_takes_the_action_its_own_server_app_publishes():
    from fixtures.basegame.models import PickAction, PickObservation

    from quaero.openenv_client.loading import load_entry

    spec = load_entry("fixtures.basegame:PickEnv")
    assert spec.action_cls is PickAction and spec.observation_cls is PickObservation
    assert spec.action_source == "the env's own server app fixtures.basegame.server:app"


def test_a_base_action_env_without_a_server_app_needs_env_action():
    from fixtures.basegame.models import PickAction

    from quaero.config import ConfigError
    from quaero.openenv_client.loading import load_entry

    with pytest.raises(ConfigError, match=r"BarePickEnv.step takes the base Action .* \[env\] action = "):
        load_entry("fixtures.untyped:BarePickEnv")
    spec = load_entry("fixtures.untyped:BarePickEnv", action="fixtures.basegame.models:PickAction")
    assert spec.action_cls is PickAction and spec.action_source == "[env] action"
    with pytest.raises(ConfigError, match="not a subclass of openenv's Action"):
        load_entry("fixtures.untyped:BarePickEnv", action="fixtures.guess:GuessState")
    with pytest.raises(ConfigError, match="GuessEnv already names its Action, fixtures.guess:GuessAction"):
        load_entry("fixtures.guess:GuessEnv", action="fixtures.basegame.models:PickAction")


def test_an_action_without_fields_is_an_error_naming_the_fix(monkeypatch):
    import fixtures.untyped
    from openenv.core.env_server.types import Action

    from quaero.config import ConfigError
    from quaero.openenv_client.loading import load_entry

    class Noop(Action):
        pass

    monkeypatch.setattr(fixtures.untyped, "Noop", Noop, raising=False)
    with pytest.raises(ConfigError, match=r"its Action Noop \(from \[env\] action\) has no fields.*"
                                          r"\[env\] action = \"module:ActionClass\""):
        load_entry("fixtures.untyped:BarePickEnv", action="fixtures.untyped:Noop")


def test_reset_parameters_the_env_does_not_take_are_named():
    from quaero.openenv_client.loading import ignored_reset_params, load_entry

    assert ignored_reset_params(load_entry("fixtures.basegame:PickEnv")) == []
    assert ignored_reset_params(load_entry("fixtures.basegame.env:SeedlessPickEnv")) == ["seed", "split",
                                                                                         "index"]
