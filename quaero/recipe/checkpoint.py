"""Checkpoints that hold data, never code: written atomically, verified before use, pruned safely.

Layout: `runs/NAME/checkpoints/step-000008/{tensors.safetensors, state.json, manifest.json}`, plus
`shards/` for a sharded (FSDP2) trainer: its model and optimizer as torch.distributed.checkpoint
writes them, one file per rank and a `.metadata` (tensor data and JSON-like metadata; DCP's loader
reads the metadata file with pickle, so only load shards of a checkpoint whose manifest verifies).

A state is any nesting of dicts, lists, tuples, strings, numbers, bytes and tensors (the backend's
state_dict with its optimizer and scheduler, RNG states, counters). Every tensor goes into
tensors.safetensors, named by the `/`-joined keys that reach it (`backend/optimizer/state/0/exp_avg`);
state.json holds the rest of the tree with `{"__tensor__": name}` in each tensor's place, and tagged
forms for what JSON lacks (`__tuple__`, `__dict__` for non-string keys such as the optimizer's int
param ids, `__bytes__`). Loading parses JSON and safetensors only, so a crafted checkpoint can be
wrong but cannot run code; a pickle from an older quaero (`state.pt`) is never opened.

A checkpoint is written into a `.step-*` temporary folder and renamed into place, so a crash or a
full disk mid-write leaves no half checkpoint under a final name; such orphans are removed at the next
start. The manifest holds the SHA-256 of each file: a missing, torn or mismatched file makes the
checkpoint skipped (with the reason) and the previous one used. Pruning counts intact checkpoints
up to the step just written, so a corrupt or unloadable newer folder never pushes out the checkpoint a
resume needs.

What a run's checkpoint holds is `RunState`, the one schema the recipe writes and a resume, `quaero export`
and `quaero bench ablation` read.
"""
from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)
FORMAT = "quaero-checkpoint-2"
TENSORS, STATE, MANIFEST = "tensors.safetensors", "state.json", "manifest.json"
SHARDS = "shards"  # a sharded trainer's own files (trainers/base.py: save_shards), hashed like the rest
_TAGS = ("__tensor__", "__tuple__", "__dict__", "__bytes__")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or a run folder holds checkpoints of which none is intact."""


class NoIntactCheckpoint(CheckpointError):
    def __init__(self, ckpt_root: Path, skipped: list[tuple[Path, str]]) -> None:
        self.skipped = skipped
        listed = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        super().__init__(f"{ckpt_root}: no intact checkpoint to resume from ({listed})")


def rng_state() -> dict[str, Any]:
    import numpy as np

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`value` as JSON, its tensors moved into `tensors` (see the module docstring for the tags)."""
    if isinstance(value, torch.Tensor):
        name = path or "tensor"
        while name in tensors:  # a key holding '/' could spell the same path as a nesting
            name += "'"
        tensors[name] = value.detach().cpu().contiguous()
        return {"__tensor__": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        items = [(k, _encode(v, f"{path}/{k}".lstrip("/"), tensors)) for k, v in value.items()]
        if all(isinstance(k, str) for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            return dict(items)
        return {"__dict__": [[_encode(k, f"{path}/key", {}), v] for k, v in items]}
    raise TypeError(f"checkpoint state at {path or '/'}: cannot store a {type(value).__name__}; "
                    "states hold dicts, lists, tuples, numbers, strings, bytes and tensors")


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied weights, views): copy only those, so a
    large optimizer state is not held twice while it is written."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        shared = storage.data_ptr() in seen or storage.nbytes() != t.numel() * t.element_size()
        out[name] = t.clone() if shared else t
        seen.add(storage.data_ptr())
    return out


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        (tag, inner), = value.items()
        if tag == "__tensor__":
            return tensors[inner]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors) for v in inner)
        if tag == "__bytes__":
            return base64.b64decode(inner, validate=True)
        if tag == "__dict__":
            return {_freeze(_decode(k, tensors)): _decode(v, tensors) for k, v in inner}
    return {k: _decode(v, tensors) for k, v in value.items()}


