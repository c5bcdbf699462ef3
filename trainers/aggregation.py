"""How each loss term averages its per-token losses over a step: the per-row token scale.

A term's step loss is `sum over its tokens of scale(row) * loss(token)`; the scale already holds the
step-wide denominator, so microbatches and ranks add up to the one-process step whatever the split.
Scales come from the whole step's rows (every rank holds them all), so no collective is needed.

RL term (`[loss] aggregation`):
- `token_mean` (DAPO; quaero's default): every RL token of the step weighs 1 / N, N = the step's RL
  tokens (action tokens with A != 0). A long failed episode weighs more than a short success.
- `sequence_mean` (GRPO): each episode's RL tokens are averaged, then episodes are averaged:
  scale = 1 / (n_e * E), n_e = the episode's RL tokens, E = episodes with n_e > 0.
- `constant` (Dr. GRPO): scale = 1 / C with C fixed by the config (the recipe passes the step's most
  action tokens: tasks x group x max_turns x max_tokens), so a token's weight never depends on the
  lengths of the other episodes.
The SFT warm start is always `token_mean` (mean NLL over demonstrated action tokens).

ECHO term (`[echo] normalization`), each token also weighted by its row's ECHO weight:
- `token`: 1 / M over the step's M ECHO tokens (weight > 0).
- `sequence` (the ECHO paper's `full_observation_tokens` with a sequence mean, retrain's per-rollout
  normalisation): 1 / (m_e * F), m_e = the episode's ECHO tokens, F = episodes with m_e > 0.

An episode is the rows sharing `meta["episode"]` (the recipe sets it); a row without it is its own episode.
Token 0 is never a target (it has no left context), so it is never counted.
"""
from __future__ import annotations

from collections import Counter
from typing import Literal

from quaero.rows import EchoRow

RLAggregation = Literal["token_mean", "sequence_mean", "constant"]
EchoNormalization = Literal["token", "sequence"]


def _episode_keys(rows: list[EchoRow]) -> list[object]:
    return [r.meta.get("episode", ("row", i)) for i, r in enumerate(rows)]


def _sequence_scales(rows: list[EchoRow], counts: list[int]) -> list[float]:
    keys = _episode_keys(rows)
    per_episode: Counter = Counter()
    for key, n in zip(keys, counts):
        per_episode[key] += n
    episodes = sum(1 for n in per_episode.values() if n)
    return [1.0 / (per_episode[k] * episodes) if per_episode[k] else 0.0 for k in keys]


def rl_scales(rows: list[EchoRow], counts: list[int], *, sft: bool, aggregation: RLAggregation = "token_mean",
              constant: int = 0) -> list[float]:
    """Per row: the factor each of its RL-term tokens is multiplied by (the denominator included), given each
    row's RL-term tokens (`counts`: trainers/terms.py `PolicyTerm` names them)."""
    if sft or aggregation == "token_mean":
        return [1.0 / max(sum(counts), 1)] * len(rows)
    if aggregation == "sequence_mean":
        return _sequence_scales(rows, counts)
    if aggregation == "constant":
        if constant < 1:
            raise ValueError(f"loss_aggregation='constant' needs a normaliser >= 1, got {constant}")
        return [1.0 / constant] * len(rows)
    raise ValueError(f"loss_aggregation={aggregation!r}: use 'token_mean', 'sequence_mean' or 'constant'")


def echo_scales(rows: list[EchoRow], counts: list[int], *, normalization: EchoNormalization = "token"
                ) -> list[float]:
    """Per row: the factor each of its ECHO tokens is multiplied by (before its ECHO weight and λ), given each
    row's ECHO tokens (`counts`: trainers/terms.py `EchoTerm` names them)."""
    if normalization == "token":
        return [1.0 / max(sum(counts), 1)] * len(rows)
    if normalization == "sequence":
        return _sequence_scales(rows, counts)
    raise ValueError(f"echo normalization={normalization!r}: use 'token' or 'sequence'")
