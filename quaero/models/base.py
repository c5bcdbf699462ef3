"""What quaero's model families share, below them all: the one-line error for a model that cannot be had, and
the deterministic random init of the embedded random models (tiny-qwen3 and the Qwen3 shapes in
quaero/models/qwen3.py, tiny-smollm2 in quaero/models/smollm2.py)."""
from __future__ import annotations


class ModelNotFound(RuntimeError):
    """A model id/path that cannot be resolved; the message is one line for the user."""


def init_random(model, seed: int = 0, embed_scale: float = 1.0):
    """`model`'s weights, deterministic from their own generator (independent of the global RNG): norm
    weights 1, matrices N(0, 0.02), vectors 0, then the input embedding times `embed_scale`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.zero_()
        if embed_scale != 1.0:
            model.get_input_embeddings().weight.mul_(embed_scale)
    return model
