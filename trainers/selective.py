"""Exact selective log-probs: the LM head and cross entropy only where a loss reads.

The transformer has already run over the whole row (`hidden` [B, L, H] is conditioned on the full
context and stays in the autograd graph). This module turns those hidden states into the dense
shifted log-prob tensor `[B, L-1]` the losses read: column j holds
`log_softmax(transform(lm_head(hidden[:, j])) / T)[input_ids[:, j+1]]` where `target_mask[:, j+1]`,
and exactly 0 elsewhere. Branches (all exact, see `SelectiveInfo.branch`):

- "suffix": the selected tokens are dense in a short suffix -> one LM head over the suffix (the
  `logits_to_keep` shape), unselected suffix positions masked to 0.
- "hidden": sparse (or a big suffix) -> gather the selected hidden states [S, H] -> LM head ->
  class-index `F.cross_entropy(reduction="none")` -> negate -> scatter into the dense tensor.
- "hidden_chunked": `chunk_size` set, or the [S, V] logits above `hidden_max_bytes` -> the same, through
  `ChunkedSelectedLogprobs`, which saves only hidden states and targets and recomputes each chunk's
  logits in backward: O(chunk x V) memory.
- "compiled": `torch.compile`d CE on the selected rows (CUDA, plain `nn.Linear` head, >= min tokens).
- "none": no targets -> no LM-head work at all (a zero tensor, not a full-vocabulary fallback).
The sparse/dense choice reads per-row density and the bytes the suffix logits would take, not
fixed token counts (a fixed slot count or fraction would mix a batch count with a row length); the
eager/chunked choice reads the bytes of the selected logits. The thresholds and the CPU measurements
behind them are in `trainers/spec.py` (`SelectivePolicy`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainers.chunked_ce import (
    ChunkedSelectedLogprobs,
    LogitTransform,
    checkpointed_selected_logprobs,
    tempered,
)
from trainers.compiled_ce import compiled_selected_logprobs
from trainers.spec import SelectivePolicy

_DEFAULT_POLICY = SelectivePolicy()
# rows per chunk when `hidden_max_bytes` chunks and `chunk_size` is unset (the measured chunk)
AUTO_CHUNK_ROWS = 256


@dataclass
class SelectiveInfo:
    """Which branch produced the log-probs, and the figures the decision read."""

    branch: str = "none"
    sparse_suffix_skip: bool = False  # the suffix shortcut was declined as sparse or too big
    compiled: bool = False
    fallback_reason: str = ""  # why compiled CE did not run (compile_mode="auto"); "" otherwise
    selected_tokens: int = 0  # S, targets in the shifted mask
    suffix_slots: int = 0  # positions the suffix shortcut would cover per row
    suffix_bytes: int = 0  # fp32 bytes of the [B, suffix_slots, V] logits it would take
    hidden_bytes: int = 0  # fp32 bytes of the [S, V] logits the eager selected-hidden path would take
    min_row_density: float = 0.0  # min over rows of selected / suffix_slots
    chunk_impl: str = ""  # "recompute" (custom autograd) | "checkpoint" (non-Linear head)
    extra: dict = field(default_factory=dict)


def choose_branch(policy: SelectivePolicy, info: SelectiveInfo) -> str:
    """The branch to run, from the policy and the figures in `info` (selected tokens, density, bytes).

    "compiled" is an attempt: when it cannot run, the selected-hidden path falls back to
    "hidden_chunked" or "hidden" (see `_selected_hidden_logprobs`).
    """
    if info.selected_tokens == 0:
        return "none"
    # an explicit chunk size forces the selected-hidden path
    if (policy.chunk_size is None and info.min_row_density >= policy.dense_min_density
            and info.suffix_bytes <= policy.suffix_max_bytes):
        return "suffix"
    if policy.compile_mode != "off":
        return "compiled"
    return hidden_branch(policy, info)


def hidden_branch(policy: SelectivePolicy, info: SelectiveInfo) -> str:
    """Eager or chunked selected-hidden CE: chunked when asked (`chunk_size`) or when the eager [S, V]
    logits would take more than `hidden_max_bytes` (same values, memory bounded by one chunk)."""
    if policy.chunk_size is not None or info.hidden_bytes > policy.hidden_max_bytes:
        return "hidden_chunked"
    return "hidden"


def selected_logprobs(
    hidden: Tensor,  # [B, L, H]
    lm_head: nn.Module,
    input_ids: Tensor,  # [B, L]
    target_mask: Tensor,  # [B, L] bool, True at tokens that are targets (EchoRow convention)
    *,
    temperature: float = 1.0,
    policy: SelectivePolicy = _DEFAULT_POLICY,
    logit_transform: LogitTransform | None = None,
) -> tuple[Tensor, SelectiveInfo]:  # [B, L-1] fp32, 0 where not selected
    """Dense shifted target log-probs at the selected positions, computed only there.

    `policy`: the branch thresholds (trainers/spec.py). `logit_transform`: what the model's own
    forward does to `lm_head(h)` (scale, soft-cap), applied before the temperature so these
    log-probs match the model's and the sampler's.
    """
    _check_target_mask(target_mask, input_ids, hidden.shape[:2])
    transform = logit_transform or LogitTransform()
    B, L, _ = hidden.shape
    shifted = target_mask[:, 1:].to(torch.bool)  # [B, L-1]: column j scores token j+1
    # one nonzero answers every bookkeeping question (one host sync on CUDA, few tiny ops on CPU)
    rows, cols = shifted.nonzero(as_tuple=True)  # [S], [S]
    info = SelectiveInfo(selected_tokens=rows.numel())
    out_shape = (B, max(L - 1, 0))
    if info.selected_tokens == 0:
        return hidden.new_zeros(out_shape, dtype=torch.float32), info

    per_row = torch.bincount(rows, minlength=B)  # [B]
    live = per_row.nonzero(as_tuple=True)[0]  # rows with targets; the others get no LM head at all
    first, fewest = (int(v) for v in torch.stack([cols.min(), per_row[live].min()]).tolist())
    info.suffix_slots = (L - 1) - first  # from the earliest selected column over the live rows
    info.suffix_bytes = live.numel() * info.suffix_slots * _vocab_size(lm_head) * 4
    info.min_row_density = fewest / info.suffix_slots
    info.hidden_bytes = info.selected_tokens * _vocab_size(lm_head) * 4
    info.branch = choose_branch(policy, info)
    if info.branch == "suffix":
        lp = _suffix_logprobs(hidden[live], lm_head, input_ids[live], shifted[live], first, temperature,
                              transform)
        return (lp.new_zeros(out_shape).index_copy(0, live, lp) if live.numel() < B else lp), info
    info.sparse_suffix_skip = policy.chunk_size is None

    h = hidden[rows, cols]  # [S, H]: the hidden state that predicts token cols + 1
    targets = input_ids[rows, cols + 1]  # [S]
    lp = _selected_hidden_logprobs(h, lm_head, targets, temperature, transform, policy, info)
    return lp.new_zeros(out_shape).index_put((rows, cols), lp.float()), info  # differentiable scatter


def _check_target_mask(target_mask: Tensor, input_ids: Tensor, hidden_bl: torch.Size) -> None:
    """A mask of another shape ([B, L-1], say) would be shifted a second time: refuse it."""
    if tuple(input_ids.shape) != tuple(hidden_bl) or tuple(target_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"target_mask {list(target_mask.shape)}, input_ids {list(input_ids.shape)} and "
                         f"hidden {list(hidden_bl)} x H must share [B, L]: the mask marks target tokens "
                         "(EchoRow convention, unshifted); pass the [B, L] mask, not a shifted [B, L-1] one")


def _selected_hidden_logprobs(h: Tensor, lm_head: nn.Module, targets: Tensor, temperature: float,
                              transform: LogitTransform, policy: SelectivePolicy,
                              info: SelectiveInfo) -> Tensor:  # h [S, H] -> lp [S]
    """The selected rows' log-probs: compiled CE when asked and able, else chunked or eager CE."""
    if info.branch == "compiled":
        lp, reason = compiled_selected_logprobs(h, lm_head, targets, temperature, transform,
                                                policy.compile_min_tokens)
        if lp is not None:
            info.compiled = True
            return lp
        if policy.compile_mode == "require":
            raise RuntimeError(f"train_compile_selective_ce='require': compiled CE could not run ({reason}); "
                               "use 'auto' to fall back to eager CE with the reason recorded")
        info.fallback_reason = reason
        info.branch = hidden_branch(policy, info)
    if info.branch == "hidden_chunked":
        chunk = policy.chunk_size or AUTO_CHUNK_ROWS
        if type(lm_head) is nn.Linear:
            info.chunk_impl = "recompute"
            return ChunkedSelectedLogprobs.apply(h, lm_head.weight, lm_head.bias, targets, chunk,
                                                 temperature, transform)
        # wrapped/custom heads: the same recompute-in-backward bound through activation checkpointing
        info.chunk_impl = "checkpoint"
        return checkpointed_selected_logprobs(h, lm_head, targets, chunk, temperature, transform)
    logits = tempered(transform.apply(lm_head(h).float()), temperature)  # [S, V]
    return -F.cross_entropy(logits, targets, reduction="none")


