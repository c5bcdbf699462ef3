"""EchoRow: one training row, the contract between the episode driver and the trainer backends. It carries
what every loss term reads (RL advantages, ECHO weights, the sampler's log-probs, the spans), not ECHO's
alone: the name is ECHO's for history and kept (docs/reference.md, What the kept names really switch).

Token convention: every per-token list has length L = len(input_ids), and entry i describes
input_ids[i] *as a target*, predicted from input_ids[:i]. Entry 0 therefore never carries a loss.
The trainer's shifted log-prob tensor `[B, L-1]` at column j scores token j + 1.

A row validates itself on construction: equal lengths, spans in bounds and non-overlapping,
advantages only on action tokens, ECHO weights only on environment tokens (never on actions,
prompts or corrective messages), the two masks disjoint, every number finite.
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

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("advantages", "echo_weights", "sampler_logprobs"):
            if len(getattr(self, name)) != n:
                raise RowError(f"EchoRow.{name} has {len(getattr(self, name))} entries for {n} tokens")
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
        return {"input_ids": self.input_ids, "spans": [[s.kind, s.start, s.end, s.turn] for s in self.spans],
                "advantages": self.advantages, "echo_weights": self.echo_weights,
                "sampler_logprobs": self.sampler_logprobs, "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> EchoRow:
        return cls(d["input_ids"], [Span(*s) for s in d["spans"]], d["advantages"],
                   d["echo_weights"], d["sampler_logprobs"], d.get("meta", {}))


# ── Layouts: from an episode's transitions to rows ─────────────────────────────────────────────


@dataclass
class Transition:
    """One executed turn, exactly as sampled and bridged.

    prompt_ids: the full-render sampling prompt the sampler was given.
    action_ids / action_logprobs: exactly what the sampler returned (never re-encoded).
    response_ids / response_kinds: the env response the renderer bridged onto prompt + action
    (scaffold, env content or corrective content per token); empty when the bridge fell back.
    """

    turn: int
    prompt_ids: list[int]
    action_ids: list[int]
    action_logprobs: list[float]
    response_ids: list[int]
    response_kinds: list[str]
    finish_reason: str = "stop"

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.action_ids + self.response_ids


class _RowBuilder:
    def __init__(self, include_scaffold: bool):
        self.include_scaffold = include_scaffold
        self.ids: list[int] = []
        self.spans: list[Span] = []
        self.logprobs: list[float] = []
        self.weights: list[float] = []
        self.turns: list[int] = []

    def _add(self, kind: str, ids: list[int], turn: int, logprobs: list[float] | None = None) -> None:
        if not ids:
            return
        start = len(self.ids)
        self.ids += ids
        self.spans.append(Span(kind, start, len(self.ids), turn))
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        w = 1.0 if kind == "env" or (kind == "scaffold" and self.include_scaffold) else 0.0
        self.weights += [w] * len(ids)

    def add(self, t: Transition) -> None:
        self._add("prompt", t.prompt_ids[len(self.ids):], t.turn)  # the whole prompt, or the new suffix
        self._add("action", t.action_ids, t.turn, list(t.action_logprobs))
        i = 0
        while i < len(t.response_ids):  # one span per run of equal kinds
            j = i
            while j < len(t.response_ids) and t.response_kinds[j] == t.response_kinds[i]:
                j += 1
            self._add(t.response_kinds[i], t.response_ids[i:j], t.turn)
            i = j
        self.turns.append(t.turn)

    def row(self) -> EchoRow:
        weights = list(self.weights)
        if weights:
            weights[0] = 0.0  # token 0 has no left context
        layout = "packed" if len(self.turns) > 1 else "transition"
        return EchoRow(self.ids, self.spans, [0.0] * len(self.ids), weights, self.logprobs,
                       meta={"turns": list(self.turns), "layout": layout})


def build_rows(transitions: list[Transition], *, packing: bool = True, include_scaffold: bool = False,
               max_seq_len: int | None = None) -> list[EchoRow]:
    """Lay an episode's transitions out as rows.

    Per-transition (retrain's layout): one row per turn, [prompt | action | env response].
    Packed: when a turn's sampling prompt is an exact token extension of the current row, the turn is
    appended to it (only the prompt's new suffix is added), so a T-turn episode costs O(T) tokens instead
    of O(T^2). Every target keeps exactly the same tokens to its left, so its log-prob is unchanged;
    otherwise a new row starts. Advantages are 0 here; `EchoRow.with_advantage` sets them.

    Lengths: a packed row is exactly as long as its last transition (that turn's prompt holds the whole
    row before it), so when every transition fits `max_seq_len` every row does; the episode driver cuts
    transitions to fit, and a longer one is a RowError here.
    """
    rows: list[EchoRow] = []
    cur: _RowBuilder | None = None
    for t in transitions:
        if max_seq_len is not None and len(t.ids) > max_seq_len:
            raise RowError(f"turn {t.turn} holds {len(t.ids)} tokens, more than max_seq_len={max_seq_len}")
        extends = cur is not None and packing and t.prompt_ids[:len(cur.ids)] == cur.ids
        if not extends:
            if cur is not None:
                rows.append(cur.row())
            cur = _RowBuilder(include_scaffold)
        cur.add(t)
    if cur is not None:
        rows.append(cur.row())
    return rows


def per_transition_tokens(transitions: list[Transition]) -> int:
    """Tokens the per-transition layout would train for these transitions (the O(T^2) baseline)."""
    return sum(len(t.ids) for t in transitions)
