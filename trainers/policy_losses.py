"""The policy-loss family (`[loss.policy]`): each RL token's loss from the trainer's log-prob `lp` (with
grad), a behaviour log-prob `lp_old` and the advantage A. One class per variant, each a frozen dataclass
holding only its own knobs, registered by its `type` in `LOSSES`; `type = "custom"` names a class of the
user's own (`import_path = "module:Class"`, `kwargs`), which subclasses `PolicyLoss` (its protocol, below).

The ratio r = exp(lp - lp_old). Without a `sampler_correction`, lp_old is the sampler's log-prob (quaero's
default: the ratio covers the sampler/trainer mismatch and an off-policy rollout's lag at once). With one,
lp_old is the trainer's own log-prob before the rollout batch's first optimizer step (TRL's
`old_per_token_logps`: sg(lp) with one step per batch, recorded once with several,
trainers/mini_steps.py), and the sampler mismatch is corrected apart by a weight
w = exp(lp_old - lp_sampler), per token or per row (summed over its targets), truncated at `cap` or
masked (set to 0) past it (TRL's `vllm_importance_sampling_mode`; Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training").

A loss whose `sequence` is true (GSPO, Zheng et al. 2025, arXiv 2507.18071; `importance_sampling_level =
"sequence"` of the others) reads one ratio per row, s = exp(mean over the row's targets of (lp - lp_old)),
at every target of the row (a row is one episode's transcript, or its part after a prefix break).

Per target token (εl, εh = `clip_eps_low`, `clip_eps_high`; sg = stop-gradient):
- ppo_clip: -min(r A, clip(r, 1 - εl, 1 + εh) A) (PPO; εh > εl is DAPO's clip-higher, arXiv 2503.14476)
- gspo: ppo_clip on the sequence ratio s
- cispo: -sg(min(r, 1 + εh)) A lp (MiniMax-M1, arXiv 2506.13585: REINFORCE with a clipped, stop-gradient
  importance weight; no token's gradient is dropped)
- sapo: -(4 / τ) σ(τ (r - 1)) A, τ = τ_pos where A > 0 else τ_neg (SAPO, arXiv 2511.20347: a soft gate
  instead of the hard clip; its gradient is r-weighted, peaks at r = 1, fades smoothly off-policy)
then times w (with a correction) and the row's scale (its step-wide denominator, trainers/aggregation.py),
summed.

Guided tokens (`EchoRow.guided`: a guide, the env's oracle, chose them; `[guidance] mode`) were never
sampled: they have no behaviour log-prob, so no ratio. Whatever the variant, each trains with LUFFY's policy
shaping (Yan et al. 2025, arXiv 2504.14945): -f(π) A with f(p) = p / (p + γ), π = exp(lp) the current
policy's probability of the token from the same forward, γ = `[guidance] gamma` (0.1, LUFFY's); no clipping,
no sampler weight. Its gradient is -A γ / (π + γ)^2 ∇π: a low-probability expert token's ∇π is weighted by
up to 1 / γ and a likely one's by about γ, where the plain ratio π / 1 (the expert's probability taken as 1)
would give ∇π itself, vanishing with π. The ratio statistics count on-policy tokens only; f(π) is measured
on the guided ones.

The default (ppo_clip, token, no correction, εl = εh = 0.2) is quaero's loss before this family, operation
for operation. The variants import torch inside their methods: the config reads their knobs (type, default,
bounds) from here before torch is imported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from torch import Tensor

    from trainers.loss import PolicyStats

Level = Literal["token", "sequence"]


def knob(default: Any, *, about: str, **bounds: Any) -> Any:
    """A loss's setting: its default, what it means (docs/reference.md) and the bounds the config checks
    (pydantic's gt, ge, lt, le); the config's `[loss.policy]` keys are these fields."""
    return field(default=default, metadata={"about": about, "bounds": bounds})


class PolicyLoss:
    """A policy loss's protocol. A variant, or a user's own loss (`type = "custom"`), subclasses it as a
    frozen dataclass whose fields are its knobs (the config's `[loss.policy]` keys, or `kwargs` for a custom
    one) and defines `token_loss`; `sequence`, `clip_stats` and `describe` have defaults. quaero does the
    rest: lp_old and the sampler weight, the ratio, guided tokens' shaping, the mask, each row's scale, the
    sum."""

    type: ClassVar[str] = "custom"

    @property
    def sequence(self) -> bool:
        """Whether the ratio is one per row (s, length-normalised) instead of one per token."""
        return False

    def token_loss(
        self,
        lp: Tensor,  # [B, L-1] fp32, the trainer's log-probs (with grad)
        lp_old: Tensor,  # [B, L-1] fp32, the behaviour log-probs (no grad)
        ratio: Tensor,  # [B, L-1] fp32, exp(lp - lp_old) per token, or each row's s (`sequence`); 1 off-mask
        advantages: Tensor,  # [B, L-1] fp32, per token
        mask: Tensor,  # [B, L-1] bool, the sampled targets
    ) -> Tensor:  # [B, L-1]: each token's loss (read on `mask` only; weighted, scaled and summed by quaero)
        raise NotImplementedError(f"{type(self).__qualname__}.token_loss")

    def clip_stats(self, ratio: Tensor, advantages: Tensor, stats: PolicyStats) -> None:
        """Count into `stats` the ratios its clip cut (`clipped`, `clipped_low`, `clipped_high`); `ratio` and
        `advantages` [N] are the sampled targets'. Default: no clip, nothing counted."""

    def describe(self, r: str) -> str:
        """Its per-token formula for `quaero check`, `r` the ratio's letter ("r" per token, "s" per row)."""
        return repr(self)

    @property
    def name(self) -> str:
        """The `policy_loss` metric's value: the variant's type, a custom loss's `module:Class`."""
        cls = type(self)
        return cls.type if cls.type != "custom" else f"{cls.__module__}:{cls.__qualname__}"


LEVEL_ABOUT = ("`token`: a ratio per token; `sequence`: one length-normalised ratio per row (GSPO's, "
               "available to every variant)")


@dataclass(frozen=True)
class _Clipped(PolicyLoss):
    """The PPO clip range [1 - clip_eps_low, 1 + clip_eps_high] (each unset: no bound on that side)."""

    clip_eps_low: float | None = knob(
        0.2, gt=0, about="the clip range's lower end 1 - clip_eps_low (unset: no lower bound; below 1)")
    clip_eps_high: float | None = knob(
        0.2, gt=0, le=1e6,
        about="its upper end 1 + clip_eps_high (unset: no upper bound; DAPO's clip-higher: 0.28)")

    def __post_init__(self) -> None:
        low = self.clip_eps_low
        if low is not None and low >= 1.0:
            raise ValueError(f"clip_eps_low={low:g}: the clip range's lower end 1 - {low:g} is <= 0, below "
                             "every ratio (the range inverts); use a value below 1 (DAPO: 0.2)")

    def bounds(self) -> tuple[float | None, float | None]:
        """The ratio's clip bounds (1 - εl, 1 + εh), None where unbounded."""
        low = None if self.clip_eps_low is None else 1.0 - self.clip_eps_low
        high = None if self.clip_eps_high is None else 1.0 + self.clip_eps_high
        return low, high

    def token_loss(self, lp: Tensor, lp_old: Tensor, ratio: Tensor, advantages: Tensor, mask: Tensor
                   ) -> Tensor:  # [B, L-1]
        import torch

        low, high = self.bounds()
        per_token = -ratio * advantages
        if low is not None or high is not None:
            clipped = -torch.clamp(ratio, low, high) * advantages
            per_token = torch.maximum(per_token, clipped)
        return per_token

    def clip_stats(self, ratio: Tensor, advantages: Tensor, stats: PolicyStats) -> None:
        """Where the clip binds, the token's gradient is 0 (TRL's clip_ratio/low, /high)."""
        import torch

        low, high = self.bounds()
        if low is None and high is None:
            return
        below = ratio < low if low is not None else torch.zeros_like(ratio, dtype=torch.bool)
        above = ratio > high if high is not None else torch.zeros_like(ratio, dtype=torch.bool)
        stats.clipped = int((below | above).sum())
        stats.clipped_low = int((below & (advantages < 0)).sum())
        stats.clipped_high = int((above & (advantages > 0)).sum())

    def describe(self, r: str) -> str:
        low, high = self.bounds()
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        return f"-min({r} A, clip({r}, {lo}, {hi}) A)"


@dataclass(frozen=True)
class PPOClip(_Clipped):
    """PPO's clipped surrogate; clip_eps_high > clip_eps_low is DAPO's clip-higher."""

    type: ClassVar[str] = "ppo_clip"
    importance_sampling_level: Level = knob("token", about=LEVEL_ABOUT)  # noqa: RUF009

    @property
    def sequence(self) -> bool:
        return self.importance_sampling_level == "sequence"


@dataclass(frozen=True)
class GSPO(_Clipped):
    """GSPO: PPO's clip on the row's sequence ratio s (always one ratio per row; its paper's ε: 3e-4 /
    4e-4)."""

    type: ClassVar[str] = "gspo"

    @property
    def sequence(self) -> bool:
        return True


@dataclass(frozen=True)
class CISPO(PolicyLoss):
    """CISPO: REINFORCE with the ratio as a clipped, stop-gradient weight -sg(min(r, 1 + εh)) A lp."""

    type: ClassVar[str] = "cispo"
    clip_eps_high: float | None = knob(
        0.2, gt=0, le=1e6, about="the weight's cap 1 + clip_eps_high (unset: no cap)")
    importance_sampling_level: Level = knob("token", about=LEVEL_ABOUT)  # noqa: RUF009

    @property
    def sequence(self) -> bool:
        return self.importance_sampling_level == "sequence"

    def _high(self) -> float | None:
        return None if self.clip_eps_high is None else 1.0 + self.clip_eps_high

    def token_loss(self, lp: Tensor, lp_old: Tensor, ratio: Tensor, advantages: Tensor, mask: Tensor
                   ) -> Tensor:  # [B, L-1]
        import torch

        high = self._high()
        weight = ratio if high is None else torch.clamp(ratio, max=high)
        return -weight.detach() * advantages * lp

    def clip_stats(self, ratio: Tensor, advantages: Tensor, stats: PolicyStats) -> None:
        """The weight truncated, whatever A's sign (no lower bound)."""
        high = self._high()
        if high is not None:
            stats.clipped = stats.clipped_high = int((ratio > high).sum())

    def describe(self, r: str) -> str:
        high = self._high()
        return f"-sg(min({r}, {'inf' if high is None else f'{high:g}'})) A log pi"


@dataclass(frozen=True)
class SAPO(PolicyLoss):
    """SAPO: a soft gate -(4 / τ) σ(τ (r - 1)) A instead of the hard clip, τ by the advantage's sign."""

    type: ClassVar[str] = "sapo"
    # within 1e-6..1e6: the loss's 4/τ stays finite in float32 (τ = 1e-300 gave a -inf loss; τ = 1e308 failed
    # the step converting it to float)
    temperature_pos: float = knob(1.0, ge=1e-6, le=1e6, about="SAPO's gate temperature where A > 0")
    temperature_neg: float = knob(1.05, ge=1e-6, le=1e6, about="SAPO's gate temperature where A < 0")
    importance_sampling_level: Level = knob("token", about=LEVEL_ABOUT)  # noqa: RUF009

    @property
    def sequence(self) -> bool:
        return self.importance_sampling_level == "sequence"

    def token_loss(self, lp: Tensor, lp_old: Tensor, ratio: Tensor, advantages: Tensor, mask: Tensor
                   ) -> Tensor:  # [B, L-1]
        import torch

        tau = torch.where(advantages > 0, self.temperature_pos, self.temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages

    def describe(self, r: str) -> str:
        return (f"-(4/tau) sigmoid(tau ({r} - 1)) A, tau {self.temperature_pos:g} (A > 0) / "
                f"{self.temperature_neg:g} (A < 0)")


# The variants by their `type` (`[loss.policy] type`): a new variant is its class above and its line here.
LOSSES: dict[str, type[PolicyLoss]] = {c.type: c for c in (PPOClip, GSPO, CISPO, SAPO)}


def custom_loss(import_path: str, kwargs: dict[str, Any]) -> PolicyLoss:
    """The user's own loss: the `PolicyLoss` subclass `import_path` ("package.module:Class") names, built
    with `kwargs`. Raises ValueError saying what is wrong and how to fix it."""
    from quaero.resolve import resolve_name

    def is_loss(c: Any) -> bool:
        return isinstance(c, type) and issubclass(c, PolicyLoss)

    cls = resolve_name(import_path, "import_path", want=is_loss, error=ValueError,
                       example="my_loss:Reinforce",
                       wanted="a PolicyLoss subclass (docs/reference.md, \"Your own policy loss\")")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"import_path={import_path!r} with kwargs={kwargs!r}: {e}; pass the keyword "
                         f"arguments {cls.__qualname__} takes") from None
    except Exception as e:  # noqa: BLE001 - the user's own constructor: one line at check, not a traceback
        raise ValueError(f"import_path={import_path!r} with kwargs={kwargs!r}: {cls.__qualname__}(...) "
                         f"raised {type(e).__name__}: {e}; fix the class or its kwargs") from None


def _zero_outside(x: Tensor, mask: Tensor) -> Tensor:
    import torch

    return torch.where(mask, x, torch.zeros_like(x))


def sampler_weight(
    old_logprobs: Tensor,  # [B, L-1] fp32, the trainer's log-probs before the step (no grad)
    sampler_logprobs: Tensor,  # [B, L-1] fp32
    mask: Tensor,  # [B, L-1] bool, RL targets
    correction: str,
    cap: float,
) -> tuple[Tensor, Tensor, Tensor]:  # each [B, L-1]: the weight, the raw ratio, whether it was cut
    """The sampler-mismatch weight w of every target: exp(lp_old - lp_sampler) per token, or per row
    exp(sum over its targets), truncated at `cap` (`*_truncate`) or 0 past it (`*_mask`)."""
    import torch

    with torch.no_grad():
        diff = _zero_outside(old_logprobs - sampler_logprobs, mask)
        if correction.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True).expand_as(diff)
        raw = torch.exp(diff)
        cut = raw > cap
        if correction.endswith("truncate"):
            weight = torch.clamp(raw, max=cap)
        elif correction.endswith("mask"):
            weight = raw.masked_fill(cut, 0.0)
        else:
            raise ValueError(f"sampler_correction={correction!r}: use 'none', 'token_truncate', "
                             "'token_mask', 'sequence_truncate' or 'sequence_mask'")
    return weight, raw, cut


