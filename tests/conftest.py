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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (QUAERO_REQUIRE_ENGINES=1) a vllm/unsloth-tier test that skips is a failure: the engine
    was supposed to be installed, so a skip would hide a broken tier."""
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and os.environ.get("QUAERO_REQUIRE_ENGINES") == "1"
            and any(item.get_closest_marker(m) for m in ("vllm", "unsloth"))):
        report.outcome = "failed"
        report.longrepr = f"engine tier skipped in CI: {report.longrepr}"
