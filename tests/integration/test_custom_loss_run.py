"""examples/custom_loss as a user runs it: `quaero train` on its TOML, the loss class imported from the user's
own module (`[loss.policy] type = "custom"`), trains every RL step with it through the whole recipe."""
import json
from pathlib import Path

import pytest

from quaero import cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_loss"


@pytest.mark.slow
def test_quaero_train_runs_the_users_own_loss_named_in_its_toml(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # what the example's PYTHONPATH gives a user
    toml = EXAMPLE / "train.toml"
    assert cli.main(["train", str(toml), "--set", f"run.output_dir={str(tmp_path)!r}"]) == 0
    events = [json.loads(line) for line in (tmp_path / "custom-loss" / "events.jsonl").open()]
    rl = [e for e in events if e["event"] == "train_step" and e["phase"] == "rl"]
    assert len(rl) == 2
    for step in rl:  # the user's class computed each RL step's loss, and the optimizer stepped on it
        assert step["policy_loss"] == "my_loss:Reinforce" and step["action_tokens"] > 0
        assert step["rl_loss"] != 0.0 and step["optimizer_stepped"]