@dataclass(frozen=True)
class Behaviour:
    """What the policy loss's lp_old is, and the guided tokens' γ: the settings every variant shares
    (`[loss] sampler_correction`, `sampler_correction_cap`, `[guidance] gamma`)."""

    correction: str = "none"  # none | token_truncate | token_mask | sequence_truncate | sequence_mask
    cap: float = 3.0
    gamma: float = 0.1  # policy shaping's γ on guided tokens


def importance_ratio(
    logprobs: Tensor,  # [B, L-1] fp32, with grad
    old: Tensor,  # [B, L-1] fp32, the behaviour log-probs
    mask: Tensor,  # [B, L-1] bool, the sampled targets
    sequence: bool,
) -> Tensor:  # [B, L-1]
    """r = exp(lp - lp_old) per target, or per row s = exp(mean over its targets of lp - lp_old) (GSPO)."""
    import torch

    log_ratio = _zero_outside(logprobs - old, mask)
    if not sequence:
        return torch.exp(log_ratio)
    seq_log_ratio = log_ratio.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [B, 1]
    return torch.exp(seq_log_ratio).expand_as(logprobs)


def _shaping_stats(f: Tensor, stats: PolicyStats) -> None:  # f [G], f(π) of the guided tokens
    stats.guided_tokens, stats.shaping_sum = int(f.numel()), float(f.sum())
    stats.shaping_min, stats.shaping_max = float(f.min()), float(f.max())


