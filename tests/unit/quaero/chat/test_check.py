"""Bad chat input at `quaero check`: one line each, before any model weights load."""
from __future__ import annotations

from pathlib import Path

import pytest

from quaero.config import ConfigError
from quaero.preflight.plan import load_checked

ROOT = Path(__file__).resolve().parents[4]
MAIN = ROOT / "envs" / "toolbench.toml"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def model_with_template(tmp_path: Path, tiny_model_dir: Path, template: str | None) -> Path:
    """tiny-qwen3's folder (linked) with `template` as its chat template (None: no template)."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


def check(folder: Path, tmp_path: Path, *more: str):
    return load_checked(MAIN, [f"model.name='{folder}'", "model.renderer='template'",
                               f"run.output_dir='{tmp_path / 'runs'}'", *more])


@pytest.mark.hostile
@pytest.mark.parametrize("template,needle", [
    (None, ("does not fit the tokenizer (the tokenizer has no chat template); give the tokenizer a chat "
           "template ([model] renderer_options chat_template) or name the renderer")),
    ("{{ raise_exception('only user and assistant roles') }}",
     "does not fit the tokenizer (the chat template raised TemplateError: only user and assistant roles)"),
    (CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{{ range(100000) | random }}"),
     "(the chat template renders the same conversation differently each time (it is not deterministic))"),
    ("{% if messages | length > 3 %}{{ raise_exception('at most 3 messages') }}{% endif %}" + CHATML,
     "cannot append an env response exactly (template_raised: the template raises on the whole conversation"),
    # hung `quaero check` in C code holding the GIL, growing to GBs, Ctrl-C ignored
    pytest.param("{% set ns = namespace(x=[1]) %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}"
                 "{% endfor %}{{ ns.x|tojson }}" + CHATML,
                 "(the chat template raised SecurityError: a list, tuple or dict literal would print as",
                 marks=pytest.mark.hostile),
    # each passed check, refused later under another name, or raised a traceback (issue 55's degraded list)
    pytest.param("{% if true %}" * 3000 + CHATML + "{% endif %}" * 3000,
                 "(the chat template nests too deep to compile (RecursionError; a template compiles at most "
                 "about 20 nested blocks); flatten it)", marks=pytest.mark.hostile),
    pytest.param("  \n ", "(the tokenizer's chat template is empty (whitespace only))",
                 marks=pytest.mark.hostile),
    pytest.param("{# nothing #}", "(the chat template renders nothing for a conversation of 1 message(s))",
                 marks=pytest.mark.hostile),
    pytest.param(CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{% if messages|length > 7 %}"
                                                      "{{ range(100000) | random }}{% endif %}"),
                 "(the chat template renders the same conversation differently each time (it is not "
                 "deterministic): 10 messages with tool calls and results)",
                 marks=pytest.mark.hostile),
    pytest.param(CHATML.replace("{{ m['content'] }}", "{{ m['content'] }}{% if m['role'] == 'tool' %}"
                                                      "{{ range(100000) | random }}{% endif %}"),
                 "(the chat template renders the same conversation differently each time (it is not "
                 "deterministic): 10 messages with tool calls and results)",
                 marks=pytest.mark.hostile),
])
def test_bad_chat_templates_are_one_line_at_check(tmp_path, tiny_model_dir, template, needle):
    folder = model_with_template(tmp_path, tiny_model_dir, template)
    with pytest.raises(ConfigError) as e:
        check(folder, tmp_path)
    line = str(e.value)
    assert "\n" not in line and needle in line, line
    assert f"[model] name='{folder}', renderer 'template' (named in [model] renderer)" in line


def test_a_template_without_an_exact_bridge_names_what_works_and_runs_without_echo(tmp_path, tiny_model_dir):
    short = "{% if messages | length > 3 %}{{ raise_exception('at most 3 messages') }}{% endif %}" + CHATML
    folder = model_with_template(tmp_path, tiny_model_dir, short)
    with pytest.raises(ConfigError) as e:
        check(folder, tmp_path)
    # the advice fits the reason: the short probes rendered, the whole conversation (history, the model's
    # reply, the env's response) raised; calls as text (tool_format = 'prompt') would still pass 3 messages
    assert ("give it a template that renders the whole conversation, the model's reply as an assistant "
            "message included ([model] renderer_options chat_template), or name a renderer that parses the "
            "reply ([model] renderer), or set [echo] enabled = false") in str(e.value)
    assert check(folder, tmp_path, "echo.enabled=false").echo.enabled is False


def test_check_says_which_renderer_was_chosen_and_why(tmp_path, tiny_model_dir):
    from quaero.preflight.check import plan_lines

    cfg = load_checked(MAIN, ["model.renderer='auto'", f"run.output_dir='{tmp_path / 'runs'}'"])
    line = next(x for x in plan_lines(cfg, str(MAIN)) if x.startswith("model"))
    assert "renderer 'qwen3' (auto: config.json model_type 'qwen3' is renderers' qwen3 family)" in line
    folder = model_with_template(tmp_path, tiny_model_dir, CHATML)
    cfg = check(folder, tmp_path)
    assert "renderer 'template' (named in [model] renderer)" in plan_lines(cfg, str(MAIN))[2]


# calls as Llama 3 writes them (one JSON object a call, "parameters"), in a template that reads `tools`
OWN_CALLS = CHATML.replace("{{ m['content'] }}", "{% if m.get('tool_calls') %}{% for c in m.tool_calls %}"
                           "{\"name\": {{ c.function.name | tojson }}, \"parameters\": "
                           "{{ c.function.arguments | tojson }}}{% endfor %}{% else %}{{ m['content'] }}"
                           "{% endif %}") + "{% if tools %}{% endif %}"


@pytest.mark.parametrize("template,said", [
    (OWN_CALLS, "tool calls llama3_json: the template's own tool calls parse back exactly"),
    (OWN_CALLS.replace("{\"name\": {{", "<call>{{").replace("}}}{% endfor %}", "}}</call>{% endfor %}"),
     "tool calls prompt (auto: the template's own tool calls parse back through none of hermes, llama3_json"),
    (CHATML, "tool calls prompt (auto: the template reads no `tools`, so calls and tool specs go as text)"),
])
def test_check_says_which_tool_call_format_the_round_trip_chose(tmp_path, tiny_model_dir, template, said):
    from quaero.preflight.check import plan_lines

    cfg = check(model_with_template(tmp_path, tiny_model_dir, template), tmp_path)
    assert said in plan_lines(cfg, str(MAIN))[2]


def test_a_template_whose_tool_calls_round_trip_nowhere_is_refused_in_one_line(tmp_path, tiny_model_dir):
    drops = CHATML.replace("{{ m['content'] }}",
                           "{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}")
    with pytest.raises(ConfigError) as e:
        check(model_with_template(tmp_path, tiny_model_dir, drops), tmp_path)
    line = str(e.value)
    assert "\n" not in line and "round-trip through this chat template neither in its own format nor" in line


@pytest.mark.hostile
def test_an_empty_chat_template_option_is_refused_not_replaced_by_the_tokenizers(tmp_path, tiny_model_dir):
    """`renderer_options.chat_template = ""` passed check on the tokenizer's own template, without a word."""
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, [f"model.name='{tiny_model_dir}'", "model.renderer='template'",
                            "model.renderer_options={chat_template=''}", f"run.output_dir='{tmp_path}'"])
    assert "([model] renderer_options.chat_template is empty; give the template's text" in str(e.value)


@pytest.mark.hostile
@pytest.mark.parametrize("base,says", [
    (None, ("downloads its vocab https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken, "
            "and this machine is offline (HF_HUB_OFFLINE=1) with no copy in ")),
    ("empty", "holds no o200k_base.tiktoken, the vocab gpt-oss's renderer (openai-harmony) loads"),
])
def test_gpt_oss_without_its_vocab_offline_is_one_line_before_any_download(tmp_path, monkeypatch, base, says):
    """`renderer = "gpt-oss"` offline tried to download openai-harmony's vocab (55 s), then a traceback."""
    from renderers import gpt_oss

    monkeypatch.setattr(gpt_oss, "load_harmony_encoding", lambda *a: pytest.fail("a download was tried"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", str(tmp_path / "cache"))
    if base:
        (tmp_path / base).mkdir()
        monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / base))
    else:
        monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, ["model.renderer='gpt-oss'", f"run.output_dir='{tmp_path / 'runs'}'"])
    assert "renderer 'gpt-oss' (named in [model] renderer): " in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)