def _freeze(key: Any) -> Any:
    return tuple(_freeze(k) for k in key) if isinstance(key, (list, tuple)) else key


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_folder(ckpt_root: Path, step: int) -> Path:
    """A new temporary folder for `step`'s checkpoint, for files written before `save` (a sharded trainer's
    `shards/`, by every rank); `save(..., folder=it)` finishes it, and an unfinished one is an orphan."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{names.step_folder_name(step)}-", dir=ckpt_root))


def _shard_files(tmp: Path) -> list[str]:
    root = tmp / SHARDS
    return sorted(str(p.relative_to(tmp)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []


def save(ckpt_root: Path, step: int, state: dict[str, Any], keep: int = 2,
         folder: Path | None = None) -> Path:
    """Write `state` for `step` atomically, then prune to the newest `keep` intact checkpoints.

    folder: a `temp_folder` already holding `shards/`; they are hashed into the manifest with the rest.
    A failed write (a full disk) removes its temporary folder and raises CheckpointError in one line
    naming the path and the bytes needed; the checkpoints already there are untouched."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    text = json.dumps({"format": FORMAT, "state": _encode(state, "", tensors)})
    needed = sum(t.numel() * t.element_size() for t in tensors.values()) + len(text)
    final, tmp, writing = ckpt_root / names.step_folder_name(step), folder, TENSORS
    try:
        if tmp is None:
            tmp = Path(tempfile.mkdtemp(prefix=f".{names.step_folder_name(step)}-", dir=ckpt_root))
        save_file(_unshared(tensors), tmp / TENSORS)
        writing = STATE
        (tmp / STATE).write_text(text, encoding="utf-8")
        writing = MANIFEST
        files = (TENSORS, STATE, *_shard_files(tmp))
        hashes = {name: _sha256(tmp / name) for name in files}
        (tmp / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "sha256": hashes}))
        for name in (*files, MANIFEST, *([SHARDS] if (tmp / SHARDS).is_dir() else []), "."):
            _fsync(tmp / name)
        writing = "the final rename"
        if final.exists():  # set aside first: the folder name never points at half a checkpoint
            old = Path(tempfile.mkdtemp(prefix=f".{names.step_folder_name(step)}-old-", dir=ckpt_root))
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync(ckpt_root)
    except (OSError, SafetensorError) as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
        # not a space problem
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise CheckpointError(
                f"checkpoint {final} not written ({writing}: {why}): {ckpt_root} is not "
                "writable by this process; fix its permissions (chattr -i, chmod u+w, a "
                "read-write mount) and resume with `quaero train CONFIG --resume`"
            ) from None
        free = shutil.disk_usage(ckpt_root).free
        raise CheckpointError(f"checkpoint {final} not written ({writing}: {why}); it needs {needed} bytes, "
                              f"{free} are free there; the checkpoints already in {ckpt_root} are untouched: "
                              "free space and resume with `quaero train CONFIG --resume`") from None
    prune(ckpt_root, keep, step)
    return final


def remove_orphans(ckpt_root: Path) -> list[Path]:
    """Remove `.step-*` temporary folders a killed or failed write left behind (only one run writes
    here: the caller holds the run folder's lock)."""
    orphans = sorted(p for p in ckpt_root.glob(".step-*") if p.is_dir()) if ckpt_root.is_dir() else []
    for path in orphans:
        shutil.rmtree(path, ignore_errors=True)
        log.warning(names.CHECKPOINT_ORPHAN_REMOVED_EVENT, path=str(path))
    return orphans


def prune(ckpt_root: Path, keep: int, step: int) -> None:
    """Keep the newest `keep` intact checkpoints up to `step` (the one just written); delete older intact
    ones. A corrupt folder is never counted as kept and never deleted here (it is left for inspection, and a
    run that reaches its step overwrites it). Neither is one past `step`: the run resumed before it, so it is
    unusable even if its hashes match (a hash-valid file that is not a quaero state), and counting it
    would push out the checkpoint just written."""
    intact = 0
    for path in sorted(ckpt_root.glob("step-*"), reverse=True):
        reason = verify(path)
        if reason is not None:
            log.warning(names.CHECKPOINT_CORRUPT_LEFT_EVENT, path=str(path), reason=reason)
        elif path.name > names.step_folder_name(step):
            log.warning(names.CHECKPOINT_NEWER_LEFT_EVENT, path=str(path), step=step,
                        reason="past the step this run resumed from (it could not be loaded)")
        elif intact < max(keep, 1):
            intact += 1
        else:
            shutil.rmtree(path, ignore_errors=True)


