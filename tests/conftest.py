"""Shared test setup: offline hub, one model cache for the session, the real tiny-qwen3 and tokenizer."""
import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("QUAERO_CACHE", os.path.join(tempfile.gettempdir(), "quaero-test-cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The embedded default model folder (built once per cache)."""
    from quaero.model import materialize_tiny_qwen3

    return materialize_tiny_qwen3()


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_model_dir):
    from quaero.model import load_tokenizer

    return load_tokenizer("tiny-qwen3")
