"""Atomic checkpoints with integrity checks, and resume from the last good one.

Layout: `runs/NAME/checkpoints/step-000008/{state.pt, manifest.json}`. A checkpoint is written into a
temporary folder and renamed into place, so a crash mid-write leaves no half checkpoint under a
final name. The manifest holds the SHA-256 of state.pt; a checkpoint whose file is missing, torn or
does not match its manifest is skipped (logged) and the previous one is used.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from quaero.metrics import get_logger

log = get_logger(__name__)


def rng_state() -> dict[str, Any]:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(ckpt_root: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` for `step` atomically; prune to the newest `keep` checkpoints."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step:06d}-", dir=ckpt_root))
    torch.save(state, tmp / "state.pt")
    (tmp / "manifest.json").write_text(json.dumps({"step": step, "sha256": _sha256(tmp / "state.pt")}))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in sorted(ckpt_root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _verify(path: Path) -> str | None:
    """None when the checkpoint is intact, else why it is not."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"manifest unreadable ({type(e).__name__})"
    state = path / "state.pt"
    if not state.exists():
        return "state.pt missing"
    if _sha256(state) != manifest.get("sha256"):
        return "state.pt does not match its manifest hash (torn or corrupt)"
    return None


def load_latest(ckpt_root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint and its state, or None when there is none."""
    for path in sorted(ckpt_root.glob("step-*"), reverse=True):
        reason = _verify(path)
        if reason is None:
            try:
                return path, torch.load(path / "state.pt", weights_only=False)
            except Exception as e:  # a hash-valid file that still fails to load: skip it as well
                reason = f"load failed ({type(e).__name__}: {e})"
        log.warning("checkpoint_skipped", path=str(path), reason=reason)
    return None


def load(path: Path) -> dict[str, Any]:
    """The state of the checkpoint at `path` (`.../step-000008`); ValueError, naming why, if it is not intact."""
    reason = _verify(path)
    if reason is not None:
        raise ValueError(f"{path}: {reason}; use another step (or none: the newest intact one)")
    return torch.load(path / "state.pt", weights_only=False)
