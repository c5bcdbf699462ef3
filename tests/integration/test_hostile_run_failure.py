"""A run that fails mid-way (quaero/recipe/train.py): the last completed step is kept as a checkpoint and the
events end with run_end "failed" naming the error, so a resume loses no trained step. The fault: a weight push
a vLLM server refuses at step 2 (a `collective_rpc` 500), injected at the recipe's push; the run is real
(toolbench in process, tiny-qwen3, the local trainer)."""
import pytest
from fixtures.runs import events_of, make_config

from quaero.sampling.server import ServerError

pytestmark = pytest.mark.hostile


@pytest.mark.slow
def test_a_weight_push_that_fails_at_step_2_keeps_step_1_and_logs_run_end(tmp_path, monkeypatch):
    import quaero.recipe.train as recipe

    _, cfg = make_config(tmp_path, "push", steps=3, warmup=0, eval_every=0, eval_tasks=0,
                         extra=["env.launcher='inprocess'"])  # checkpoint_every = 2: step 1 is not due
    pushes = []
    real_sync = recipe.sync_sampler

    def push_fails_at_step_2(parts, progress):
        pushes.append(1)
        if len(pushes) == 2:
            raise ServerError("vLLM server http://127.0.0.1:9/collective_rpc answered 500: reload failed")
        return real_sync(parts, progress)

    monkeypatch.setattr(recipe, "sync_sampler", push_fails_at_step_2)
    with pytest.raises(ServerError):
        recipe.train(cfg)
    assert [p.name for p in (cfg.run_dir / "checkpoints").glob("step-*")] == ["step-000001"]
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "failed" and end["steps"] == 1 and end["checkpoint_step"] == 1
    assert end["error"] == ("ServerError: vLLM server http://127.0.0.1:9/collective_rpc answered 500: "
                            "reload failed")

    monkeypatch.setattr(recipe, "sync_sampler", real_sync)
    recipe.train(cfg)  # resumes after step 1: steps 2 and 3 train on the tasks they would have had
    (resumed,) = events_of(cfg.run_dir, "resumed")
    assert resumed["step"] == 1
    steps = events_of(cfg.run_dir, "train_step")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert events_of(cfg.run_dir, "run_end")[-1]["status"] == "finished"
