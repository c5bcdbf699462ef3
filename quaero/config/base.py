"""The config sections' common ground: `ConfigError` (one line: file, key, value, fix), `Located` (a
section's rule, in its validator), the section base
(unknown keys refused, no inf/nan), `with_trainer_options`, which gives a section the options its key names
(trainers/spec.py `option`: the trainer's, and a role's settings such as the advantage estimator's), and
`settings_of`, which reads a role's settings back from a config.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
)

from trainers.spec import TrainerSpec, options, spec_from


class ConfigError(ValueError):
    """A config problem, phrased for the user: file, key, value and the fix, on one line."""


class Located(ValueError):
    """A section's rule broken, its message naming the keys it judges ("weight_transfer='nccl' with
    urls=..."): printed after the section, as `[sampler] weight_transfer='nccl' with ...`."""


class _Section(BaseModel):
    # inf/nan are never meaningful settings (a weight of inf trains nothing but NaNs)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def with_trainer_options(section: str, *roles: type):
    """The section class written below it, plus the options whose key is in `section`, the trainer's
    (trainers/spec.py) and those of each role's settings in `roles`: each is defined once, by its
    `option(...)` (type, default, meaning, bounds), and reaches the trainer's spec or the role by that key
    (quaero/preflight/plan.py `trainer_spec`, `settings_of`)."""

    def build(cls: type[_Section]) -> type[_Section]:
        fields = {o.name: (o.type, Field(o.default, description=o.about, **o.bounds))
                  for role in (*roles, TrainerSpec) for o in options(role) if o.section == section}
        return create_model(cls.__name__, __base__=cls, __module__=cls.__module__, __doc__=cls.__doc__,
                            **fields)

    return build


def settings_of(cls: type, cfg: Any) -> Any:
    """The `cls` settings (a frozen dataclass of `option`s) a config holds: each field read at its key."""
    return spec_from(lambda key: attrgetter(key)(cfg), cls)

