"""Tool calls in the model's own format (quaero/chat/toolformats.py): each parser on its family's text (one
call, two calls, malformed text), the format each real template gets by the round trip at construction, and
several calls in one reply through the episode driver (Llama 3.x's and Gemma 3's templates raised out of
`EpisodeDriver.run` on them)."""
from __future__ import annotations

import pytest
from fixtures.chat_cases import template_tokens, trl_template
from fixtures.rollout import assert_exact, drive, spans_of
from fixtures.toyenv import oracle

from quaero.chat.sandbox import TemplateProblem
from quaero.chat.template import TemplateRenderer
from quaero.chat.toolformats import FORMATS, MalformedToolCall, parser
from quaero.config import ModelConfig
from quaero.rollout.render import RenderAdapter, UnparsableAction

CALLS = [{"function": {"name": "get_weather", "arguments": {"city": "São Paulo"}}},
         {"function": {"name": "search", "arguments": {"query": "crème",
                                                       "filters": {"max": 10, "on": False}}}}]
W, S = '{"city": "São Paulo"}', '{"query": "crème", "filters": {"max": 10, "on": false}}'
# each format as its family writes the two calls (content before the calls where the format allows it)
WRITTEN = {
    "hermes": ("Let me look.\n", (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
                                 f'<tool_call>\n{{"name": "search", "arguments": {S}}}\n</tool_call>')),
    "llama3_json": ("", (f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; '
                        f'{{"name": "search", "parameters": {S}}}')),
    "mistral": ("Sure.", (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, '
                         f'{{"name": "search", "arguments": {S}}}]')),
    "pythonic": ("", ('[get_weather(city="São Paulo"), '
                      'search(query="crème", filters={"max": 10, "on": False})]')),
    "granite": ("", (f'<|tool_call|>[{{"name": "get_weather", "arguments": {W}}}, '
                    f'{{"name": "search", "arguments": {S}}}]')),
    "json": ("", (f'```json\n{{"tool_calls": [{{"function": {{"name": "get_weather", "arguments": {W}}}}}, '
                 f'{{"name": "search", "arguments": {S}}}]}}\n```')),
    "qwen_xml": ("", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
                     "</function>\n</tool_call>\n<tool_call>\n<function=search>\n<parameter=query>\ncrème\n"
                     '</parameter>\n<parameter=filters>\n{"max": 10, "on": false}\n</parameter>\n'
                     "</function>\n</tool_call>")),
    "glm_xml": ("", ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>São Paulo</arg_value>\n"
                    "</tool_call><tool_call>search\n<arg_key>query</arg_key>\n<arg_value>crème</arg_value>\n"
                    '<arg_key>filters</arg_key>\n<arg_value>{"max": 10, "on": false}</arg_value>\n'
                    "</tool_call>")),
}
MALFORMED = {
    "hermes": ['<tool_call>\n5\n</tool_call>', '<tool_call>\n"get_weather"\n</tool_call>'],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": ', '{"name": 5, "parameters": {}}'],
    "mistral": ["[TOOL_CALLS]", "[TOOL_CALLS][{'name': 'x'}]", '[TOOL_CALLS]f[ARGS]{"a": '],
    "pythonic": ["[get_weather(city=", "[get_weather('Paris')]", "[f(x=open('/etc/passwd').read())]",
                 "[__import__('os').system(cmd='true')]", "[f(**{'a': 1})]", "[f(a=1, a=2)]",
                 # not JSON values, or what ast cannot take: TypeError, RecursionError (reviewed)
                 "[f(a={1, 2})]", "[f(a=b'x')]", "[f(a=1j)]", "[f(a=1e999999)]", "[f(a={[1]: 2})]",
                 "[f(a=" + "-" * 3000 + "1)]"],
    "granite": ["<|tool_call|>[{]", '<|tool_call|>[{"arguments": {}}]'],
    "json": ['{"name": "f", "arguments": "not json"}', '[{"name": "f", "arguments": [1]}]'],
    "qwen_xml": ["<tool_call>\n<function=>\n</function>\n</tool_call>"],
}


def test_every_format_is_registered_once_and_written_here():
    assert set(WRITTEN) == set(FORMATS)


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_each_format_reads_one_and_two_calls_back_exactly(name):
    content, text = WRITTEN[name]
    fmt = parser(name)
    assert fmt.parse(content + text) == (content, CALLS)
    assert fmt.parse("no call here, just words") is None


@pytest.mark.parametrize("name,text", [(n, t) for n, ts in MALFORMED.items() for t in ts])
def test_malformed_text_in_a_format_is_a_malformed_call(name, text):
    with pytest.raises(MalformedToolCall):
        parser(name).parse(text)


