"""EchoRow: one training row, the contract between the rollout that builds rows (quaero/rollout/rows.py)
and the trainers that train on them, on the ground floor so that every layer can import it. It carries
what every loss term reads (RL advantages, ECHO weights, the sampler's log-probs, the spans), not ECHO's
alone: the name is ECHO's for history and kept (docs/reference.md, What the kept names really switch).

Token convention: every per-token list has length L = len(input_ids), and entry i describes
input_ids[i] *as a target*, predicted from input_ids[:i]. Entry 0 therefore never carries a loss.
The trainer's shifted log-prob tensor `[B, L-1]` at column j scores token j + 1.

A row validates itself on construction: equal lengths, spans in bounds and non-overlapping,
advantages only on action tokens, ECHO weights only on environment tokens (never on actions,
prompts or corrective messages), the two masks disjoint, every number finite, the guided flag (a guide's
tokens: the env's oracle played them, not the policy) on action tokens only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

SpanKind = Literal["prompt", "action", "env", "scaffold", "corrective"]
ECHO_KINDS = frozenset({"env", "scaffold"})  # kinds that may carry ECHO weight


class RowError(ValueError):
    """An EchoRow that breaks its contract (a bug upstream, never silently repaired)."""


@dataclass(frozen=True)
class Span:
    """Half-open token range [start, end) of one part of a row.

    kind: prompt (context the sampler was given), action (tokens the sampler returned),
    env (model-visible environment response content), scaffold (template tokens around the env
    response: `<|im_start|>user\\n`, `<tool_response>` wrappers, the next generation prompt),
    corrective (quaero's message after a malformed action; never an ECHO target).
    turn: the episode turn the tokens belong to (-1 when unknown); a packed row holds several turns.
    """

    kind: SpanKind
    start: int
    end: int
    turn: int = -1


@dataclass
class EchoRow:
    input_ids: list[int]
    spans: list[Span]
    advantages: list[float]
    echo_weights: list[float]
    sampler_logprobs: list[float]
    meta: dict = field(default_factory=dict)
    # per token, True where a guide (the env's oracle, `[guidance] mode`) chose the action token, not the
    # sampler: off-policy, no sampler log-prob, trained with policy shaping (trainers/policy_losses.py);
    # empty: no guided token (every row the policy sampled)
    guided: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("advantages", "echo_weights", "sampler_logprobs"):
            if len(getattr(self, name)) != n:
                raise RowError(f"EchoRow.{name} has {len(getattr(self, name))} entries for {n} tokens")
        if self.guided and len(self.guided) != n:
            raise RowError(f"EchoRow.guided has {len(self.guided)} entries for {n} tokens (or none)")
        kind_of = [""] * n
        last_end = 0
        for s in sorted(self.spans, key=lambda s: s.start):
            if not (0 <= s.start <= s.end <= n):
                raise RowError(f"EchoRow span {s} is outside [0, {n})")
            if s.start < last_end:
                raise RowError(f"EchoRow span {s} overlaps the previous span")
            last_end = s.end
            kind_of[s.start:s.end] = [s.kind] * (s.end - s.start)
        for i, (a, w, lp) in enumerate(zip(self.advantages, self.echo_weights, self.sampler_logprobs)):
            if not (math.isfinite(a) and math.isfinite(w) and math.isfinite(lp)):
                raise RowError(f"EchoRow token {i}: non-finite advantage/echo weight/logprob")
            if a != 0.0 and kind_of[i] != "action":
                raise RowError(f"EchoRow token {i}: advantage {a} on a {kind_of[i] or 'unlabelled'} token")
            if w < 0.0:
                raise RowError(f"EchoRow token {i}: negative ECHO weight {w}")
            if w > 0.0 and kind_of[i] not in ECHO_KINDS:
                raise RowError(f"EchoRow token {i}: ECHO weight {w} on a {kind_of[i] or 'unlabelled'} token")
        for i, g in enumerate(self.guided):
            if g and kind_of[i] != "action":
                raise RowError(f"EchoRow token {i}: guided on a {kind_of[i] or 'unlabelled'} token (only "
                               "action tokens are a guide's)")
        if n and (self.advantages[0] != 0.0 or self.echo_weights[0] != 0.0):
            raise RowError("EchoRow token 0 cannot be a target (it has no left context)")

    def __len__(self) -> int:
        return len(self.input_ids)

    def kind_mask(self, kind: SpanKind) -> list[bool]:
        mask = [False] * len(self.input_ids)
        for s in self.spans:
            if s.kind == kind:
                mask[s.start:s.end] = [True] * (s.end - s.start)
        return mask

    @property
    def action_mask(self) -> list[bool]:
        return self.kind_mask("action")

    @property
    def guided_mask(self) -> list[bool]:
        """Per token: whether a guide chose it (all False for a row the policy sampled)."""
        return list(self.guided) if self.guided else [False] * len(self.input_ids)

    def as_guided(self) -> EchoRow:
        """The same row with every action token marked guided (an episode a guide played whole)."""
        return replace(self, guided=self.action_mask)

    @property
    def num_action_tokens(self) -> int:
        return sum(s.end - s.start for s in self.spans if s.kind == "action")

    @property
    def num_echo_tokens(self) -> int:
        return sum(1 for w in self.echo_weights if w > 0.0)

    def with_advantage(self, advantage: float, episode: str | None = None,
                       reward: float | None = None) -> EchoRow:
        """The same row with `advantage` on every sampled action token (group-relative RL); `episode` names
        the episode it belongs to (`meta["episode"]`: the rows a sequence-mean loss averages together) and
        `reward` is that episode's (`meta["reward"]`: what a saved row's export reports)."""
        mask = self.action_mask
        meta = self.meta if episode is None else {**self.meta, "episode": episode}
        if reward is not None:
            meta = {**meta, "reward": reward}
        return replace(self, advantages=[advantage if m else 0.0 for m in mask], meta=meta)

    def to_dict(self) -> dict:
        out = {"input_ids": self.input_ids, "spans": [[s.kind, s.start, s.end, s.turn] for s in self.spans],
               "advantages": self.advantages, "echo_weights": self.echo_weights,
               "sampler_logprobs": self.sampler_logprobs, "meta": self.meta}
        return {**out, "guided": self.guided} if any(self.guided) else out

    @classmethod
    def from_dict(cls, d: dict) -> EchoRow:
        return cls(d["input_ids"], [Span(*s) for s in d["spans"]], d["advantages"],
                   d["echo_weights"], d["sampler_logprobs"], d.get("meta", {}), d.get("guided", []))
