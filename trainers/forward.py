"""The one forward per microbatch: backbone hidden states, the LM head, and the strict-forward counter.

`CausalLMParts` finds the backbone and head of a transformers causal LM (through a PEFT wrapper),
reads the logit transform its forward applies (`final_logit_softcapping`, `logit_scale`,
`logits_scaling`) and *verifies* it once on a short probe: the selective path must reproduce the
model's own logits, or the trainer refuses with a message naming the fix. `ForwardCounter` counts
backbone forwards, so a step can prove the RL and ECHO terms came from one forward.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from trainers.chunked_ce import LogitTransform
from trainers.tree import TreePack


class SharedForwardError(RuntimeError):
    """The RL and ECHO terms of a microbatch did not come from exactly one forward pass."""


class LogitTransformError(RuntimeError):
    """The model's forward changes logits in a way the selective path cannot reproduce."""


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers CausalLM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def logit_transform_of(config) -> LogitTransform:
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)  # Gemma-2/3: c * tanh(x / c)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


class ForwardCounter:
    """Counts backbone forward calls (a forward pre-hook); `take()` reads and resets."""

    def __init__(self, module: nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.count += 1

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


class CausalLMParts:
    """Backbone + LM head of `model`; `hidden_states()` is the shared forward both loss terms read."""

    def __init__(self, model: nn.Module, name: str = "model") -> None:
        self.model = model
        lm = causal_lm_of(model)
        self.backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else getattr(lm, "model", None)
        self.lm_head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        self.config = getattr(lm, "config", None)
        self.transform = logit_transform_of(self.config)
        self.name = name
        # No backbone/head to split: the selective path cannot run; steps fall back (counted).
        self.selective_ok = self.backbone is not None and self.lm_head is not None
        self.counter = ForwardCounter(self.backbone if self.backbone is not None else model)

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor, tree: TreePack | None = None
                      ) -> Tensor:  # [B, L, H]
        """The backbone over the rows, or once over their trie (`tree`, trainers/tree.py) and gathered back
        to the rows."""
        if tree is None:
            out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        else:
            out = self.backbone(**self._tree_inputs(tree), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden if tree is None else tree.unpack(hidden)

    def logits(self, input_ids: Tensor, attention_mask: Tensor, tree: TreePack | None = None
               ) -> Tensor:  # [B, L, V], the model's own
        if tree is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return tree.unpack(self.model(**self._tree_inputs(tree), use_cache=False).logits)

    def _tree_inputs(self, tree: TreePack) -> dict[str, Tensor]:
        dtype = self.lm_head.weight.dtype if self.lm_head is not None else torch.float32
        impl = getattr(self.config, "_attn_implementation", None) or "eager"
        return {"input_ids": tree.input_ids, "position_ids": tree.position_ids,
                "attention_mask": tree.mask(impl, dtype)}

    @torch.no_grad()
    def verify_transform(self) -> None:
        """Probe once: transform(lm_head(hidden)) must equal the model's logits, else refuse."""
        if not self.selective_ok:
            return
        was_training = self.model.training
        self.model.eval()
        try:
            device = self.lm_head.weight.device
            ids = torch.arange(3, 11, device=device)[None] % self.lm_head.weight.shape[0]
            attn = torch.ones_like(ids)
            want = self.logits(ids, attn).float()
            got = self.transform.apply(self.lm_head(self.hidden_states(ids, attn)).float())
        finally:
            self.model.train(was_training)
            self.counter.take()
        tol = 1e-4 if self.lm_head.weight.dtype == torch.float32 else 3e-2
        err = (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)
        if err > tol:
            raise LogitTransformError(
                f"model {self.name!r}: its forward transforms logits in a way quaero's selective path does "
                f"not reproduce (relative error {err:.2e} with transform {self.transform}); set "
                "[backend.options] train_selective_suffix_logits = false to train from the model's own full "
                "logits")
