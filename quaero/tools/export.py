"""`quaero export RUN [--step N] [--merge] OUT`: a run's checkpoint as a Hugging Face model folder or a PEFT
adapter folder, written as quaero/recipe/model_folder.py writes a finished run's `final/`; and `load_model`,
its inverse, for `quaero eval`.
"""
from __future__ import annotations

import json
from pathlib import Path

from quaero.config import QuaeroConfig
from quaero.config.renamed import migrate
from quaero.recipe.model_folder import ExportError, check_destination, save_model
from quaero.telemetry import names
from quaero.telemetry.runlog import error_line, get_logger

log = get_logger(__name__)

def run_config(run_dir: Path) -> QuaeroConfig:
    """The resolved config a run was started with (`runs/NAME/config.json`)."""
    path = Path(run_dir) / names.CONFIG
    if not path.exists():
        raise ExportError(f"{path}: not found; RUN must be a run folder that `quaero train` wrote "
                          "(runs/NAME)")
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            migrate(data, str(path), dump=True)  # a run written with [training]'s old loss keys
        return QuaeroConfig.model_validate(data)
    except ValueError:  # JSON's or pydantic's ValidationError: a model folder's config.json, say
        raise ExportError(f"{path}: not a quaero run config; RUN must be a run folder that `quaero train` "
                          "wrote (runs/NAME)") from None


def load_checkpoint(run_dir: Path, step: int | None = None) -> tuple[int, dict]:
    """(step, state) of the run's checkpoint at `step`, or of its newest intact one
    (`checkpoint.run_checkpoint` names its folder, where a sharded checkpoint keeps its shards)."""
    from quaero.recipe import checkpoint

    root = checkpoint.run_checkpoints(run_dir)
    kept = sorted(p.name for p in root.glob("step-*"))
    if step is None:
        try:
            found = checkpoint.load_latest(root)
        except checkpoint.NoIntactCheckpoint as e:
            raise ExportError(f"{e}; train the run again (quaero train CONFIG --restart)") from None
        if found is None:
            raise ExportError(f"{root}: no intact checkpoint; train the run first (quaero train CONFIG)")
        return found[1]["step"], found[1]
    path = checkpoint.run_checkpoint(run_dir, step)
    if not path.exists():
        raise ExportError(f"{run_dir} --step {step}: no such checkpoint; kept: {', '.join(kept) or 'none'}")
    try:
        return step, checkpoint.load(path)
    except ValueError as e:
        raise ExportError(str(e)) from None


def build_trainer(cfg: QuaeroConfig):
    """The run's trainer as quaero/recipe/parts.py builds it, on the CPU: exporting needs no accelerator."""
    from quaero.preflight.plan import trainer_spec
    from trainers.registry import trainer_class

    return trainer_class(cfg.backend.backend)(trainer_spec(cfg), "cpu")


def export_run(run_dir: Path, out: Path, *, step: int | None = None, merge: bool = False) -> Path:
    """A run's checkpoint (`step`, default the newest) as a model folder at `out`."""
    from quaero.models.load import load_tokenizer
    from quaero.recipe import checkpoint

    cfg = run_config(run_dir)
    step, state = load_checkpoint(run_dir, step)
    check_destination(Path(out))
    trainer = build_trainer(cfg)  # one process: a sharded checkpoint's shards are read whole (gathered)
    path = checkpoint.run_checkpoint(run_dir, step)
    try:  # the manifest vouches for the bytes, not for what they hold (a crafted or foreign state)
        trainer.load_state_dict(checkpoint.RunState.from_state(state).trainer,
                                shards=path / checkpoint.SHARDS)
    except Exception as e:  # noqa: BLE001 - any failure here means: this checkpoint cannot be exported
        raise ExportError(f"{path}: verified but cannot be loaded into {cfg.model.name!r} ({error_line(e)}); "
                          "export another step with --step") from None
    save_model(trainer.model, load_tokenizer(cfg.model.name), out, base_name=cfg.model.name, merge=merge)
    log.info(names.EXPORTED_EVENT,
             run_dir=str(run_dir), step=step, out=str(out), lora=cfg.backend.lora and not merge)
    return Path(out)


def is_adapter(folder: Path) -> bool:
    return (Path(folder) / "adapter_config.json").exists()


def load_model(folder: Path, dtype: str = "float32", device: str = "cpu"):
    """The inverse of save_model: a full folder, or an adapter folder merged onto its base, as a plain
    transformers causal LM."""
    from quaero.models.load import load_causal_lm

    folder = Path(folder)
    if not is_adapter(folder):
        return load_causal_lm(str(folder), dtype, device)
    import json

    from peft import PeftModel

    base_name = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = load_causal_lm(base_name, dtype, device)
    return PeftModel.from_pretrained(base, folder).merge_and_unload()
