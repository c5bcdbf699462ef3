"""The peers' LM-head methods, as comparators for the selective path on the same step.

- `chunked_all_positions`: log-probs at EVERY position, chunk by chunk, recomputing each chunk's
  logits in backward: prime-rl's chunked output layer, verl's `FusedLinearForPPO` (chunk 512) and
  NeMo-RL's `logprob_chunk_size` all bound memory this way (O(chunk x V)) and still pay the LM head
  and softmax over the whole row; the loss masks the positions it does not read afterwards. verl
  and prime-rl compute the entropy in the same pass too; this comparator leaves it out, so it is the
  cheapest form of their method.
- `backbone_only`: no LM head at all; the "log-prob" of a target is the mean of its hidden state.
  This is the floor no LM-head method can beat: the same forward, backward, losses, clipping and
  AdamW, minus everything vocabulary-sized except the LM-head weight's (zero) gradient and update,
  which every LM-head path pays too.

The chunked recompute is `trainers.chunked_ce.ChunkedSelectedLogprobs` over every position instead of
the selected ones: one `torch.autograd.Function` that saves only the hidden states [N, H], the targets
and the per-row logsumexp, and walks the chunks in forward and again in backward. Using quaero's own
kernel means the comparison differs only in which positions get an LM head, so the figure measures
selection, not kernel tuning.

Each method has the signature of `trainers.selective.selected_logprobs`, so a trainer runs it through its
public hook: `TrainerSpec(logprob_fn=peer_logprob_fn(name))` makes the real `train_step` (batching, RL + ECHO
losses, one backward, grad clipping, AdamW) use it in place of the selective LM head, after the same one
backbone forward. Their `SelectiveInfo.branch` is the method's name, which no selective branch counter
counts: a step whose counters stay 0 with one forward per microbatch ran the peer.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from trainers.chunked_ce import ChunkedSelectedLogprobs, LogitTransform
from trainers.selective import SelectiveInfo
from trainers.spec import SelectivePolicy

PEERS = ("chunked_all_positions", "backbone_only")
DEFAULT_PEER_CHUNK = 512  # verl's FusedLinearForPPO chunk


def chunked_all_positions_logprobs(
    hidden: Tensor,  # [B, L, H]
    lm_head: nn.Linear,
    input_ids: Tensor,  # [B, L]
    target_mask: Tensor,  # [B, L] bool, True at target tokens
    *,
    temperature: float = 1.0,
    policy: SelectivePolicy | None = None,  # its chunk_size: the peer's chunk (unset: DEFAULT_PEER_CHUNK)
    logit_transform: LogitTransform | None = None,
) -> tuple[Tensor, SelectiveInfo]:  # [B, L-1] fp32, 0 off the targets
    """Log-probs of the next token at every position (chunked, recomputed in backward), then masked."""
    chunk_size = (policy.chunk_size if policy else None) or DEFAULT_PEER_CHUNK
    B, L, H = hidden.shape
    h = hidden[:, :-1].reshape(-1, H)  # [B (L-1), H]: every position, padding included, as the peers do
    targets = input_ids[:, 1:].reshape(-1)  # [B (L-1)]
    lp = ChunkedSelectedLogprobs.apply(h, lm_head.weight, lm_head.bias, targets, chunk_size, temperature,
                                       logit_transform or LogitTransform())
    lp = lp.view(B, L - 1)
    shifted = target_mask[:, 1:].to(torch.bool)
    return torch.where(shifted, lp, torch.zeros_like(lp)), SelectiveInfo("chunked_all_positions")


def backbone_only_logprobs(
    hidden: Tensor,  # [B, L, H]
    lm_head: nn.Linear,
    input_ids: Tensor,  # [B, L] (unused: no LM head reads the targets)
    target_mask: Tensor,  # [B, L] bool
    **_options,  # temperature, policy, logit_transform: no LM head, nothing to apply them to
) -> tuple[Tensor, SelectiveInfo]:  # [B, L-1] fp32
    """The floor: the mean of each target's hidden state stands in for its log-prob.

    `hidden.sum() * 0` keeps every position in the graph; `lm_head.weight.sum() * 0` gives the LM head
    a (zero) gradient, so clipping and AdamW update the same parameters as every LM-head path."""
    shifted = target_mask[:, 1:].to(torch.bool)
    floor = hidden[:, :-1].float().mean(dim=-1)  # [B, L-1]
    tie = hidden.sum().float() * 0 + lm_head.weight.sum().float() * 0
    return torch.where(shifted, floor, torch.zeros_like(floor)) + tie, SelectiveInfo("backbone_only")


def peer_logprob_fn(name: str) -> str:
    """The `TrainerSpec.logprob_fn` of a peer named in PEERS."""
    if name not in PEERS:
        raise ValueError(f"peer {name!r}: choose one of {', '.join(PEERS)}")
    return f"{__name__}:{name}_logprobs"
