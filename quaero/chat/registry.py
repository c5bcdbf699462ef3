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

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
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

# gpt-oss's renderer loads openai-harmony's o200k vocab: from TIKTOKEN_ENCODINGS_BASE, else from its cache
# (named by the URL's sha1, in TIKTOKEN_RS_CACHE_DIR or the temp folder's tiktoken-rs-cache), else downloaded
HARMONY_VOCAB = "o200k_base.tiktoken"
HARMONY_VOCAB_URL = f"https://openaipublic.blob.core.windows.net/encodings/{HARMONY_VOCAB}"


class RendererUnavailable(ValueError):
    """A renderer that cannot be built on this machine (one line: why, and the fix)."""


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
    if choice.name == "gpt-oss" and (problem := harmony_vocab_problem()):
        raise RendererUnavailable(problem)
    from renderers.base import RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    cls = RENDERER_REGISTRY.get(choice.name)
    if cls is None:
        raise ValueError(f"unknown renderer {choice.name!r}; the names are {', '.join(NAMES)}")
    if choice.name == "qwen3":  # renderers' own default, kept explicit: thinking on
        options = {"enable_thinking": True, **options}
    if choice.name != "gpt-oss":
        return cls(tokenizer, **options)
    try:
        return cls(tokenizer, **options)
    except RuntimeError as e:  # openai_harmony.HarmonyError: its vocab's download failed
        raise RendererUnavailable(f"gpt-oss's renderer could not load its vocab ({str(e)[:160]}); set "
                                  f"TIKTOKEN_ENCODINGS_BASE to a folder holding {HARMONY_VOCAB}") from None


def harmony_vocab_problem() -> str | None:
    """Why gpt-oss's renderer cannot load its vocab here without a download that cannot succeed (offline: it
    retried for a minute, then raised a traceback); None where the vocab is there, or may be downloaded."""
    if base := os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
        if (Path(base) / HARMONY_VOCAB).is_file():
            return None
        return (f"TIKTOKEN_ENCODINGS_BASE={base} holds no {HARMONY_VOCAB}, the vocab gpt-oss's renderer "
                "(openai-harmony) loads; put the file there")
    cache = Path(os.environ.get("TIKTOKEN_RS_CACHE_DIR") or Path(tempfile.gettempdir()) / "tiktoken-rs-cache")
    if (cache / hashlib.sha1(HARMONY_VOCAB_URL.encode()).hexdigest()).is_file():  # harmony's own name
        return None
    if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", "", "false"):
        return None  # online: harmony downloads it (an error then is caught where the renderer is built)
    return (f"gpt-oss's renderer (openai-harmony) downloads its vocab {HARMONY_VOCAB_URL}, and this machine "
            f"is offline (HF_HUB_OFFLINE=1) with no copy in {cache}; download the file on a connected "
            "machine into a folder and set TIKTOKEN_ENCODINGS_BASE to that folder")
