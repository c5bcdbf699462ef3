"""EchoRows -> padded microbatch tensors, with the step-wide loss denominators.

Rows are packed greedily (longest first) into microbatches whose padded size `B x L_max` stays within
`micro_batch_tokens` (a row longer than the budget gets a microbatch of its own). Where tree packing will
forward a microbatch as its trie (trainers/tree.py), rows go in prefix order and the budget counts what the
packed forward runs over: the trie's unique tokens plus the rows' gathered hidden states and the mask
(`plan_tree_microbatches`), so a group's rows sharing a long prompt fill one microbatch where their padded
tokens would fill several. Padding is on the right with id 0 and never a target. The optional
`train_supervised_context_tokens` crop happens here.

Which tokens are targets is the loss terms' (trainers/terms.py): each gives, per row and token, its target
weight (0: not its target), and the tokens whose log-probs it reads without training them; this module
names no term. The selective path's targets (`Microbatch.target_mask`) and the crop's first target are the
union over the terms.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import Tensor

from quaero.rows import EchoRow


@dataclass
class Microbatch:
    """One microbatch; every tensor is [B, L] in the EchoRow convention (entry i describes token i)."""

    input_ids: Tensor  # long
    attention_mask: Tensor  # long, 1 on real tokens
    advantages: Tensor  # fp32
    sampler_logprobs: Tensor  # fp32
    action_mask: Tensor  # bool, sampled action tokens
    # per loss term (trainers/terms.py, by name): fp32, each token's weight as the term's target (0: none;
    # token 0, which has no left context, never is one)
    weights: dict[str, Tensor]
    reads: Tensor  # bool, tokens whose log-probs a term reads without training them (the sampler gap)
    row_index: list[int]  # positions of these rows in the step's row list
    # per loss term (by name): fp32 [B, 1], each row's token factor, the term's step-wide denominator
    # included (trainers/aggregation.py)
    scales: dict[str, Tensor]
    # fp32, the trainer's own log-probs recorded before a rollout batch's first optimizer step (several steps
    # per batch with a sampler correction: trainers/mini_steps.py); None: not recorded
    old_logprobs: Tensor | None = None
    # bool, action tokens a guide chose (`EchoRow.guided`: off-policy, no sampler log-prob); None: none
    guided: Tensor | None = None
    # fp32, the frozen reference's log-probs at the KL term's targets (trainers/reference.py); None: no KL
    ref_logprobs: Tensor | None = None

    def targets(self, term: str) -> Tensor:  # [B, L] bool
        """The tokens loss term `term` trains."""
        return self.weights[term] != 0

    @property
    def trains(self) -> bool:
        """Whether any loss reads this microbatch (else it needs no forward at all)."""
        return any(bool(self.targets(name).any()) for name in self.weights)

    @property
    def target_mask(self) -> Tensor:  # [B, L] bool: the selective path's targets
        """Every term's targets and every token a term reads: the sampler gap is measured on every sampled
        action token, also where the advantage is 0 (those log-probs get no gradient: no loss reads them)."""
        mask = self.reads.clone()
        for name in self.weights:
            mask |= self.targets(name)
        return mask

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass
class CropStats:
    rows_cropped: int = 0
    tokens_removed: int = 0


def first_target(weights: list[list[float]]) -> int | None:
    """The first token that is some term's target, given each term's weights of one row."""
    found = [next((i for i, w in enumerate(ws) if w != 0.0), None) for ws in weights]
    return min((i for i in found if i is not None), default=None)


def crop_start(first: int | None, context_tokens: int) -> int:
    """`train_supervised_context_tokens` = K > 0: keep K tokens before the row's first target (`first`).

    An approximation (the cropped row starts mid-transcript, positions restart at 0); K = 0 is exact.
    """
    if context_tokens <= 0:
        return 0
    return 0 if first is None else max(0, first - context_tokens)


def plan_microbatches(lengths: list[int], micro_batch_tokens: int, order: list[int] | None = None
                      ) -> list[list[int]]:
    """Greedy packing of row indices, in `order` (longest first when none), so that
    len(group) * max_len <= micro_batch_tokens."""
    if order is None:
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    longest = 0
    for i in order:
        if groups and (len(groups[-1]) + 1) * max(longest, lengths[i]) <= micro_batch_tokens:
            groups[-1].append(i)
            longest = max(longest, lengths[i])
        else:
            groups.append([i])
            longest = lengths[i]
    return groups


def prefix_order(ids: list[list[int]]) -> list[int]:
    """Row indices in the lexicographic order of their tokens: rows that share a prefix are neighbours, so
    they share microbatches (tree training's trie, trainers/tree.py, forwards their prefix once)."""
    return sorted(range(len(ids)), key=lambda i: ids[i])


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens `a` and `b` share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# a microbatch's cost in backbone tokens from (unique tokens, row tokens, rows, longest row): trainers/tree.py
# `planner_cost`
TrieCost = Callable[[int, int, int, int], float]


def plan_tree_microbatches(ids: list[list[int]], micro_batch_tokens: int, cost: TrieCost) -> list[list[int]]:
    """Row indices per microbatch where tree packing forwards each as its trie: rows in prefix order
    (`prefix_order`), cut into contiguous runs whose `cost` stays within `micro_batch_tokens` (a row that
    alone exceeds it gets a microbatch of its own). In that order a run's unique tokens are its first row's
    plus, per further row, its tokens past its common prefix with the row before it. Where the next row does
    not fit, the run is cut where its rows share the fewest tokens (between groups rather than inside one)
    if that shares less than cutting before the row, so a group's prompt is forwarded once, not per piece."""
    order = prefix_order(ids)
    shared = [0] + [common_prefix(ids[a], ids[b]) for a, b in pairwise(order)]

    def fits(run: list[int]) -> bool:  # positions in `order`, contiguous
        lengths = [len(ids[order[k]]) for k in run]
        unique = lengths[0] + sum(n - shared[k] for n, k in zip(lengths[1:], run[1:]))
        return cost(unique, sum(lengths), len(run), max(lengths)) <= micro_batch_tokens

    runs: list[list[int]] = []
    run: list[int] = []
    for k in range(len(order)):
        if not run or fits([*run, k]):
            run.append(k)
            continue
        cut = min(range(1, len(run)), key=lambda j: (shared[run[j]], -j), default=None)
        if cut is not None and shared[run[cut]] < shared[k] and fits([*run[cut:], k]):
            runs.append(run[:cut])
            run = [*run[cut:], k]
        else:
            runs.append(run)
            run = [k]
    if run:
        runs.append(run)
    return [[order[k] for k in r] for r in runs]


def build_microbatches(rows: list[EchoRow], *, micro_batch_tokens: int,
                       weights: dict[str, list[list[float]]], reads: list[list[bool]] | None = None,
                       context_tokens: int = 0, device: str | torch.device = "cpu",
                       scales: dict[str, list[float]] | None = None,
                       old_logprobs: list[list[float]] | None = None,
                       ref_logprobs: list[list[float]] | None = None, by_prefix: bool = False,
                       trie_cost: TrieCost | None = None) -> tuple[list[Microbatch], CropStats]:
    """Pack rows into microbatches. `weights`: per loss term's name, per row, each token's weight as its
    target (trainers/terms.py `row_targets`); `reads`: per row, the tokens whose log-probs are read without
    training them (none given: none). `scales`: per term's name, per row, its token factors (none given:
    none). `old_logprobs`: per row, per token, the trainer's recorded log-probs; `ref_logprobs`: the
    reference's (none given: none). `by_prefix`: rows sharing a prefix packed together (`prefix_order`), else
    longest first. `trie_cost`: where tree packing will forward microbatches as tries, their cost
    (`plan_tree_microbatches`); none: every microbatch is planned on its padded rows."""
    scales = scales or {}
    starts = [crop_start(first_target([per_row[i] for per_row in weights.values()]), context_tokens)
              for i in range(len(rows))]
    crop = CropStats(sum(s > 0 for s in starts), sum(starts))
    lengths = [len(r) - s for r, s in zip(rows, starts)]
    out = []
    cropped = [r.input_ids[s:] for r, s in zip(rows, starts)]
    if trie_cost is not None:
        plan = plan_tree_microbatches(cropped, micro_batch_tokens, trie_cost)
    else:
        plan = plan_microbatches(lengths, micro_batch_tokens, prefix_order(cropped) if by_prefix else None)
    for group in plan:
        B, L = len(group), max(lengths[i] for i in group)
        ids = torch.zeros(B, L, dtype=torch.long)
        attn = torch.zeros(B, L, dtype=torch.long)
        adv, old, recorded, ref = torch.zeros(B, L), torch.zeros(B, L), torch.zeros(B, L), torch.zeros(B, L)
        act, seen = torch.zeros(B, L, dtype=torch.bool), torch.zeros(B, L, dtype=torch.bool)
        guided = torch.zeros(B, L, dtype=torch.bool)
        term_weights = {name: torch.zeros(B, L) for name in weights}
        for b, i in enumerate(group):
            r, s, n = rows[i], starts[i], lengths[i]
            ids[b, :n] = torch.tensor(r.input_ids[s:], dtype=torch.long)
            attn[b, :n] = 1
            adv[b, :n] = torch.tensor(r.advantages[s:])
            old[b, :n] = torch.tensor(r.sampler_logprobs[s:])
            if old_logprobs is not None:
                recorded[b, :n] = torch.tensor(old_logprobs[i][s:], dtype=torch.float32)
            if ref_logprobs is not None:
                ref[b, :n] = torch.tensor(ref_logprobs[i][s:], dtype=torch.float32)
            act[b, :n] = torch.tensor(r.action_mask[s:])
            if r.guided:
                guided[b, :n] = torch.tensor(r.guided[s:], dtype=torch.bool)
            if reads is not None:
                seen[b, :n] = torch.tensor(reads[i][s:], dtype=torch.bool)
            for name, per_row in weights.items():
                term_weights[name][b, :n] = torch.tensor(per_row[i][s:], dtype=torch.float32)
        for w in term_weights.values():
            w[:, 0] = 0.0  # token 0 has no left context (also after a crop)
        mb_scales = {name: torch.tensor([[per_row[i]] for i in group], dtype=torch.float32).to(device)
                     for name, per_row in scales.items()}
        on_device = {name: w.to(device) for name, w in term_weights.items()}
        out.append(Microbatch(ids.to(device), attn.to(device), adv.to(device), old.to(device), act.to(device),
                              on_device, seen.to(device), group, mb_scales,
                              None if old_logprobs is None else recorded.to(device),
                              guided.to(device) if bool(guided.any()) else None,
                              None if ref_logprobs is None else ref.to(device)))
    return out, crop
