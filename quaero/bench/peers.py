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

`with_peer(trainer, name)` runs the trainer's real `train_step` (batching, RL + ECHO losses, one
backward, grad clipping, AdamW) with only the microbatch's log-prob function swapped.
"""
from __future__ import annotations

import functools
import importlib

import torch
from torch import Tensor, nn

from trainers.chunked_ce import ChunkedSelectedLogprobs, LogitTransform

PEERS = ("chunked_all_positions", "backbone_only")
DEFAULT_PEER_CHUNK = 512  # verl's FusedLinearForPPO chunk
# the module whose global `microbatch_logprobs(trainer, mb, temperature) -> (lp [B, L-1], info)` the step calls
STEP_MODULE = "trainers.step"


def chunked_all_positions_logprobs(
    hidden: Tensor,  # [B, L, H]
    lm_head: nn.Linear,
    input_ids: Tensor,  # [B, L]
    target_mask: Tensor,  # [B, L] bool, True at target tokens
    *,
    chunk_size: int = DEFAULT_PEER_CHUNK,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
) -> Tensor:  # [B, L-1] fp32, 0 off the targets
    """Log-probs of the next token at every position (chunked, recomputed in backward), then masked."""
    B, L, H = hidden.shape
    h = hidden[:, :-1].reshape(-1, H)  # [B (L-1), H]: every position, padding included, as the peers do
    targets = input_ids[:, 1:].reshape(-1)  # [B (L-1)]
    lp = ChunkedSelectedLogprobs.apply(h, lm_head.weight, lm_head.bias, targets, chunk_size, temperature,
                                       transform or LogitTransform())
    lp = lp.view(B, L - 1)
    shifted = target_mask[:, 1:].to(torch.bool)
    return torch.where(shifted, lp, torch.zeros_like(lp))


def backbone_only_logprobs(
    hidden: Tensor,  # [B, L, H]
    lm_head: nn.Linear,
    input_ids: Tensor,  # [B, L] (unused: no LM head reads the targets)
    target_mask: Tensor,  # [B, L] bool
) -> Tensor:  # [B, L-1] fp32
    """The floor: the mean of each target's hidden state stands in for its log-prob.

    `hidden.sum() * 0` keeps every position in the graph; `lm_head.weight.sum() * 0` gives the LM head
    a (zero) gradient, so clipping and AdamW update the same parameters as every LM-head path."""
    shifted = target_mask[:, 1:].to(torch.bool)
    floor = hidden[:, :-1].float().mean(dim=-1)  # [B, L-1]
    tie = hidden.sum().float() * 0 + lm_head.weight.sum().float() * 0
    return torch.where(shifted, floor, torch.zeros_like(floor)) + tie


def peer_logprobs(name: str, *, chunk_size: int = DEFAULT_PEER_CHUNK, temperature: float = 1.0):
    """`(hidden, lm_head, input_ids, target_mask, transform) -> [B, L-1]` for a peer named in PEERS."""
    if name == "chunked_all_positions":
        return lambda h, head, ids, mask, transform: chunked_all_positions_logprobs(
            h, head, ids, mask, chunk_size=chunk_size, temperature=temperature, transform=transform)
    if name == "backbone_only":
        return lambda h, head, ids, mask, transform: backbone_only_logprobs(h, head, ids, mask)
    raise ValueError(f"peer {name!r}: choose one of {', '.join(PEERS)}")


def with_peer(trainer, name: str, *, chunk_size: int = DEFAULT_PEER_CHUNK, temperature: float = 1.0) -> None:
    """Make `trainer.train_step` run the real step with the peer's log-prob function in place of the
    selective one (the one backbone forward per microbatch stays, so the strict-forward check holds)."""
    from trainers.selective import SelectiveInfo

    step_module = importlib.import_module(STEP_MODULE)
    logprobs = peer_logprobs(name, chunk_size=chunk_size, temperature=temperature)
    real_step = trainer.train_step

    def microbatch_logprobs(trainer_, mb, _temperature):  # the peer's own temperature
        parts = trainer_.parts
        hidden = parts.hidden_states(mb.input_ids, mb.attention_mask)
        return logprobs(hidden, parts.lm_head, mb.input_ids, mb.target_mask, parts.transform), SelectiveInfo()

    @functools.wraps(real_step)
    def train_step(rows, **kwargs):
        calls = [0]

        def counted(trainer_, mb, temperature):
            calls[0] += 1
            return microbatch_logprobs(trainer_, mb, temperature)

        saved = step_module.microbatch_logprobs
        step_module.microbatch_logprobs = counted
        try:
            metrics = real_step(rows, **kwargs)
        finally:
            step_module.microbatch_logprobs = saved
        if not calls[0]:
            raise RuntimeError(f"quaero/bench/peers.py: the {name} comparator never ran: the train step no longer "
                               f"reads microbatch_logprobs from {STEP_MODULE}; set STEP_MODULE to the module it "
                               "reads it from")
        metrics["peer_logprob_batches"] = calls[0]
        return metrics

    trainer.train_step = train_step
