"""A model folder's config.json, read and judged before anything is built from it.

A folder is input from anyone: its config.json may be no JSON object (a list, nested 200,000 deep), name its
architecture in the wrong shape, or give sizes that are strings, floats, zero, negative or absurd. Every
size quaero computes with (the shape check of `quaero.models.folders.folder_problem`, the memory plan of
quaero/preflight/memory_plan.py) is validated here first, so `num_hidden_layers = 10**12` is one line, not a
loop that exhausts memory, and a negative size never prints a negative plan. The tokenizer files a folder
must hold are named here too: a folder without them is told so, not blamed on the renderer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.json"
MAX_CONFIG_BYTES = 4 << 20  # a model's config.json is a few KB; a file past this is no model config

# (config.json key, the largest value quaero takes): ten times the largest published decoders' (Llama 3.1
# 405B: hidden 16,384, 126 layers, 128 heads, FFN 53,248; vocabularies up to ~262k), so any real model passes
SIZES: dict[str, int] = {"hidden_size": 1 << 17, "num_hidden_layers": 2048, "num_attention_heads": 2048,
                         "intermediate_size": 1 << 20, "vocab_size": 1 << 24}
OPTIONAL_SIZES: dict[str, int] = {"num_key_value_heads": 2048, "head_dim": 1 << 14}
# The config.json model types quaero supports, written once: their decoder layout is the one
# quaero/models/folders.py checks the weights' shapes against and the memory plan
# (quaero/preflight/memory_plan.py) counts (Qwen3's QK-norm, Qwen2's q/k/v biases, tied or untied
# embeddings), and every size of theirs quaero computes with is validated here. Embedded models of two of
# them: Qwen3 (quaero/models/qwen3.py) and Llama (the SmolLM2 family, quaero/models/smollm2.py).
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")

# what a tokenizer is read from: the fast tokenizer's file, SentencePiece's model, BPE's vocabulary, tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


class ModelConfigError(ValueError):
    """A config.json quaero will not build from; the message is one line naming the file, key and fix."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def size_problem(cfg: dict) -> str | None:
    """What is wrong with the sizes of a config.json's fields, in words naming the key (None when they are
    sane): each an integer (not a string, float or bool) from 1 to its bound; the sizes a Qwen/Llama-style
    layout needs all present; the heads dividing evenly."""
    required = cfg.get("model_type") in SUPPORTED_MODEL_TYPES
    for key, bound in (*SIZES.items(), *OPTIONAL_SIZES.items()):
        v = cfg.get(key)
        if v is None:
            if required and key in SIZES:
                return f"lacks {key} for a {cfg.get('model_type')} model"
            continue
        if not _is_int(v):
            return f"{key}={_short(v)} is a {type(v).__name__}, not an integer"
        if not 1 <= v <= bound:
            return f"{key}={_short(v)} is outside 1..{bound:,}"
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if _is_int(heads) and _is_int(kv) and heads % kv:
        return f"num_key_value_heads={kv} does not divide num_attention_heads={heads}"
    hidden = cfg.get("hidden_size")
    if _is_int(hidden) and _is_int(heads) and cfg.get("head_dim") is None and hidden % heads:
        return f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} (and no head_dim set)"
    if "tie_word_embeddings" in cfg and not isinstance(cfg["tie_word_embeddings"], bool):
        return f"tie_word_embeddings={_short(cfg['tie_word_embeddings'])} is not true or false"
    return None


def architecture(cfg: dict) -> str | None:
    """The config's architecture (`architectures[0]`), None when it names none; ModelConfigError's words
    (ValueError) when `architectures` is not a list of class names."""
    archs = cfg.get("architectures")
    if archs is None or archs == []:
        return None
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"architectures={_short(archs)} is not a list of class names, e.g. "
                         "[\"Qwen3ForCausalLM\"]")
    return archs[0]


def read_config(path: Path) -> dict:
    """`path` (a model folder's config.json) as a dict whose sizes and architecture are sane; ModelConfigError
    in one line otherwise, before any shape is built from it."""
    fix = "restore the folder's config.json (the one that came with its weights)"
    try:
        if (size := path.stat().st_size) > MAX_CONFIG_BYTES:
            raise ModelConfigError(f"{path} is {size:,} bytes, no model config (a few KB); {fix}")
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{path} cannot be read as JSON ({_short(str(e), 160)}); {fix}") from None
    except RecursionError:
        raise ModelConfigError(f"{path} is nested too deep to be a model config; {fix}") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path} holds a JSON {type(cfg).__name__}, not an object of model settings; "
                               f"{fix}")
    if "model_type" in cfg and not isinstance(cfg["model_type"], str):
        raise ModelConfigError(f"{path}: model_type={_short(cfg['model_type'])} is not a name; {fix}")
    try:
        architecture(cfg)
    except ValueError as e:
        raise ModelConfigError(f"{path}: {e}; {fix}") from None
    if problem := size_problem(cfg):
        raise ModelConfigError(f"{path}: {problem}; {fix}")
    return cfg


def tokenizer_problem(folder: Path) -> str | None:
    """Why `folder` holds no tokenizer (None when it holds one of TOKENIZER_FILES or a *.tiktoken file)."""
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return None
    return (f"{folder} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer "
            "files of the model into the folder (tokenizer.save_pretrained(folder))")


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else f"{text[:limit]}..."
