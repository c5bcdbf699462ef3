"""`[loss]`: the RL loss's settings: the trainer's options keyed there (trainers/spec.py: how lp_old is
corrected for the sampler, the KL penalty, the RL term's `aggregation`) and `[loss.policy]`, the policy
loss, one of trainers/policy_losses.py's variants picked by `type` with that variant's own knobs (each
section's keys read from the variant's fields: type, default, meaning, bounds), or `type = "custom"`: a
`PolicyLoss` subclass of the user's own, named by `import_path` and built with `kwargs`.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import Field, PrivateAttr, create_model, model_validator

from quaero.config.base import Located, _Section, with_trainer_options
from trainers.policy_losses import LOSSES, PolicyLoss, custom_loss

DEFAULT_TYPE = "ppo_clip"


class _Variant(_Section):
    """One built-in variant's settings: `type` and the knobs of its class (LOSSES[type])."""

    def build(self) -> PolicyLoss:
        """The loss these settings make (its class's own rules, `__post_init__`, judge them)."""
        return LOSSES[self.type](**self.model_dump(exclude={"type"}))

    @model_validator(mode="after")
    def _its_rules(self) -> _Variant:
        self.build()  # a ValueError here is the config's error line at [loss.policy]
        return self


def _variant_section(kind: str, cls: type[PolicyLoss]) -> type[_Variant]:
    hints = typing.get_type_hints(cls)
    knobs = {f.name: (hints[f.name], Field(f.default, description=f.metadata.get("about"),
                                            **f.metadata.get("bounds", {})))
             for f in dataclasses.fields(cls)}
    return create_model(f"{cls.__name__}Loss", __base__=_Variant, __module__=__name__,
                        __doc__=cls.__doc__, type=(Literal[kind], Field(kind, description=f"`{kind}`")),
                        **knobs)


VARIANTS: dict[str, type[_Section]] = {kind: _variant_section(kind, cls) for kind, cls in LOSSES.items()}


class CustomLoss(_Section):
    """A policy loss of your own: the `trainers.policy_losses.PolicyLoss` subclass `import_path` names
    ("package.module:Class", importable here), built with `kwargs` (docs/reference.md, "Your own policy
    loss")."""

    type: Literal["custom"] = "custom"
    import_path: str = Field(description="`package.module:Class` of a `PolicyLoss` subclass of your own")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="its keyword arguments")
    _loss: PolicyLoss | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _importable(self) -> CustomLoss:
        self._loss = custom_loss(self.import_path, self.kwargs)
        return self

    def build(self) -> PolicyLoss:
        return self._loss


VARIANTS["custom"] = CustomLoss
PolicyLossSettings = Annotated[Union[tuple(VARIANTS.values())], Field(discriminator="type")]  # noqa: UP007


@with_trainer_options("loss")
class LossConfig(_Section):
    """The RL loss: the trainer's `[loss]` options and `[loss.policy]`, the policy loss (`type` and its
    knobs; default ppo_clip). `aggregation` is the RL term's average (trainers/aggregation.py): "token_mean"
    (DAPO), "sequence_mean" (GRPO: per episode, then over episodes), "constant" (Dr. GRPO: / tasks_per_step x
    group_size x max_turns x max_tokens)."""

    policy: PolicyLossSettings = Field(
        default_factory=VARIANTS[DEFAULT_TYPE],
        description="the policy loss: a variant of trainers/policy_losses.py, or your own (\"The policy "
                    "loss\" below)")

    @model_validator(mode="before")
    @classmethod
    def _default_type(cls, data: Any) -> Any:
        # `[loss.policy]` without a type is ppo_clip's knobs
        if isinstance(data, dict) and isinstance(data.get("policy"), dict) and "type" not in data["policy"]:
            data = {**data, "policy": {"type": DEFAULT_TYPE, **data["policy"]}}
        return data

    @model_validator(mode="after")
    def _a_correction_that_keeps_on_policy_tokens(self) -> LossConfig:
        if self.sampler_correction != "none" and self.sampler_correction_cap < 1.0:
            raise Located(f"sampler_correction_cap={self.sampler_correction_cap:g}: below 1, the "
                             f"{self.sampler_correction!r} weight of every on-policy token (1) would be cut; "
                             "use a cap >= 1 (TRL's default: 3)")
        return self
