"""Which renderer a model gets: `[model] renderer` ("auto" by default) and `[model] renderer_options`.

- A name of `renderers==0.1.7`'s registry (`FAMILIES`) is that hand-written family's renderer; "template"
  is quaero's `TemplateRenderer` over the model's own chat template.
- "auto": the renderers family the model is one of, else the template renderer:
  1. the tokenizer's name is in renderers' `MODEL_RENDERER_MAP` (exact hub ids, e.g. `Qwen/Qwen3-8B`);
  2. its config.json `model_type` is one of `MODEL_TYPE_FAMILIES` and the tokenizer holds every token that
     family's renderer needs (`tiny-qwen3` and the Qwen3 shapes: `qwen3`, so the main job keeps
     renderers' Qwen3Renderer);
  3. otherwise the model's chat template ("template"); a tokenizer without one is refused.
- Options: the renderer's constructor keywords (Qwen3's `enable_thinking`, `preserve_all_thinking`, ...);
  for "template", `tool_format` and template variables (`enable_thinking`, `date_string`, ...). The older
  `[model] enable_thinking` key is the option `enable_thinking`.

A leaf: nothing of renderers, transformers or jinja2 is imported until a renderer is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# renderers 0.1.7's RENDERER_REGISTRY names (tests/unit/quaero/chat checks them against the package)
FAMILIES = ("default", "qwen3", "qwen3-vl", "qwen3.5", "qwen3.6", "glm-5", "glm-5.1", "glm-4.5", "minimax-m2",
            "deepseek-v3", "kimi-k2", "kimi-k2.5", "nemotron-3", "gpt-oss")
TEMPLATE = "template"
NAMES = ("auto", TEMPLATE, *FAMILIES)
# config.json model_type -> the renderers family whose template every such model ships
MODEL_TYPE_FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3"}
# the tokens a family's renderer asserts are in the vocabulary (renderers 0.1.7)
FAMILY_TOKENS = {"qwen3": ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
                           "<tool_response>", "</tool_response>")}


@dataclass(frozen=True)
class Choice:
    name: str  # a FAMILIES name or "template"
    why: str  # one clause for `quaero check`


def _has_tokens(tokenizer, tokens: tuple[str, ...]) -> bool:
    vocab = tokenizer.get_vocab()
    return all(t in vocab for t in tokens)


def choose(tokenizer, renderer: str, model_type: str | None) -> Choice:
    """The renderer for `[model] renderer` = `renderer` and this tokenizer and config.json model_type."""
    from quaero.chat.template import chat_template_of

    if renderer != "auto":
        return Choice(renderer, "named in [model] renderer")
    name = getattr(tokenizer, "name_or_path", "") or ""
    from renderers.base import MODEL_RENDERER_MAP

    if name in MODEL_RENDERER_MAP:
        return Choice(MODEL_RENDERER_MAP[name], f"auto: {name!r} is in renderers' model map")
    family = MODEL_TYPE_FAMILIES.get(model_type or "")
    if family and _has_tokens(tokenizer, FAMILY_TOKENS.get(family, ())):
        return Choice(family, f"auto: config.json model_type {model_type!r} is renderers' {family} family")
    known = f"model_type {model_type!r}" if model_type else "no config.json model_type"
    if chat_template_of(tokenizer):
        return Choice(TEMPLATE, f"auto: {known} is no renderers family, so the model's own chat template")
    return Choice(TEMPLATE, f"auto: {known} is no renderers family, and the tokenizer has no chat template")


def build(tokenizer, choice: Choice, options: dict[str, Any]):
    """The renderer of `choice`, with `options` as its constructor keywords."""
    if choice.name == TEMPLATE:
        from quaero.chat.template import TemplateRenderer

        return TemplateRenderer(tokenizer, **options)
    from renderers.base import RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    cls = RENDERER_REGISTRY.get(choice.name)
    if cls is None:
        raise ValueError(f"unknown renderer {choice.name!r}; the names are {', '.join(NAMES)}")
    if choice.name == "qwen3":  # renderers' own default, kept explicit: thinking on
        options = {"enable_thinking": True, **options}
    return cls(tokenizer, **options)
