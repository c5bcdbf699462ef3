"""`torch.compile`d selected cross entropy (`[backend.options] train_compile_selective_ce`).

Runs only for a plain `nn.Linear` head (it calls the weight/bias linear directly), on CUDA, with at
least `min_tokens` selected rows. It returns `(None, reason)` when it cannot run; the caller falls
back (`auto`) or fails closed (`require`). It compiles with `dynamic=True` and the default mode,
not `reduce-overhead`: selected-token counts vary every step, and CUDA-graph output
buffers are reused across calls, which is a hazard for a tensor that lives until backward.
A compile failure is remembered (per process) so it is not retried on every microbatch.
It runs all S selected rows at once, also when `train_logprob_chunk_size` is set (the compiled
region is Inductor-fused, but not chunk-bounded): a memory-bound run keeps compile off and chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_compiled: dict[tuple, object] = {}
_failed: dict[tuple, str] = {}


def _selected_ce(h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                 scale: float, softcap: float | None) -> Tensor:  # h [S, H] -> lp [S] fp32
    logits = F.linear(h, weight, bias).float()
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return -F.cross_entropy(logits / temperature, targets, reduction="none")


def compile_unavailable_reason(device: torch.device, lm_head: nn.Module, selected: int,
                               min_tokens: int) -> str:
    """Why the compiled path cannot run here ("" when it can try)."""
    if selected < min_tokens:
        return "below_min_tokens"
    if device.type != "cuda":
        return "non_cuda"
    if not hasattr(torch, "compile"):
        return "torch_compile_unavailable"
    if type(lm_head) is not nn.Linear:
        return "lm_head_not_plain_linear"
    return ""


def compiled_selected_logprobs(h: Tensor, lm_head: nn.Module, targets: Tensor, temperature: float,
                               transform, min_tokens: int) -> tuple[Tensor | None, str]:
    """Compiled `-CE(f(h W^T + b) / T, y)` over all S selected rows at once, or (None, reason)."""
    reason = compile_unavailable_reason(h.device, lm_head, h.shape[0], min_tokens)
    if reason:
        return None, reason
    key = (h.device.type, lm_head.bias is not None)
    if key in _failed:
        return None, _failed[key]
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = torch.compile(_selected_ce, dynamic=True, fullgraph=True)
    try:
        return fn(h, lm_head.weight, lm_head.bias, targets, float(temperature), float(transform.scale),
                  transform.softcap), ""
    except Exception as e:  # noqa: BLE001 - any Inductor/compiler failure: recorded, the caller decides
        _failed[key] = f"compile_failed:{type(e).__name__}"
        return None, _failed[key]
