"""The run's wired parts (quaero/recipe/parts.py): each env's sessions started, an env that fails named."""
from __future__ import annotations

import pytest

from quaero.telemetry.counts import RolloutCounts


@pytest.mark.hostile
def test_a_mixture_env_that_fails_to_start_is_named(tmp_path):
    import contextlib

    from quaero.config import QuaeroConfig
    from quaero.recipe.parts import open_pools

    cfg = QuaeroConfig.model_validate({"run": {"output_dir": str(tmp_path)}, "envs": [
        {"name": "sum", "entry": "fixtures.taskenv:SumEnv", "launcher": "inprocess"},
        {"name": "bad", "entry": "fixtures.broken_import:Env", "launcher": "inprocess"}]})
    with contextlib.ExitStack() as stack, pytest.raises(Exception, match=r"\[\[envs\]\] name='bad' failed to "
                                                                          r"start: ") as e:
        open_pools(stack, cfg, RolloutCounts())
    assert "\n" not in str(e.value)
