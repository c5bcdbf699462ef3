"""The KL penalty in the main job (trainers/reference.py): the reference frozen at the first RL step (the warm
start's weights: KL 0 there), a resume from an RL checkpoint equal to the uninterrupted run (the reference
restored from the checkpoint, not re-taken from moved weights), and `quaero review` showing the KL figures."""
import shutil

import pytest
from fixtures.runs import events_of, make_config

from quaero.tools import review


@pytest.mark.slow
def test_a_kl_run_freezes_the_warm_start_and_resumes_exactly(tmp_path):
    from quaero.recipe.train import train

    extra = ["loss.beta=0.5"]  # checkpointed at the first RL step (2) and the last (3)
    _, cfg = make_config(tmp_path, "kl", steps=2, warmup=1, eval_every=0, eval_tasks=0, extra=extra)
    run_dir = train(cfg)
    first = {e["step"]: e for e in events_of(run_dir, "train_step")}
    assert [first[s]["phase"] for s in (1, 2, 3)] == ["sft", "rl", "rl"]
    assert first[1]["kl_tokens"] == 0 and first[1]["kl_mean"] is None  # the warm start has no reference
    assert first[2]["kl_tokens"] > 0 and first[2]["kl_mean"] == pytest.approx(0.0, abs=1e-5)
    assert first[2]["reference_forward_s"] > 0
    assert first[3]["kl_mean"] > 1e-6  # the policy moved off the warm start's weights
    figures = review.summarize(review.load_run(run_dir)).policy_loss
    assert figures["kl_mean_last"] == pytest.approx(first[3]["kl_mean"]) and "kl_max" in figures

    shutil.rmtree(run_dir / "checkpoints" / "step-000003")  # back to the first RL step's, and on from there
    shutil.rmtree(run_dir / "final", ignore_errors=True)
    train(cfg, resume=True)
    again = [e for e in events_of(run_dir, "train_step")][len(first):]
    assert [e["step"] for e in again] == [3]
    for e in again:
        for key in ("loss", "rl_loss", "kl_loss", "kl_mean", "kl_max", "grad_norm", "action_tokens"):
            assert e[key] == pytest.approx(first[e["step"]][key], rel=1e-6, abs=1e-9), (e["step"], key)
