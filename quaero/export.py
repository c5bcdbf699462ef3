"""What a run leaves for the world: a Hugging Face model folder, or a PEFT adapter folder.

- Full fine-tune: config.json, model.safetensors (sharded above 5GB), generation_config.json, the
  tokenizer files and chat template: `AutoModelForCausalLM.from_pretrained(OUT)` loads it, vLLM serves it.
- LoRA: adapter_config.json + adapter_model.safetensors (+ the tokenizer):
  `PeftModel.from_pretrained(base, OUT)` loads it; `merge` folds the adapter into the base weights and
  writes a full folder instead.

`runs/NAME/final/` is written this way at the end of every finished run; `quaero export RUN [--step N]`
writes any kept checkpoint. A folder is written under a temporary name and renamed into place, so a crash
never leaves half a model under the final name.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from quaero.config import QuaeroConfig, error_line
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

MAX_SHARD_SIZE = "5GB"  # the Hub's usual shard size; transformers, PEFT and vLLM read shards alike


class ExportError(RuntimeError):
    """A run or checkpoint that cannot be exported; the message is one line for the user."""


def base_reference(model_name: str) -> str:
    """How an adapter folder names its base model: the hub id as written, or a local folder's absolute
    path (the embedded `tiny-qwen3` is such a folder, in quaero's cache)."""
    from quaero.model import TINY_QWEN3, resolve_model

    if model_name == TINY_QWEN3 or Path(model_name).expanduser().exists():
        return str(resolve_model(model_name).resolve())
    return model_name


def save_model(model, tokenizer, out: Path, *, base_name: str, merge: bool = False, replace: bool = False) -> Path:
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
    except OSError as e:  # a read-only or full filesystem, a parent that is a file: nothing half-written stays
        raise ExportError(f"{out}: cannot write the model there ({e.strerror or e}"
                          f"{f': {e.filename}' if e.filename else ''}); choose a writable folder with room for "
                          "it") from None
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
    from quaero import ranks
    from quaero.model import load_causal_lm, load_tokenizer

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
    log.info("final_saved", path=str(out), lora=hasattr(trainer.model, "peft_config"))
    return out


def run_config(run_dir: Path) -> QuaeroConfig:
    """The resolved config a run was started with (`runs/NAME/config.json`)."""
    path = Path(run_dir) / names.CONFIG
    if not path.exists():
        raise ExportError(f"{path}: not found; RUN must be a run folder that `quaero train` wrote (runs/NAME)")
    try:
        return QuaeroConfig.model_validate_json(path.read_text())
    except ValueError:  # pydantic's ValidationError: a model folder's config.json, say
        raise ExportError(f"{path}: not a quaero run config; RUN must be a run folder that `quaero train` "
                          "wrote (runs/NAME)") from None


def load_checkpoint(run_dir: Path, step: int | None = None) -> tuple[int, dict]:
    """(step, state) of the run's checkpoint at `step`, or of its newest intact one (`checkpoint_path`
    names its folder, where a sharded checkpoint keeps its shards)."""
    from quaero import checkpoint

    root = Path(run_dir) / names.CHECKPOINTS
    kept = sorted(p.name for p in root.glob("step-*"))
    if step is None:
        try:
            found = checkpoint.load_latest(root)
        except checkpoint.NoIntactCheckpoint as e:
            raise ExportError(f"{e}; train the run again (quaero train CONFIG --restart)") from None
        if found is None:
            raise ExportError(f"{root}: no intact checkpoint; train the run first (quaero train CONFIG)")
        return found[1]["step"], found[1]
    path = root / names.step_folder_name(step)
    if not path.exists():
        raise ExportError(f"{run_dir} --step {step}: no such checkpoint; kept: {', '.join(kept) or 'none'}")
    try:
        return step, checkpoint.load(path)
    except ValueError as e:
        raise ExportError(str(e)) from None


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / names.CHECKPOINTS / names.step_folder_name(step)


def build_trainer(cfg: QuaeroConfig):
    """The run's trainer as quaero/train.py builds it, on the CPU: exporting needs no accelerator."""
    from quaero.plan import trainer_spec
    from trainers.registry import trainer_class

    return trainer_class(cfg.backend.backend)(trainer_spec(cfg), "cpu")


def export_run(run_dir: Path, out: Path, *, step: int | None = None, merge: bool = False) -> Path:
    """A run's checkpoint (`step`, default the newest) as a model folder at `out`."""
    from quaero import checkpoint
    from quaero.model import load_tokenizer

    cfg = run_config(run_dir)
    step, state = load_checkpoint(run_dir, step)
    check_destination(Path(out))
    trainer = build_trainer(cfg)  # one process: a sharded checkpoint's shards are read whole (gathered)
    path = checkpoint_path(run_dir, step)
    try:  # the manifest vouches for the bytes, not for what they hold (a crafted or foreign state)
        trainer.load_state_dict(state["backend"], shards=path / checkpoint.SHARDS)
    except Exception as e:  # noqa: BLE001 - any failure here means: this checkpoint cannot be exported
        raise ExportError(f"{path}: verified but cannot be loaded into {cfg.model.name!r} ({error_line(e)}); "
                          "export another step with --step") from None
    save_model(trainer.model, load_tokenizer(cfg.model.name), out, base_name=cfg.model.name, merge=merge)
    log.info("exported", run_dir=str(run_dir), step=step, out=str(out), lora=cfg.backend.lora and not merge)
    return Path(out)


def is_adapter(folder: Path) -> bool:
    return (Path(folder) / "adapter_config.json").exists()


def load_model(folder: Path, dtype: str = "float32", device: str = "cpu"):
    """The inverse of save_model: a full folder, or an adapter folder merged onto its base, as a plain
    transformers causal LM."""
    from quaero.model import load_causal_lm

    folder = Path(folder)
    if not is_adapter(folder):
        return load_causal_lm(str(folder), dtype, device)
    import json

    from peft import PeftModel

    base_name = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = load_causal_lm(base_name, dtype, device)
    return PeftModel.from_pretrained(base, folder).merge_and_unload()
