"""Trainer names (the `[backend] backend` values) and declared capabilities, importable without torch.

quaero/preflight/plan.py judges configs against these declarations before anything heavy loads; each
trainer also *enforces* its declaration at run time (see trainers/base.py).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from quaero.resolve import resolve_name


@dataclass(frozen=True)
class Capabilities:
    strict_shared_forward: bool
    selective_logits: bool
    lora: bool
    devices: tuple[str, ...]
    module: str  # "package.module:Class" that implements the trainer
    extra: str | None = None  # pip extra needed, for the one-line "install X" error
    strategies: tuple[str, ...] = ("none",)  # [distributed] strategies it is built and tested for


TRAINERS: dict[str, Capabilities] = {
    "local": Capabilities(True, True, True, ("cpu", "cuda"), "trainers.local:LocalTrainer",
                          strategies=("none", "ddp", "fsdp2")),
    "unsloth": Capabilities(True, True, True, ("cpu", "cuda"), "trainers.unsloth_trainer:UnslothTrainer",
                            extra="unsloth"),
}


def trainer_class(name: str):
    """Import and return the trainer class for `name` (lazy: optional extras load only here)."""
    return resolve_name(TRAINERS[name].module, f"trainers/registry.py TRAINERS[{name!r}].module",
                        want=inspect.isclass, wanted="a class")
