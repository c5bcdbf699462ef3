"""Token drift: does a trainer score, as actions, exactly the tokens its sampler produced?

Two sources, one count (`DriftCount`), per trained row:
- `differ`: a sampled token whose position in the scored row holds another id;
- `not_scored`: a sampled token the trainer does not score as an action (masked out, or cut off the row);
- `scored_not_sampled`: a token scored as an action that no sampler call produced at that position
  (e.g. a re-tokenized or template-made token).
A row drifts when any of the three is non-zero. `differ + scored_not_sampled` are tokens the loss reads
that the sampler did not produce; `not_scored` are sampled tokens the loss never reads.

`generation_drift` reads a generate-then-score trainer (TRL's GRPOTrainer): the sampler calls as
(prompt ids, returned ids) and the scored rows as (ids, action mask), and finds each call's row by its
prompt, which is a prefix of the row it continues. `saved_row_drift` reads quaero's saved rows
(`runs/NAME/rows/step-*.jsonl`): each action span against the sampler's ids of its turn.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class DriftCount:
    rows: int = 0
    rows_drifted: int = 0
    sampled_tokens: int = 0
    scored_action_tokens: int = 0
    differ: int = 0
    not_scored: int = 0
    scored_not_sampled: int = 0
    unmatched_calls: int = 0  # sampler calls whose prompt starts no scored row

    def add_row(self, sampled: int, scored: int, differ: int, not_scored: int, extra: int) -> None:
        self.rows += 1
        self.rows_drifted += int(bool(differ or not_scored or extra))
        self.sampled_tokens += sampled
        self.scored_action_tokens += scored
        self.differ += differ
        self.not_scored += not_scored
        self.scored_not_sampled += extra

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def generation_drift(calls: list[tuple[list[int], list[int]]],
                     rows: list[tuple[list[int], list[bool]]]) -> DriftCount:
    """`calls`: (prompt ids, sampled ids) of every sampler call, in call order; `rows`: (ids, action mask)
    of every scored row. A call belongs to a row whose ids start with its prompt, preferring one that holds
    the sampled ids right after it (two rows of one group can share a prompt); each row takes at most
    one call per prompt length."""
    sampled_at: list[dict[int, int]] = [{} for _ in rows]  # row -> {position: sampled id}
    taken: list[set[int]] = [set() for _ in rows]  # prompt lengths already matched, per row
    out = DriftCount()
    for prompt, sampled in calls:
        n = len(prompt)
        candidates = [r for r, (ids, _) in enumerate(rows) if n not in taken[r] and ids[:n] == prompt]
        exact = [r for r in candidates if rows[r][0][n:n + len(sampled)] == sampled]
        chosen = (exact or candidates or [None])[0]
        if chosen is None:
            out.unmatched_calls += 1
            continue
        taken[chosen].add(n)
        sampled_at[chosen].update({n + j: t for j, t in enumerate(sampled)})
    for (ids, mask), at in zip(rows, sampled_at):
        differ = sum(1 for p, t in at.items() if p < len(ids) and ids[p] != t)
        not_scored = sum(1 for p in at if p >= len(ids) or not mask[p])
        extra = sum(1 for p, m in enumerate(mask) if m and p not in at)
        out.add_row(len(at), sum(mask), differ, not_scored, extra)
    return out


def saved_row_drift(records: list[dict]) -> DriftCount:
    """Drift of quaero's saved rows: every action span's ids against `sampled_actions` of its turn."""
    out = DriftCount()
    for rec in records:
        ids = rec["input_ids"]
        sampled = {a["turn"]: a["action_ids"] for a in rec.get("sampled_actions", [])}
        spans = [(start, end, turn) for kind, start, end, turn in rec["spans"] if kind == "action"]
        differ = not_scored = extra = scored = 0
        for start, end, turn in spans:
            got, want = ids[start:end], sampled.get(turn, [])
            scored += end - start
            differ += sum(1 for a, b in zip(got, want) if a != b)
            not_scored += max(0, len(want) - len(got))
            extra += max(0, len(got) - len(want))
        span_turns = {turn for _, _, turn in spans}
        not_scored += sum(len(ids_) for turn, ids_ in sampled.items() if turn not in span_turns)
        out.add_row(sum(len(v) for v in sampled.values()), scored, differ, not_scored, extra)
    return out
