"""What quaero's model families share, below them all: the one-line error for a model that cannot be had, an
installed package's version, a GGUF's tensors in a model (`fill_from_gguf`), and
the deterministic random init of the embedded random models (tiny-qwen3 and the Qwen3 shapes in
quaero/models/qwen3.py, tiny-smollm2 in quaero/models/smollm2.py)."""
from __future__ import annotations


class ModelNotFound(RuntimeError):
    """A model id/path that cannot be resolved; the message is one line for the user."""


def fill_from_gguf(model, path, shape, name: str, what: str, install: str) -> dict:
    """`model` (a fresh transformers causal LM) holding the GGUF's tensors, dequantized by transformers' GGUF
    reader, once the GGUF's metadata agrees with `shape` (a dataclass of config.json fields) on every field it
    carries; returns the rest of what the reader parsed (config, tokenizer). ModelNotFound naming `install`
    where the file holds another model or its tensors do not fill `model`."""
    from dataclasses import asdict

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    for key, value in asdict(shape).items():
        got = parsed["config"].get(key)
        if got is None or isinstance(value, bool):  # a field the GGUF does not carry: the tensors decide
            continue
        if abs(float(got) - float(value)) > 1e-6 * max(1.0, abs(float(value))):
            raise ModelNotFound(f"model {name!r}: {path.name} holds another model than {what} ({key} {got} "
                                f"where {what} has {value}); reinstall it: {install}")
    missing, unexpected = model.load_state_dict(parsed.pop("tensors"), strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:  # the head is the tied embedding
        raise ModelNotFound(f"model {name!r}: {path.name}'s tensors do not fill a {type(model).__name__} "
                            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); "
                            f"reinstall it: {install}")
    return parsed


def installed_version(dist: str) -> str | None:
    """An installed distribution's version (None: not installed), for `quaero doctor`'s family lines."""
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


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
