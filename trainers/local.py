"""`local`: a transformers causal LM trained in this process (optionally LoRA through peft).

Loads `[model] name` through quaero.model (the embedded tiny default, a local folder or a hub id) in
`[model] dtype`; `[backend] lora` wraps it with peft LoRA on every linear layer but the LM head;
`[backend] gradient_checkpointing` turns on transformers' (non-reentrant) activation checkpointing.
The step itself is trainers/step.py, shared with `unsloth`.
"""
from __future__ import annotations

from torch import nn

from quaero.model import load_causal_lm
from trainers.base import BackendBase


def add_lora(model: nn.Module, r: int, alpha: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


class LocalBackend(BackendBase):
    name = "local"

    def _load_model(self) -> nn.Module:
        b = self.cfg.backend
        model = load_causal_lm(self.cfg.model.name, self.cfg.model.dtype, str(self.device))
        if b.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if b.lora:
            model = add_lora(model, b.lora_r, b.lora_alpha)
        return model
