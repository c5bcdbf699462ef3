"""The config sections' common ground: `ConfigError` (one line: file, key, value, fix), the section base
(unknown keys refused, no inf/nan) and `with_trainer_options`, which gives a section the trainer options its
key names (trainers/spec.py `option`).
"""
from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
)

from trainers.spec import options


class ConfigError(ValueError):
    """A config problem, phrased for the user: file, key, value and the fix, on one line."""


class _Section(BaseModel):
    # inf/nan are never meaningful settings (a weight of inf trains nothing but NaNs)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def with_trainer_options(section: str):
    """The section class written below it, plus the trainer options whose key is in `section`: each is
    defined once, by its `option(...)` in trainers/spec.py (type, default, meaning, bounds), and reaches the
    trainer's spec by that key (quaero/preflight/plan.py `trainer_spec`)."""

    def build(cls: type[_Section]) -> type[_Section]:
        fields = {o.name: (o.type, Field(o.default, description=o.about, **o.bounds)) for o in options()
                  if o.section == section}
        return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__,
                            **fields)

    return build

