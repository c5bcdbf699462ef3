"""`local`: a transformers causal LM trained in this process (optionally LoRA through peft).

Loads the spec's model through quaero.models.load (the embedded tiny default, a local folder or a hub id)
in its dtype; `lora` wraps it with peft LoRA on every linear layer but the LM head;
`gradient_checkpointing` turns on transformers' (non-reentrant) activation checkpointing.
The step itself is trainers/step.py, shared with `unsloth`.
"""
from __future__ import annotations

from torch import nn

from quaero.models.load import load_causal_lm
from trainers.base import Trainer


def add_lora(model: nn.Module, r: int, alpha: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules="all-linear",
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


class LocalTrainer(Trainer):
    name = "local"

    def _load_model(self) -> nn.Module:
        spec = self.spec
        model = load_causal_lm(spec.model, spec.dtype, str(self.device))
        if spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if spec.lora:
            model = add_lora(model, spec.lora_r, spec.lora_alpha)
        return model
