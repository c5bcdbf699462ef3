"""Backend names and declared capabilities, importable without torch models or optional extras.

`quaero check` judges configs against these declarations before anything heavy loads; each
backend also *enforces* its declaration at run time (see trainers/base.py).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    strict_shared_forward: bool
    selective_logits: bool
    lora: bool
    devices: tuple[str, ...]
    module: str  # "package.module:Class" that implements the backend
    extra: str | None = None  # pip extra needed, for the one-line "install X" error


BACKENDS: dict[str, Capabilities] = {
    "local": Capabilities(True, True, True, ("cpu", "cuda"), "trainers.local:LocalBackend"),
    "unsloth": Capabilities(True, True, True, ("cpu", "cuda"), "trainers.unsloth_backend:UnslothBackend",
                            extra="unsloth"),
}


def backend_class(name: str):
    """Import and return the backend class for `name` (lazy: optional extras load only here)."""
    caps = BACKENDS[name]
    module, _, cls = caps.module.partition(":")
    return getattr(importlib.import_module(module), cls)
