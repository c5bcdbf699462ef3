"""Selected-token log-probs with O(chunk x vocab) memory: recompute each chunk's logits in backward.

Eager chunking (`lm_head(h[chunk])` + cross entropy per chunk under autograd) keeps every chunk's
[chunk, V] activations alive until backward: saved memory ~ S x V however small the chunks.
`ChunkedSelectedLogprobs` saves only the selected hidden states [S, H] and targets [S]; forward and backward
each walk the chunks, materialising one [chunk, V] block at a time. The weight gradient [V, H] is
parameter-sized and accumulated in place across chunks.

Math per chunk (a = h W^T + b, z = f(a) / T, lp = z[y] - logsumexp(z)):
    dlp/dz = onehot(y) - softmax(z);   dz/da = f'(a) / T;   dh = da W;   dW = da^T h;   db = sum(da)
with f the model's logit transform (scale s: f(a) = s a; soft-cap c: f(a) = c tanh(s a / c)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to `lm_head(h)` before returning logits.

    scale: multiply (Cohere `logit_scale`; Granite `1 / logits_scaling`); softcap: `c * tanh(x / c)`
    (Gemma-2/3 `final_logit_softcapping`), applied after the scale.
    """

    scale: float = 1.0
    softcap: float | None = None

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: Tensor) -> Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def derivative(self, raw: Tensor) -> Tensor | float:
        """d apply(raw) / d raw, elementwise (a float when constant)."""
        if self.softcap is None:
            return self.scale
        t = torch.tanh(raw * self.scale / self.softcap)
        return self.scale * (1.0 - t * t)


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """logits / T, skipped at T = 1: the divide is a full extra pass over [*, V] forward and backward."""
    return logits if temperature == 1.0 else logits / temperature


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                  # raw [c, V] | None, z [c, V] fp32
                  transform: LogitTransform) -> tuple[Tensor | None, Tensor]:
    """z = f(h W^T + b) / T in fp32; `raw` (the pre-transform logits) only when f'(raw) is needed.

    In-place where it is safe, so a chunk costs one [c, V] buffer (plus one for a soft-cap)."""
    raw = F.linear(h, weight, bias).float()
    if transform.softcap is None:
        z = raw.mul_(transform.scale / temperature) if transform.scale != 1.0 or temperature != 1.0 else raw
        return None, z
    return raw, transform.apply(raw).div_(temperature)


class ChunkedSelectedLogprobs(torch.autograd.Function):
    """lp[s] = log_softmax(f(h[s] W^T + b) / T)[y[s]] for S selected rows, `chunk` rows at a time."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk: int,
                temperature: float, transform: LogitTransform) -> Tensor:  # h [S, H] -> lp [S] fp32
        if chunk < 1:
            raise ValueError(f"train_logprob_chunk_size={chunk}: must be >= 1")
        lp = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty_like(lp)  # [S]: saved so backward need not recompute the logsumexp
        for s in range(0, h.shape[0], chunk):
            _, z = _chunk_logits(h[s:s + chunk], weight, bias, temperature, transform)
            yc = targets[s:s + chunk]
            lse[s:s + chunk] = torch.logsumexp(z, dim=-1)
            lp[s:s + chunk] = z.gather(1, yc[:, None]).squeeze(1) - lse[s:s + chunk]
        ctx.save_for_backward(h, weight, bias, targets, lse)  # no [*, V] tensor is saved
        ctx.chunk, ctx.temperature, ctx.transform = chunk, temperature, transform
        return lp

    @staticmethod
    def backward(ctx, grad_lp: Tensor):  # grad_lp [S]
        h, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, h.shape[0], ctx.chunk):
            hc, yc, gc = h[s:s + ctx.chunk], targets[s:s + ctx.chunk], grad_lp[s:s + ctx.chunk].float()
            raw, z = _chunk_logits(hc, weight, bias, ctx.temperature, ctx.transform)
            # d lp / d a = (onehot(y) - softmax(z)) * f'(a) / T, times the incoming gradient gc: the
            # per-row constant gc * s / T is folded into one pass over the [c, V] block
            const = ctx.transform.scale if raw is None else 1.0
            row = gc * (const / ctx.temperature)  # [c]
            da = z.sub_(lse[s:s + ctx.chunk, None]).exp_().mul_(-row[:, None])  # -softmax * row
            da[torch.arange(yc.shape[0], device=yc.device), yc] += row  # + onehot * row
            if raw is not None:  # soft-cap: f'(a) varies per element
                da.mul_(ctx.transform.derivative(raw))
                del raw  # [c, V] fp32 now holds d lp / d (h W^T + b)
            if need_h:
                grad_h[s:s + ctx.chunk] = (da.to(weight.dtype) @ weight).to(h.dtype)
            if need_w:
                grad_w.addmm_(da.t(), hc.float())
            if need_b:
                grad_b.add_(da.sum(dim=0))
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def checkpointed_selected_logprobs(h: Tensor, lm_head: nn.Module, targets: Tensor, chunk: int,
                                   temperature: float, transform: LogitTransform) -> Tensor:  # [S] fp32
    """The same bound for heads that are not a plain `nn.Linear` (wrapped, quantized, custom).

    Each chunk runs under non-reentrant activation checkpointing: only its input [chunk, H] is saved,
    and its logits are recomputed (through the head's own forward) when its gradient is needed.
    """
    if chunk < 1:
        raise ValueError(f"train_logprob_chunk_size={chunk}: must be >= 1")

    def one_chunk(hc: Tensor, yc: Tensor) -> Tensor:
        z = tempered(transform.apply(lm_head(hc).float()), temperature)
        return -F.cross_entropy(z, yc, reduction="none")

    parts = [checkpoint(one_chunk, h[s:s + chunk], targets[s:s + chunk], use_reentrant=False)
             for s in range(0, h.shape[0], chunk)]
    return torch.cat(parts)