def policy_loss(
    logprobs: Tensor,  # [B, L-1] fp32, trainer log-probs (with grad)
    sampler_logprobs: Tensor,  # [B, L-1] fp32, the sampler's log-probs of the same tokens
    advantages: Tensor,  # [B, L-1] fp32, per token
    mask: Tensor,  # [B, L-1] bool, action tokens with non-zero advantage
    scale: Tensor,  # [B, 1] fp32, each row's token factor (the step's denominator included)
    loss: PolicyLoss,
    behaviour: Behaviour = Behaviour(),  # frozen: one shared default is safe
    old_logprobs: Tensor | None = None,  # [B, L-1] fp32, recorded before the batch's first step, or None
    guided: Tensor | None = None,  # [B, L-1] bool, tokens a guide chose (policy shaping), or None: none
) -> tuple[Tensor, PolicyStats]:
    """The step's RL loss over this microbatch (sum over targets of scale x `loss.token_loss`) and its
    statistics; the module docstring has each variant's formula, and the guided tokens' shaping. With a
    correction, lp_old is `old_logprobs` where recorded (several optimizer steps per rollout batch), else
    sg(lp)."""
    import torch

    from trainers.loss import PolicyStats

    full = mask
    mask = mask if guided is None else mask & ~guided  # the sampled targets: the ratio's
    weight = None
    if behaviour.correction == "none":
        old = sampler_logprobs
    else:
        old = logprobs.detach() if old_logprobs is None else old_logprobs
        weight, raw, cut = sampler_weight(old, sampler_logprobs, mask, behaviour.correction, behaviour.cap)
    ratio = importance_ratio(logprobs, old, mask, loss.sequence)
    per_token = loss.token_loss(logprobs, old, ratio, advantages, mask)
    if weight is not None:
        per_token = per_token * weight
    shaping = None
    if guided is not None:
        guide = full & guided
        prob = torch.exp(logprobs)
        shaping = prob / (prob + behaviour.gamma)  # f(π), with π's gradient: no ratio, no clip, no weight
        per_token = torch.where(guide, -shaping * advantages, per_token)
    total = (_zero_outside(per_token, full) * scale).sum()
    stats = PolicyStats(tokens=int(mask.sum()))
    if shaping is not None and bool(guide.any()):
        _shaping_stats(shaping[guide].detach(), stats)
    if stats.tokens:
        with torch.no_grad():
            r, a = ratio[mask], advantages[mask]
            stats.ratio_sum = float(r.sum())
            loss.clip_stats(r, a, stats)
            if weight is not None:
                raw_r = raw[mask]
                stats.is_tokens, stats.is_sum = int(raw_r.numel()), float(raw_r.sum())
                stats.is_max, stats.is_cut = float(raw_r.max()), int(cut[mask].sum())
            if loss.sequence:
                rows = mask.any(-1)
                seq = ratio[:, 0][rows]
                stats.sequences, stats.seq_ratio_sum = int(seq.numel()), float(seq.sum())
                stats.seq_ratio_min, stats.seq_ratio_max = float(seq.min()), float(seq.max())
    return total, stats