def verify(path: Path) -> str | None:
    """None when the checkpoint's files are all there and match its manifest, else why not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        if (path / "state.pt").exists():
            return (
                "state.pt is a pickle written by an older quaero; it is never loaded (a pickle can run code)"
            )
        return f"{MANIFEST} is not a {FORMAT} manifest"
    hashes = manifest.get("sha256")
    files = [TENSORS, STATE]
    if isinstance(hashes, dict):
        files += [n for n in hashes if n not in files]
    for name in files:
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            return f"{MANIFEST} names a file outside the checkpoint ({name!r})"
        if not (path / name).is_file():
            return f"{name} missing"
        if not isinstance(hashes, dict) or _sha256(path / name) != hashes.get(name):
            return f"{name} does not match its manifest hash (torn or corrupt)"
    return None


def _load(path: Path) -> dict[str, Any]:
    doc = json.loads((path / STATE).read_text(encoding="utf-8"))
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{STATE} is not a {FORMAT} state")
    state = _decode(doc["state"], load_file(path / TENSORS))
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise TypeError(f"{STATE} has no integer 'step'")
    step = state["step"]
    try:
        listed = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        listed = None
    # a rehashed state.json: never trusted
    if step < 1 or path.name != names.step_folder_name(step) or listed != step:
        raise ValueError(f"{STATE} says step {step} in folder {path.name} whose {MANIFEST} says step "
                         f"{listed!r}; "
                         "a checkpoint's step is its folder's")
    return state


def load_latest(ckpt_root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its state; None when there are no checkpoints at all.
    Raises NoIntactCheckpoint, naming each folder and why it was skipped, when none is usable."""
    skipped: list[tuple[Path, str]] = []
    for path in sorted(ckpt_root.glob("step-*"), reverse=True):
        reason = verify(path)
        if reason is None:
            try:
                return path, _load(path)
            except (OSError, ValueError, KeyError, TypeError, RecursionError, SafetensorError) as e:
                # hash-valid but malformed (a crafted file): skip it as well
                reason = f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        log.warning(names.CHECKPOINT_SKIPPED_EVENT, path=str(path), reason=reason)
        skipped.append((path, reason))
    if skipped:
        raise NoIntactCheckpoint(ckpt_root, skipped)
    return None


def set_aside(ckpt_root: Path, stamp: str) -> Path | None:
    """Rename the checkpoints folder out of the way (a restart keeps what was there); its new path."""
    if not ckpt_root.exists():
        return None
    aside = ckpt_root.with_name(f"{ckpt_root.name}.before-restart-{stamp}")
    n = 1
    while aside.exists():  # two restarts within one stamp
        aside, n = ckpt_root.with_name(f"{ckpt_root.name}.before-restart-{stamp}-{n}"), n + 1
    ckpt_root.rename(aside)
    return aside


def load(path: Path) -> dict[str, Any]:
    """The state of the checkpoint at `path` (`.../step-000008`); ValueError, naming why, if it is not
    intact."""
    reason = verify(path)
    if reason is not None:
        raise ValueError(f"{path}: {reason}; use another step (or none: the newest intact one)")
    return _load(path)


# ── what a run's checkpoint holds
# ────────────────────────────────────────────────────────────────────────────


def run_checkpoints(run_dir: Path) -> Path:
    """A run folder's checkpoints folder (`runs/NAME/checkpoints`)."""
    return Path(run_dir) / names.CHECKPOINTS


def run_checkpoint(run_dir: Path, step: int) -> Path:
    """The folder of a run's checkpoint of `step` (`runs/NAME/checkpoints/step-000008`); a sharded trainer's
    shards are in its `SHARDS` subfolder."""
    return run_checkpoints(run_dir) / names.step_folder_name(step)


@dataclass
class RunState:
    """A run's state at the end of a step: what a checkpoint holds and a resume restores.

    The keys on disk are the ones checkpoints have always had (`backend` holds the trainer's state), so a
    checkpoint of an earlier quaero still loads."""

    step: int
    cursor: int  # the next train task index
    trainer: dict[str, Any]  # `Trainer.state_dict()`: model (or adapter), optimizer, scheduler
    rng: dict[str, Any]  # rank 0's RNG state (`rng_state()`)
    cumulative: dict[str, Any]  # the run's metric totals so far (quaero/telemetry/runlog.py Cumulative)
    rank_rng: list[dict[str, Any]] | None = None  # under torchrun: every rank's RNG state, in rank order
    # what decides the next tasks (quaero/recipe/run_state.py `task_state`): the mixture's cursor, each env's
    # task sampler's state (its draw count and outcome memory), the tasks drawn for steps not yet trained
    tasks: dict[str, Any] | None = None

    def to_state(self) -> dict[str, Any]:
        state = {"step": self.step, "cursor": self.cursor, "backend": self.trainer, "rng": self.rng,
                 "cumulative": self.cumulative}
        if self.rank_rng is not None:
            state["rank_rng"] = self.rank_rng
        if self.tasks is not None:
            state["tasks"] = self.tasks
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunState:
        """KeyError or TypeError for a state that is not a run's (a crafted or foreign checkpoint)."""
        return cls(step=int(state["step"]), cursor=int(state["cursor"]), trainer=state["backend"],
                   rng=state["rng"],
                   cumulative=dict(state["cumulative"]), rank_rng=state.get("rank_rng"),
                   tasks=state.get("tasks"))

    def rng_of_rank(self, rank: int, world_size: int) -> dict[str, Any]:
        """This rank's RNG state when the checkpoint was written by as many ranks, else rank 0's."""
        same_ranks = isinstance(self.rank_rng, list) and len(self.rank_rng) == world_size
        return self.rank_rng[rank] if same_ranks else self.rng
