"""The model cache: where the embedded models are materialized (`$QUAERO_CACHE/models/NAME-VERSION`, default
`~/.cache/quaero`) as ordinary Hugging Face model folders that transformers, vLLM and unsloth load, built once
(atomically) on first use and announced with their size first.

A build is deterministic, so a built folder is checked on every use against what its build wrote
(`BUILD_FILE`: each file's sha256, the weights' size): a folder whose weights are cut short or missing
(folders.py) is damaged cache and is rebuilt, said; a file changed, added or removed since the build (an
edited chat template) is refused in one line, never used as if it were the named model. A build killed half
way leaves its temporary folder; the next build removes those whose builder process is gone.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from quaero.models.registry import named_models

BUILD_FILE = "quaero_build.json"  # what a build wrote: every other file's sha256 and the weights' size
BUILDER_FILE = ".builder"  # in a build's temporary folder: the host and pid building it
WEIGHTS = "model.safetensors"
STALE_S = 3600.0  # a temporary folder with no builder said, or another host's, this old is abandoned


def cache_dir() -> Path:
    root = os.environ.get("QUAERO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "quaero")
    return Path(root)

def materialize_folder(target: Path, build: Callable[[Path], None]) -> Path:
    """`build(folder)` into `target` once (atomic: a temp folder, then a rename); later calls reuse it once
    it is checked against its build (`build_problem`): damaged, it is rebuilt (said); changed, refused."""
    _remove_abandoned(target)
    if target.exists():
        complete = (target / "config.json").exists() and (target / WEIGHTS).exists()
        damage = build_problem(target) if complete else f"config.json or {WEIGHTS} is missing"
        if damage is None:
            return target
        from quaero.telemetry import names
        from quaero.telemetry.runlog import get_logger

        get_logger(__name__).warning(names.MODEL_BUILD_EVENT, folder=str(target), damaged=damage,
                                     note=f"{target.name} in the cache is damaged ({damage}); it is built "
                                          "again")
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        (tmp / BUILDER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        build(tmp)
        (tmp / BUILDER_FILE).unlink()
        (tmp / BUILD_FILE).write_text(json.dumps(_manifest(tmp), indent=1, sort_keys=True))
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; theirs is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _manifest(folder: Path) -> dict:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (BUILD_FILE, WEIGHTS))
    return {"files": {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
            "weights_bytes": (folder / WEIGHTS).stat().st_size}


def build_problem(folder: Path) -> str | None:
    """Damage that a rebuild mends (weights cut short or missing: `folder_problem`), as one clause; None for a
    folder as its build wrote it. A file changed since the build raises ModelNotFound (one line): it may be
    someone's edit, never silently replaced nor used as the named model. A folder built before builds were
    recorded is judged by its files alone."""
    from quaero.models.folders import folder_problem

    if problem := folder_problem(folder):
        return problem
    try:
        built = json.loads((folder / BUILD_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{BUILD_FILE} unreadable ({e})"
    now = _manifest(folder)
    if now["weights_bytes"] != built.get("weights_bytes"):
        return f"{WEIGHTS} is {now['weights_bytes']:,} bytes, the build wrote {built.get('weights_bytes')}"
    was = built.get("files", {})
    if changed := sorted(k for k in set(was) | set(now["files"]) if was.get(k) != now["files"].get(k)):
        from quaero.models.base import ModelNotFound

        raise ModelNotFound(f"{folder}: {', '.join(changed[:3])} changed since quaero built this named "
                            "model; copy the folder elsewhere and name its path in [model] name (a template "
                            "of your own: [model] renderer_options.chat_template), or delete the folder so "
                            "the next run builds it again")
    return None


def _remove_abandoned(target: Path) -> None:
    """Temporary folders of `target`'s builds whose builder is gone (killed half way: 0.5 GB for SmolLM2)."""
    for tmp in target.parent.glob(f".{target.name}-*") if target.parent.is_dir() else ():
        try:
            builder = json.loads((tmp / BUILDER_FILE).read_text(encoding="utf-8"))
            host, pid = builder["host"], int(builder["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            host, pid = None, None
        try:
            age = time.time() - tmp.stat().st_mtime
        except OSError:
            continue
        if host == socket.gethostname() and pid is not None:
            if _alive(pid):
                continue
        elif age < STALE_S:  # just made (no builder written yet), or another host's build
            continue
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or no pid at all)
    return True


def named_folder(name: str) -> Path:
    """Where a named model (`named_models`) is built in the cache."""
    return cache_dir() / "models" / f"{name}-{named_models()[name].version}"


def is_built(name: str) -> bool:
    folder = named_folder(name)
    return (folder / "config.json").exists() and (folder / WEIGHTS).exists()


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


def build_note(name: str, *, now: bool = False) -> str:
    """One line on a named model's first build: its size, where it goes, what it holds while it builds.
    `now`: said by the build itself (whichever command needs the folder: `quaero check` builds a model whose
    tokenizer lives in its folder), else by `quaero check` of a shape it leaves to the first run."""
    s = build_size(name)
    when = "building it once now" if now else "the first run builds it once"
    made = getattr(named_models()[name], "made_from", "a random init")  # a GGUF family: its file dequantized
    return (f"{name} is not built yet: {when} into {named_folder(name)} "
            f"({s['params'] / 1e6:,.0f}M parameters, {s['disk_gb']:g} GB on disk in {s['dtype']}, about "
            f"{s['memory_gb']:g} GB of memory while it builds; {made}: "
            f"{'seconds' if s['params'] < 5e7 else 'a few minutes'} on a CPU)")


def materialize_named(name: str) -> Path:
    """Build a named model (`named_models`) into the cache on first use, announced first with its size."""
    shape = named_models()[name]
    folder = named_folder(name)
    if not is_built(name):
        from quaero.telemetry import names
        from quaero.telemetry.runlog import get_logger

        get_logger(__name__).warning(names.MODEL_BUILD_EVENT, model=name, folder=str(folder),
                                     **build_size(name), note=build_note(name, now=True))
    return materialize_folder(folder, lambda out: shape.build(out, name))