def _suffix_logprobs(hidden, lm_head, input_ids, shifted, first, temperature, transform) -> Tensor:
    """The `logits_to_keep` shape: LM head over every suffix column [first, L-1), masked to the targets."""
    B, L, _ = hidden.shape
    logits = tempered(transform.apply(lm_head(hidden[:, first:L - 1]).float()), temperature)  # [B, K, V]
    targets = input_ids[:, first + 1:]  # [B, K]
    lp = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(B, -1)
    lp = torch.where(shifted[:, first:], lp, torch.zeros_like(lp))
    return F.pad(lp, (first, 0))  # [B, L-1]


def full_logprobs(
    logits: Tensor,  # [B, L, V], the model's own output logits (its transforms already applied)
    input_ids: Tensor,  # [B, L]
    target_mask: Tensor | None,  # [B, L] bool, or None for every position
    *,
    temperature: float = 1.0,
) -> Tensor:  # [B, L-1] fp32
    """Full-vocabulary log-probs from model logits: the non-selective ("dense") and "fallback" paths."""
    if target_mask is not None:
        _check_target_mask(target_mask, input_ids, logits.shape[:2])
    lp = torch.log_softmax(tempered(logits[:, :-1].float(), temperature), dim=-1)
    lp = lp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if target_mask is None:
        return lp
    return torch.where(target_mask[:, 1:].to(torch.bool), lp, torch.zeros_like(lp))


def _vocab_size(lm_head: nn.Module) -> int:
    weight = getattr(lm_head, "weight", None)
    if isinstance(weight, Tensor):
        return weight.shape[0]
    return int(lm_head.out_features)
