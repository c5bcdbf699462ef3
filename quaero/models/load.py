"""Model and tokenizer loading: a model name (an embedded model, a local folder or a hub id) to a folder, its
config fields, its tokenizer (shared within the process) and its causal LM on a device.

Real ids (`Qwen/Qwen3-0.6B`) and local folders go through the same `resolve_model` as the embedded models
(quaero/models/registry.py, built into the cache by quaero/models/cache.py). With the hub unreachable or
`HF_HUB_OFFLINE=1`, a missing model fails fast with one line that names the id, what was tried and how to fix
it.
"""
from __future__ import annotations

import os
from pathlib import Path

from quaero.models.base import ModelNotFound
from quaero.models.cache import materialize_named
from quaero.models.folders import folder_problem
from quaero.models.registry import is_named, named_models


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
    from quaero.models.config import read_config

    return read_config(path)  # ModelConfigError (one line) for a config no plan can be computed from


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
