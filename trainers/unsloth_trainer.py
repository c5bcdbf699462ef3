"""`unsloth`: the same shared step (trainers/step.py) over a model loaded by unsloth's FastLanguageModel.

unsloth patches transformers when it is imported, so this module imports it first: import this
module (or `trainers.registry.trainer_class("unsloth")`) before anything imports transformers.
On a machine without a GPU unsloth trains through its official CPU fallback (no fast inference).
On CUDA, `[backend] unsloth_fast_inference = true` loads unsloth's vLLM engine next to the model
(`self.vllm_engine`, usable as the sampler). Without LoRA the model is fully fine-tuned.
"""
from __future__ import annotations

import os

from trainers.vllm_cpu_kernels import keep_unsloth_off_avx512_vllm_kernels

# unsloth's patched CausalLM forward may skip materialising logits; the logit-transform probe reads them
os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
keep_unsloth_off_avx512_vllm_kernels()  # before unsloth's import probe
try:
    import unsloth  # noqa: F401 - must precede transformers
    from unsloth import FastLanguageModel
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("[backend] backend='unsloth' needs unsloth: pip install 'quaero[unsloth]' "
                      f"(caps transformers<=5.17.0), or use backend='local' ({e})") from e

import torch
from torch import nn

from quaero.models.load import resolve_model, torch_dtype
from trainers.base import Trainer

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class UnslothTrainer(Trainer):
    name = "unsloth"

    def _load_model(self) -> nn.Module:
        spec = self.spec
        fast = spec.unsloth_fast_inference
        if fast and self.device.type != "cuda":
            raise ValueError("[backend] unsloth_fast_inference=true needs a GPU (unsloth's vLLM engine); "
                             "set it to false on CPU, where the hf sampler is used")
        dtype = torch_dtype(spec.dtype)
        model, _tok = FastLanguageModel.from_pretrained(
            str(resolve_model(spec.model)), max_seq_length=spec.max_seq_len,
            dtype=None if dtype == "auto" else dtype, load_in_4bit=False, full_finetuning=not spec.lora,
            fast_inference=fast, random_state=spec.seed)
        self.vllm_engine = getattr(model, "vllm_engine", None)
        if spec.lora:
            model = FastLanguageModel.get_peft_model(
                model,
                r=spec.lora_r,
                lora_alpha=spec.lora_alpha,
                lora_dropout=0.0,
                target_modules=LORA_TARGETS,
                use_gradient_checkpointing="unsloth" if spec.gradient_checkpointing else False,
                random_state=spec.seed,
            )
        elif spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if next(model.parameters()).device != self.device:
            model = model.to(self.device)
        torch.manual_seed(spec.seed)
        return model
