"""Which renderer a model gets (quaero/chat/registry.py): renderers' own family names, and `auto`'s choice
with its reason."""
from __future__ import annotations

from quaero.chat import registry


def test_the_registry_names_are_renderers_own():
    from renderers.base import RENDERER_REGISTRY, _populate_registry

    _populate_registry()
    assert set(registry.FAMILIES) == set(RENDERER_REGISTRY)


def test_auto_gives_qwen3_models_renderers_qwen3_and_any_other_model_its_own_template(qwen3_tokenizer,
                                                                                      smollm2_tokenizer):
    assert registry.choose(qwen3_tokenizer, "auto", "qwen3").name == "qwen3"
    assert registry.choose(qwen3_tokenizer, "auto", "qwen2").name == "template"  # Qwen2.5: another template
    smol = registry.choose(smollm2_tokenizer, "auto", "llama")
    assert smol.name == "template" and "model_type 'llama'" in smol.why and "own chat template" in smol.why
    # a qwen3 model_type without Qwen3's tokens is not Qwen3Renderer's (it asserts them)
    assert registry.choose(smollm2_tokenizer, "auto", "qwen3").name == "template"
    named = registry.choose(qwen3_tokenizer, "template", "qwen3")
    assert named == registry.Choice("template", "named in [model] renderer")