def test_no_text_makes_a_parser_raise_anything_but_a_malformed_call():
    """Every cut of every family's text, through every parser: a result, None, or MalformedToolCall."""
    for _, text in WRITTEN.values():
        for cut in range(0, len(text) + 1, 3):
            for fmt in FORMATS.values():
                try:
                    fmt().parse(text[:cut])
                except MalformedToolCall:
                    pass


# real templates (TRL's copies) -> (format chosen, calls a message may hold, tools read by the template)
CHOSEN = {
    "qwen3": ("hermes", None, True),
    "qwen2_5": ("hermes", None, True),
    "llama3_1": ("llama3_json", 1, True),
    "llama3_2": ("llama3_json", 1, True),
    "qwen3_5_think": ("qwen_xml", None, True),
    "nemotron_3_nano": ("qwen_xml", None, True),
    "glm4moe": ("glm_xml", None, True),
    "gemma3": ("hermes", None, False),  # reads no `tools`: calls as text
    "phi3": ("hermes", None, False),
    "gemma4": ("hermes", None, False),  # its own `call:NAME{...}` format parses nowhere: rescued as text
    "lfm2": ("hermes", None, False),  # renders no `tool_calls` of a message: rescued as text
}


@pytest.mark.peers  # TRL's copies of the templates (the [peers] extra; CI's peers tier)
@pytest.mark.parametrize("name", sorted(CHOSEN))
def test_the_round_trip_picks_each_real_templates_own_format(qwen3_tokenizer, name):
    source = trl_template(name)
    r = TemplateRenderer(template_tokens(qwen3_tokenizer, source), chat_template=source)
    fmt, most, own = CHOSEN[name]
    assert (r.tool_format_chosen, r.max_calls, r.tools_in_template) == (fmt, most, own), r.tool_format_why
    assert r.tool_format_why.startswith(fmt if own else "prompt (auto: ")


@pytest.mark.peers  # TRL's copies of the templates (the [peers] extra; CI's peers tier)
def test_a_template_whose_calls_round_trip_nowhere_is_refused_in_one_line(qwen3_tokenizer):
    drops = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] != 'assistant' %}"
             "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateProblem, match="round-trip through this chat template neither in its own"):
        TemplateRenderer(qwen3_tokenizer, chat_template=drops)
    with pytest.raises(TemplateProblem, match="parse back through none of the tool-call formats"):
        TemplateRenderer(qwen3_tokenizer, chat_template=trl_template("gemma4"), tool_format="template")


def _render(tokenizer, name: str) -> RenderAdapter:
    source = trl_template(name)
    return RenderAdapter(template_tokens(tokenizer, source),
                         ModelConfig(renderer="template", renderer_options={"chat_template": source}))


@pytest.mark.peers  # TRL's copies of the templates (the [peers] extra; CI's peers tier)
@pytest.mark.parametrize("name", ["llama3_1", "llama3_2", "gemma3"])
def test_two_calls_in_one_reply_never_raise_out_of_the_driver(qwen3_tokenizer, name):
    """Before: TemplateProblem out of `EpisodeDriver.run` (Llama 3.x: "only supports single tool-calls";
    Gemma 3: two tool results, two user turns in a row, "roles must alternate")."""
    render = _render(qwen3_tokenizer, name)
    eps, audit = drive(render, tasks=3, policy=lambda info: oracle(info, parallel=True))
    if name == "gemma3":  # the results of one reply in one user turn: every episode plays, exactly
        assert all(ep.success for ep in eps) and audit["bridge_fallbacks"] == 0
        for ep in eps:
            assert_exact(render, ep)
        assert any(len(ep.messages[2].get("tool_calls") or []) == 2 for ep in eps)
        return
    # Llama 3.x renders one call a message: a two-call demo is dropped, counted with its reason
    assert eps[0].success and [ep.dropped for ep in eps] == [False, True, True]
    assert audit["drop_reason_template_raised"] == 2 and "single tool-calls" in eps[1].drop_reason
    assert spans_of(eps[0], "env") and audit["bridge_fallbacks"] == 0


