"""Templates the renderer refused before and trains on exactly now, each a small template written the way a
real family's is: Phi-3's (eos after the last turn when no generation prompt is asked), Gemma 1's (raises on a
system message), a Qwen3.5-style thinking one (the turn's `<think>\\n\\n</think>` merges with the generation
prompt's `<think>\\n` into other tokens) and a multimodal one (SmolVLM's / Idefics3's: message text only as a
list of text parts). Each: the RenderAdapter builds (before: AssertionError, TemplateProblem or ValueError at
check), says how it fitted the conversation, and the toy env's oracle episodes are exact (every response
captured as ECHO tokens, 0 bridge fallbacks), each turn equal to the template's own render."""
from __future__ import annotations

import pytest
from fixtures.chat_cases import template_tokens
from fixtures.parity import template_parity
from fixtures.rollout import assert_exact, drive, spans_of

from quaero.config import ModelConfig
from quaero.rollout.render import RenderAdapter

PHI = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")
GEMMA = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}"
         "{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
THINKS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}<think>\n{{ m.get('reasoning_content') or '' }}\n</think>\n\n"
          "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
# DeepSeek R1/V3's way (Nemotron 3's is alike): the generation prompt opens `<think>\n`, a finished turn
# renders without its think block, and a tool result after an earlier one renders otherwise (R1's
# `<｜tool▁outputs▁begin｜>` on the conversation's first only: here a `#2` on the second)
DROPS = ("{% set ns = namespace(tools=0) %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{% if m['role'] == 'tool' %}{% set ns.tools = ns.tools + 1 %}{% if ns.tools > 1 %}#2 {% endif %}"
         "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
PARTS = ("{% for m in messages %}{{ m['role'].capitalize() }}: {% for part in m['content'] %}"
         "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n"
         "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
# template -> what it gets: (the adaptations said at check, or none)
RESCUED = {
    "phi3": (PHI, []),
    "gemma": (GEMMA, ["system prompt folded into the first user turn (the template has no system role)"]),
    "thinks": (THINKS, []),
    "drops": (DROPS, []),
    "parts": (PARTS, [("message text sent as a list of text parts (the template reads no plain string "
                       "content)")]),
}


def adapter(tokenizer, source: str) -> RenderAdapter:
    return RenderAdapter(template_tokens(tokenizer, source),
                         ModelConfig(renderer="template", renderer_options={"chat_template": source}))


@pytest.mark.parametrize("name", sorted(RESCUED))
def test_a_template_refused_before_plays_exact_episodes(qwen3_tokenizer, name):
    source, said = RESCUED[name]
    render = adapter(qwen3_tokenizer, source)
    assert render.renderer.adaptations == said
    eps, audit = drive(render, tasks=3)
    assert all(ep.success and not ep.dropped for ep in eps), [ep.drop_reason for ep in eps]
    assert audit["bridge_fallbacks"] == 0
    for ep in eps:
        assert_exact(render, ep)
    # every bridged turn against transformers' own render of the whole conversation (an independent renderer)
    tally = template_parity(render.tokenizer, source, n=6)
    assert tally.bridges > 0 and tally.mismatches == tally.merged_text_mismatches == 0, tally.line(name)
    assert not tally.refused and tally.rejected == 0, tally.line(name)


def test_phi3s_generation_prompt_is_what_follows_the_shared_part_not_its_eos(qwen3_tokenizer):
    render = adapter(qwen3_tokenizer, PHI)
    assert render.tokenizer.decode(render.generation_prompt) == "<|assistant|>\n"
    call = {"role": "assistant", "content": "hi"}
    ids = render.encode_assistant([{"role": "user", "content": "x"}], None, call)
    assert render.tokenizer.decode(ids) == "hi<|end|>"  # the turn through its close, not the eos after it


def test_a_merged_thinking_turn_is_the_text_after_the_prompt_as_a_sampler_returns_it(qwen3_tokenizer):
    render = adapter(qwen3_tokenizer, THINKS)
    chat = [{"role": "user", "content": "x"}]
    prompt = render.prompt_ids(chat, None)
    full = render.renderer.render_ids([*chat, {"role": "assistant", "content": "hi"}])
    assert full[:len(prompt)] != prompt  # `<think>\n` + `\n</think>`: tokens merge across the prompt's end
    ids = render.encode_assistant(chat, None, {"role": "assistant", "content": "hi"})
    assert render.tokenizer.decode(full).startswith(render.tokenizer.decode(prompt + ids))
    assert ids == render.tokenizer.encode("\n</think>\n\nhi<|im_end|>", add_special_tokens=False)


def test_a_turn_that_does_not_extend_the_generation_prompt_closes_the_think_block_it_was_given(
        qwen3_tokenizer):
    """The model is prompted with `<think>\\n` and its turn renders without it (DeepSeek R1/V3, Nemotron 3;
    refused at check before): a demo's reply closes the block, its reasoning kept, and parses back."""
    render = adapter(qwen3_tokenizer, DROPS)
    chat = [{"role": "user", "content": "x"}]
    for reasoning, reply in ((None, "\n</think>\n\nhi<|im_end|>"), ("so", "so\n</think>\n\nhi<|im_end|>")):
        ids = render.encode_assistant(chat, None, {"role": "assistant", "content": "hi",
                                                   "reasoning_content": reasoning})
        assert render.tokenizer.decode(ids) == reply
        parsed = render.parse(ids, None)
        assert parsed["content"].strip() == "hi" and parsed["reasoning_content"] == reasoning


def test_a_reasoning_dropping_template_starts_a_row_at_each_turn_and_bridges_as_the_next_prompt_renders(
        qwen3_tokenizer):
    """Each next prompt renders the reply without its think block, so each turn starts a new row
    (`history_rerendered`), never a guess; the second tool result's `#2` comes from the template's render of
    the whole conversation (the bridge's synthetic history holds one tool result: a `template_mismatch`
    fallback before)."""
    render = adapter(qwen3_tokenizer, DROPS)
    eps, audit = drive(render, tasks=2)
    assert audit["bridge_fallbacks"] == 0 and audit["prefix_mismatches"] == 0
    for ep in eps:
        assert len(ep.transitions) >= 2 and len(ep.rows) == len(ep.transitions)
        bridged = [render.tokenizer.decode(row.input_ids[a.end:]) for row, a in spans_of(ep, "action")]
        opens = render.tokenizer.decode(render.generation_prompt)
        for tail, after in zip(bridged, ep.transitions[1:]):  # the next prompt's, after the reply as rendered
            assert render.tokenizer.decode(after.prompt_ids).endswith(tail + opens)
        assert "#2 " not in bridged[0] and "#2 " in bridged[1]
    assert audit["packing_break_reason_history_rerendered"] == sum(len(ep.rows) - 1 for ep in eps)


