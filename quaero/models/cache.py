"""The model cache: where the embedded models are materialized (`$QUAERO_CACHE/models/NAME-VERSION`, default
`~/.cache/quaero`) as ordinary Hugging Face model folders that transformers, vLLM and unsloth load, built once
(atomically) on first use and announced with their size first.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from quaero.models.registry import named_models


def cache_dir() -> Path:
    root = os.environ.get("QUAERO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "quaero")
    return Path(root)

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
