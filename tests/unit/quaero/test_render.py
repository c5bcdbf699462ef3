"""RenderAdapter over renderers 0.1.7 with the real Qwen3 renderer and the offline Qwen tokenizer."""
from __future__ import annotations

import pytest

from quaero.config import ModelConfig
from quaero.render import WORD_JOINER, BridgeFailure, RenderAdapter

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
CALL = {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


@pytest.fixture(scope="module")
def render(qwen3_tokenizer):
    return RenderAdapter(qwen3_tokenizer, ModelConfig())


def dec(render, ids) -> str:
    return render.tokenizer.decode(ids)


def test_renderer_is_named_explicitly_and_thinking_switch_is_forwarded(qwen3_tokenizer):
    with pytest.raises(ValueError, match="name the renderer explicitly"):
        RenderAdapter(qwen3_tokenizer, ModelConfig(renderer="auto"))
    think = RenderAdapter(qwen3_tokenizer, ModelConfig(enable_thinking=True))
    plain = RenderAdapter(qwen3_tokenizer, ModelConfig(enable_thinking=False))
    assert dec(think, think.generation_prompt) == "<|im_start|>assistant\n"
    assert dec(plain, plain.generation_prompt) == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert think.stop_token_ids == [151645, 151643]


def test_prompt_is_the_full_render_with_tools_and_generation_prompt(render):
    ids = render.prompt_ids(CHAT, TOOLS)
    text = dec(render, ids)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"get_weather"' in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_encode_assistant_gives_sampled_style_ids_that_parse_back(render):
    ids = render.encode_assistant(CHAT, TOOLS, CALL)
    assert ids[-1] == 151645 and dec(render, ids).startswith("<think>\nI should call the tool.\n</think>\n\n<tool_call>")
    assert render.parse(ids) == {**CALL, "content": ""}
    plain = RenderAdapter(render.tokenizer, ModelConfig(enable_thinking=False))
    with pytest.raises(ValueError, match="does not extend"):  # reasoning cannot follow a pre-filled empty think
        plain.encode_assistant(CHAT, TOOLS, CALL)


def test_bridge_keeps_the_prefix_and_labels_content_scaffold_and_strips_the_next_prompt(render):
    prompt = render.prompt_ids(CHAT, TOOLS)
    action = render.encode_assistant(CHAT, TOOLS, CALL)
    tool = {"role": "tool", "content": "sunny, 21C"}
    b = render.bridge(prompt, action, [tool], TOOLS)
    env = [t for t, k in zip(b.response_ids, b.response_kinds) if k == "env"]
    scaffold = [t for t, k in zip(b.response_ids, b.response_kinds) if k == "scaffold"]
    assert dec(render, env) == "sunny, 21C"
    assert dec(render, scaffold) == "\n<|im_start|>user\n<tool_response>\n\n</tool_response><|im_end|>\n"
    # the bridged stream (plus the next generation prompt) is exactly the next full render here
    full = render.prompt_ids([*CHAT, render.parse(action), tool], TOOLS)
    assert prompt + action + b.response_ids + render.generation_prompt == full


@pytest.mark.parametrize("content", ["A", "Z", "Zürich: 21C\n", "\n\nAnother\n", "x" * 300, "<tool_call>"])
def test_content_attribution_survives_sentinel_clashes_and_boundary_merges(render, content):
    prompt = render.prompt_ids(CHAT, TOOLS)
    action = render.encode_assistant(CHAT, TOOLS, CALL)
    b = render.bridge(prompt, action, [{"role": "tool", "content": content}], TOOLS)
    env = [t for t, k in zip(b.response_ids, b.response_kinds) if k == "env"]
    kinds = "".join("e" if k == "env" else "s" for k in b.response_kinds)
    assert kinds.strip("s") == "e" * len(env)  # one contiguous content run
    env_text = dec(render, env).replace(WORD_JOINER, "")  # an added-token string in content is defused text
    assert content.strip("\n") in env_text and "<tool_response>" not in env_text.replace(content, "")


def test_consecutive_tool_messages_and_corrective_kind(render):
    prompt = render.prompt_ids(CHAT, TOOLS)
    action = render.encode_assistant(CHAT, TOOLS, CALL)
    b = render.bridge(prompt, action, [{"role": "tool", "content": "sunny"}, {"role": "tool", "content": "windy"}],
                      TOOLS)
    runs = [dec(render, [t for t, k in zip(b.response_ids, b.response_kinds) if k == "env"])]
    assert runs == ["sunnywindy"] and dec(render, b.response_ids).count("<|im_start|>user") == 1
    c = render.bridge(prompt, action, [{"role": "user", "content": "Call a tool, please."}], TOOLS,
                      content_kind="corrective")
    assert set(c.response_kinds) == {"scaffold", "corrective"}
    assert dec(render, [t for t, k in zip(c.response_ids, c.response_kinds) if k == "corrective"]) == \
        "Call a tool, please."


def test_truncated_action_gets_a_synthetic_close_as_scaffold(render):
    prompt = render.prompt_ids(CHAT, TOOLS)
    action = render.encode_assistant(CHAT, TOOLS, CALL)[:5]  # cut mid-thought, no <|im_end|>
    b = render.bridge(prompt, action, [{"role": "user", "content": "Too long."}], TOOLS, content_kind="corrective")
    assert b.response_ids[0] == 151645 and b.response_kinds[0] == "scaffold"


def test_bridge_refusals_are_failures_with_reasons(render):
    prompt = render.prompt_ids(CHAT, TOOLS)
    action = render.encode_assistant(CHAT, TOOLS, CALL)
    with pytest.raises(BridgeFailure) as e:  # 0.1.7 refuses an assistant message in the extension
        render.bridge(prompt, action, [{"role": "assistant", "content": "hi"}], TOOLS)
    assert e.value.reason == "unsupported"