@pytest.mark.peers  # TRL's copies of the templates (the [peers] extra; CI's peers tier)
def test_a_demos_reasoning_a_thinking_off_template_cannot_render_is_left_out_its_calls_kept(qwen3_tokenizer):
    """Qwen3.5's no-thinking template (generation prompt `<think>\n\n</think>\n\n`) and a scripted policy
    that gives reasoning: its turn renders the reasoning where the prompt closed it, so no sampled ids
    render as that demo. The demo is rendered as a model with thinking off samples its turn (no reasoning),
    counted, and every episode plays exactly. Before: each episode dropped as `demo_unrenderable` (toolbench's
    warm start trained nothing there)."""
    render = _render(qwen3_tokenizer, "qwen3_5_nothink")
    eps, audit = drive(render, tasks=2)
    assert audit["episodes_dropped"] == 0 and all(ep.success for ep in eps), audit
    assert audit["demo_reasoning_dropped"] == audit["turns"] > 0, audit
    for ep in eps:
        assert_exact(render, ep)
        for t in ep.transitions:
            said = render.tokenizer.decode(t.action_ids)
            assert "I need the price" not in said and "The total is" not in said, said
    eps, audit = drive(render, tasks=2, policy=lambda info: oracle(info, reasoning=False))
    assert all(ep.success for ep in eps) and audit["demo_reasoning_dropped"] == 0


TYPED_TOOLS = [{"type": "function", "function": {"name": "submit_answer", "description": "d", "parameters": {
    "type": "object", "properties": {"answer": {"type": "string"}, "days": {"type": "integer"},
                                     "tags": {"type": "array"}}}}}]
TYPED_CALL = {"type": "function", "function": {"name": "submit_answer",
                                               "arguments": {"answer": "178.10", "days": 23, "tags": ["a"]}}}


@pytest.mark.parametrize("name,text", [
    ("qwen_xml", ("<tool_call>\n<function=submit_answer>\n<parameter=answer>\n178.10\n</parameter>\n"
                 "<parameter=days>\n23\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n</function>\n"
                 "</tool_call>")),
    ("glm_xml", ("<tool_call>submit_answer\n<arg_key>answer</arg_key>\n<arg_value>178.10</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>23</arg_value>\n<arg_key>tags</arg_key>\n"
                '<arg_value>["a"]</arg_value>\n</tool_call>'))])
def test_an_xml_formats_string_argument_that_reads_as_json_stays_the_string_its_schema_types(name, text):
    """XML-style templates write a string raw and anything else as JSON: "178.10" and 178.1 are the same
    text. The tool's schema says which it is (vLLM's qwen3_coder parser reads it so); without one, JSON."""
    _, [typed] = parser(name).parse(text, TYPED_TOOLS)
    assert typed["function"]["arguments"] == TYPED_CALL["function"]["arguments"]
    _, [untyped] = parser(name).parse(text)
    assert untyped["function"]["arguments"] == {"answer": 178.1, "days": 23, "tags": ["a"]}


@pytest.mark.peers  # TRL's copies of the templates (the [peers] extra; CI's peers tier)
@pytest.mark.parametrize("template", ["qwen3_5_think", "qwen3_6", "qwen3_8"])
def test_a_demos_string_argument_parses_back_as_the_string_through_a_real_xml_template(qwen3_tokenizer,
                                                                                        template):
    """A demo's `answer: "178.10"` (toolbench's oracle answers a price as a string) rendered by the model's
    own template and parsed back with the episode's tools: the same call, so the env gets the string its
    schema asks for. Before: `178.1`, a number (toolbench: "178.1 is not of type 'string'"), and one of the
    two warm-start demos on each Qwen3.5+ template failed."""
    render = _render(qwen3_tokenizer, template)
    chat = [{"role": "user", "content": "What does it cost?"}]
    ids = render.encode_assistant(chat, TYPED_TOOLS, {"role": "assistant", "content": "", "tool_calls": [
        TYPED_CALL]})
    assert render.parse(ids, TYPED_TOOLS)["tool_calls"] == [TYPED_CALL]


@pytest.mark.peers  # TRL's copies of the templates (the [peers] extra; CI's peers tier)
def test_a_sampled_reply_with_more_calls_than_the_template_renders_goes_on_as_text(qwen3_tokenizer):
    render = _render(qwen3_tokenizer, "llama3_1")
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    close = render.renderer.get_stop_token_ids()[0]
    ids = render.tokenizer.encode(f"{one}; {one}", add_special_tokens=False) + [close]
    with pytest.raises(UnparsableAction, match="2 tool calls in one reply") as e:
        render.parse(ids)
    assert e.value.message["tool_calls"] is None and e.value.message["content"] == f"{one}; {one}"
    single = render.parse(render.tokenizer.encode(one, add_special_tokens=False) + [close])
    assert single["tool_calls"] == [{"type": "function", "function": {"name": "get_weather",
                                                                      "arguments": {"city": "Paris"}}}]
