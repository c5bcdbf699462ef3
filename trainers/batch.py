"""EchoRows -> padded microbatch tensors, with the step-wide loss denominators.

Rows are packed greedily (longest first) into microbatches whose padded size `B x L_max` stays within
`micro_batch_tokens` (a row longer than the budget gets a microbatch of its own). Padding is on the
right with id 0 and never a target. The optional `train_supervised_context_tokens` crop happens here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from quaero.rollout.rows import EchoRow


@dataclass
class Microbatch:
    """One microbatch; every tensor is [B, L] in the EchoRow convention (entry i describes token i)."""

    input_ids: Tensor  # long
    attention_mask: Tensor  # long, 1 on real tokens
    advantages: Tensor  # fp32
    echo_weights: Tensor  # fp32, 0 where ECHO is off
    sampler_logprobs: Tensor  # fp32
    action_mask: Tensor  # bool, sampled action tokens
    rl_mask: Tensor  # bool, tokens the policy-gradient (or SFT NLL) term reads
    echo_mask: Tensor  # bool, tokens the ECHO term reads
    row_index: list[int]  # positions of these rows in the step's row list
    # per loss term (trainers/terms.py, by name): fp32 [B, 1], each row's token factor, the term's step-wide
    # denominator included (trainers/aggregation.py)
    scales: dict[str, Tensor]

    @property
    def trains(self) -> bool:
        """Whether any loss reads this microbatch (else it needs no forward at all)."""
        return bool((self.rl_mask | self.echo_mask).any())

    @property
    def target_mask(self) -> Tensor:  # [B, L] bool: the selective path's targets
        """The loss targets, and every sampled action token: the sampler gap is measured on all of them,
        also where the advantage is 0 (those log-probs get no gradient: no loss reads them)."""
        return self.rl_mask | self.echo_mask | self.action_mask

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class CropStats:
    rows_cropped: int = 0
    tokens_removed: int = 0


def first_target(row: EchoRow, *, sft: bool, echo: bool) -> int | None:
    for i, (a, w) in enumerate(zip(row.advantages, row.echo_weights)):
        if (sft and row.action_mask[i]) or a != 0.0 or (echo and w > 0.0):
            return i
    return None


def crop_start(row: EchoRow, context_tokens: int, *, sft: bool, echo: bool) -> int:
    """`train_supervised_context_tokens` = K > 0: keep K tokens before the row's first target.

    An approximation (the cropped row starts mid-transcript, positions restart at 0); K = 0 is exact.
    """
    if context_tokens <= 0:
        return 0
    first = first_target(row, sft=sft, echo=echo)
    return 0 if first is None else max(0, first - context_tokens)


def plan_microbatches(lengths: list[int], micro_batch_tokens: int) -> list[list[int]]:
    """Greedy longest-first packing of row indices so that len(group) * max_len <= micro_batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= micro_batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def build_microbatches(rows: list[EchoRow], *, micro_batch_tokens: int, sft: bool, echo: bool,
                       context_tokens: int = 0, device: str | torch.device = "cpu",
                       scales: dict[str, list[float]] | None = None) -> tuple[list[Microbatch], CropStats]:
    """Pack rows into microbatches. `sft`: every action token is an RL-side target (plain NLL);
    otherwise action tokens with non-zero advantage. `echo`: positive ECHO weights are targets.
    `scales`: per loss term's name, per row, its token factors (none given: no term's)."""
    scales = scales or {}
    starts = [crop_start(r, context_tokens, sft=sft, echo=echo) for r in rows]
    crop = CropStats(sum(s > 0 for s in starts), sum(starts))
    lengths = [len(r) - s for r, s in zip(rows, starts)]
    out = []
    for group in plan_microbatches(lengths, micro_batch_tokens):
        B, L = len(group), max(lengths[i] for i in group)
        ids = torch.zeros(B, L, dtype=torch.long)
        attn = torch.zeros(B, L, dtype=torch.long)
        adv, ew, old = (torch.zeros(B, L) for _ in range(3))
        act = torch.zeros(B, L, dtype=torch.bool)
        for b, i in enumerate(group):
            r, s, n = rows[i], starts[i], lengths[i]
            ids[b, :n] = torch.tensor(r.input_ids[s:], dtype=torch.long)
            attn[b, :n] = 1
            adv[b, :n] = torch.tensor(r.advantages[s:])
            ew[b, :n] = torch.tensor(r.echo_weights[s:])
            old[b, :n] = torch.tensor(r.sampler_logprobs[s:])
            act[b, :n] = torch.tensor(r.action_mask[s:])
        ew = ew if echo else torch.zeros_like(ew)
        rl_mask = act if sft else act & (adv != 0)
        rl_mask[:, 0] = False  # token 0 has no left context (also after a crop)
        echo_mask = ew > 0
        echo_mask[:, 0] = False
        mb_scales = {name: torch.tensor([[per_row[i]] for i in group], dtype=torch.float32).to(device)
                     for name, per_row in scales.items()}
        out.append(Microbatch(ids.to(device), attn.to(device), adv.to(device), ew.to(device), old.to(device),
                              act.to(device), rl_mask.to(device), echo_mask.to(device), group, mb_scales))
    return out, crop
