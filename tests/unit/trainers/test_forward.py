"""trainers/forward.py: the model split into backbone and head (`CausalLMParts`), the logit transform it
must declare, and the fallback for a model that exposes no split."""
import pytest
import torch
from fixtures.small_model import make_spec, rows

from trainers.forward import CausalLMParts, LogitTransformError
from trainers.local import LocalTrainer


class ScaledLogits(torch.nn.Module):
    """A fault: a causal LM whose forward scales its logits without declaring it in its config."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_decoder(self):
        return self.inner.model

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, **kw):
        out = self.inner(**kw)
        out.logits = out.logits * 2.0
        return out


def test_undeclared_logit_transform_is_refused_and_declared_one_is_applied(small_model_dir):
    from transformers import AutoModelForCausalLM

    inner = AutoModelForCausalLM.from_pretrained(small_model_dir)
    with pytest.raises(LogitTransformError, match="train_selective_suffix_logits = false"):
        CausalLMParts(ScaledLogits(inner), "scaled").verify_transform()
    inner.config.logit_scale = 2.0  # declared (Cohere-style): now the selective path reproduces it
    parts = CausalLMParts(ScaledLogits(inner), "scaled")
    parts.verify_transform()
    assert parts.transform.scale == 2.0


class NoSplitLM(torch.nn.Module):
    """A fault: a causal LM that exposes neither its backbone nor its head (only full logits)."""

    def __init__(self, inner):
        super().__init__()
        self.wrapped, self.config = inner, inner.config

    def forward(self, **kw):
        return self.wrapped(**kw)


def test_model_without_backbone_split_falls_back_and_is_counted(small_model_dir):
    class NoSplitTrainer(LocalTrainer):
        def _load_model(self):
            return NoSplitLM(super()._load_model())

    rs = rows(2)
    ref = LocalTrainer(make_spec(small_model_dir), "cpu").train_step(rs)
    m = NoSplitTrainer(make_spec(small_model_dir), "cpu").train_step(rs)
    assert m["local_train_selective_fallback_logprob_batches"] == m["microbatches"] == m["forward_passes"]
    assert m["local_train_selective_hidden_logprob_batches"] == 0
    for key in ("rl_loss", "echo_loss", "grad_norm"):
        assert m[key] == pytest.approx(ref[key], rel=1e-5), key
