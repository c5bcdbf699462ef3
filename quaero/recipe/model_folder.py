"""What a run leaves for the world: a Hugging Face model folder, or a PEFT adapter folder.

- Full fine-tune: config.json, model.safetensors (sharded above 5GB), generation_config.json, the
  tokenizer files and chat template: `AutoModelForCausalLM.from_pretrained(OUT)` loads it, vLLM serves it.
- LoRA: adapter_config.json + adapter_model.safetensors (+ the tokenizer):
  `PeftModel.from_pretrained(base, OUT)` loads it; `merge` folds the adapter into the base weights and
  writes a full folder instead.

`runs/NAME/final/` is written this way at the end of every finished run (`save_final`, called by the recipe);
`quaero export RUN [--step N]` (quaero/tools/export.py) writes any kept checkpoint. A folder is written under
a temporary name and renamed into place, so a crash never leaves half a model under the final name.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from quaero.config import QuaeroConfig
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

MAX_SHARD_SIZE = "5GB"  # the Hub's usual shard size; transformers, PEFT and vLLM read shards alike


class ExportError(RuntimeError):
    """A run or checkpoint that cannot be exported; the message is one line for the user."""


def base_reference(model_name: str) -> str:
    """How an adapter folder names its base model: the hub id as written, or a local folder's absolute
    path (the embedded models, `tiny-qwen3` and the real shapes, are such folders, in quaero's cache)."""
    from quaero.models.load import resolve_model
    from quaero.models.registry import is_named

    if is_named(model_name) or Path(model_name).expanduser().exists():
        return str(resolve_model(model_name).resolve())
    return model_name


def save_model(model, tokenizer, out: Path, *, base_name: str, merge: bool = False,
               replace: bool = False) -> Path:
    """Write `model` (a transformers causal LM, PEFT-wrapped for LoRA) and `tokenizer` to `out`.

    merge: fold a LoRA adapter into the base weights (in place: `model` is spent) and write a full folder.
    replace: overwrite an existing `out` (run folders' final/); otherwise an existing, non-empty `out`
    is refused so an export never mixes two models' files."""
    out = Path(out)
    check_destination(out, replace=replace)
    is_lora = hasattr(model, "peft_config")
    if is_lora and merge:
        model, is_lora = model.merge_and_unload(), False
    if is_lora:
        for adapter in model.peft_config.values():
            adapter.base_model_name_or_path = base_reference(base_name)
    config = model.config  # a PEFT model forwards to its base model's
    use_cache, tmp = config.use_cache, None
    config.use_cache = True  # training turns the KV cache off; whoever loads the folder generates with it
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        if is_lora:
            # only LoRA weights train (the embeddings stay the base's), so the adapter is all there is to save
            model.save_pretrained(tmp, save_embedding_layers=False)
        else:
            model.save_pretrained(tmp, max_shard_size=MAX_SHARD_SIZE)
        tokenizer.save_pretrained(tmp)
        _move_into_place(tmp, out)
    # a read-only or full filesystem, a parent that is a file: nothing half-written stays
    except OSError as e:
        raise ExportError(f"{out}: cannot write the model there ({e.strerror or e}"
                          f"{f': {e.filename}' if e.filename else ''}); choose a writable folder with room "
                          "for it") from None
    finally:
        config.use_cache = use_cache
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_destination(out: Path, *, replace: bool = False) -> None:
    """`out` can take an export: not a file, and empty unless `replace`; before any model loads."""
    existing = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "" if existing == out else f" ({existing})"
        raise ExportError(f"{out}: a file{where}, not a folder; name a new folder for the export")
    if out.exists() and any(out.iterdir()) and not replace:
        raise ExportError(f"{out}: folder exists and is not empty; choose a new output folder or delete it")


def _move_into_place(tmp: Path, out: Path) -> None:
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
        out.rename(old / out.name)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_final(trainer, cfg: QuaeroConfig) -> Path | None:
    """`runs/NAME/final/` from the live trainer at the end of a finished run (the adapter for LoRA).

    Under torchrun every rank calls it and rank 0 writes (None elsewhere); a sharded (FSDP2) trainer's
    whole weights are gathered first (a collective) into a plain copy of the model."""
    from quaero.models.load import load_causal_lm, load_tokenizer
    from quaero.recipe import ranks

    model = trainer.model
    if trainer.sharded:
        weights = trainer.export_weights()
        if ranks.is_main():
            model = load_causal_lm(cfg.model.name, cfg.model.dtype, "cpu")
            model.load_state_dict(weights)
    if not ranks.is_main():
        return None
    out = save_model(model, load_tokenizer(cfg.model.name), cfg.run_dir / names.FINAL,
                     base_name=cfg.model.name, replace=True)
    log.info(names.FINAL_SAVED_EVENT, path=str(out), lora=hasattr(trainer.model, "peft_config"))
    return out
