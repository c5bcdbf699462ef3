"""A model folder judged from its files alone (no weights read): config.json, the safetensors shards' headers,
and for the supported layouts (`SUPPORTED_MODEL_TYPES`) every weight's shape against the config's."""
from __future__ import annotations

from pathlib import Path

from quaero.models.config import SUPPORTED_MODEL_TYPES


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

    from quaero.models.config import ModelConfigError, architecture, read_config

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
