"""`quaero bench peers-trl` at the smallest job: one RL step of quaero and one of TRL's GRPOTrainer, and the
comparison's own invariants (same initial weights, same tasks, same group shapes). Timings are reported by
the benchmark, never tested. Needs TRL (`pip install -e ".[peers]"`); skipped with that reason elsewhere
(CI runs it in a venv of its own: `.ci/run`)."""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.peers]

SMALL_JOB = ["rollout.tasks_per_step=1", "rollout.group_size=2", "sampler.max_tokens=8", "env.max_turns=2"]


def _trained_checkpoint(tmp_path):
    """A checkpoint whose AdamW state is not empty (one step of the tiny model), as `--from RUN` passes it."""
    from benchmarks.smoke import sparse_rows
    from quaero.recipe import checkpoint
    from trainers.local import LocalTrainer
    from trainers.spec import TrainerSpec

    trainer = LocalTrainer(TrainerSpec(model="tiny-qwen3", lr=1e-3), "cpu")
    trainer.train_step(sparse_rows(2, vocab=trainer.model.config.vocab_size, context=40))
    state = checkpoint.RunState(step=1, cursor=0, trainer=trainer.state_dict(), rng=checkpoint.rng_state(),
                                cumulative={})
    return checkpoint.save(tmp_path / "warm" / "checkpoints", 1, state.to_state())


def test_one_step_of_each_side_on_the_same_job(tmp_path, tiny_model_dir):
    from benchmarks.peers_trl import MIN_TRL, invariants, prepare_model, run_repeat

    pytest.importorskip("trl", minversion=MIN_TRL, reason=f'needs TRL >= {MIN_TRL}; pip install -e '
                                                          '".[peers]"')

    model = prepare_model("tiny-qwen3", tmp_path)
    setup = {"config": "envs/toolbench.toml", "overrides": SMALL_JOB, "model": str(model), "steps": 1,
             "seed": 1,
             "threads": 1, "out": str(tmp_path / "run"), "trl_max_completion_length": 64,
             "save_final": str(tmp_path / "final"), "optimizer_from": str(_trained_checkpoint(tmp_path))}
    # run seed 1 orders the train split (seed 0 plays 0, 1, 2, ...): both sides must follow that order
    run = run_repeat(setup, 0)
    checks = invariants([run])
    # --from: one AdamW state on both
    assert checks["ok"] and checks["same_initial_optimizer"] is True, checks
    q, t = run["steps"]["quaero"][0], run["steps"]["trl"][0]
    # one task, reset with the same seed, split, index
    assert q["tasks"] == t["tasks"] and len(q["tasks"]) == 1
    assert q["group_sizes"] == t["group_sizes"] == [2]
    assert t["drift"]["rows"] == 2 and t["drift"]["unmatched_calls"] == 0  # every sampler call found its row
    # quaero's rows are exact by construction
    assert q["drift"]["rows"] >= 1 and q["drift"]["rows_drifted"] == 0
    assert run["final"]["quaero"]["peak_rss_mb"] > 0 and run["final"]["trl"]["peak_rss_mb"] > 0
    for name in ("quaero", "trl"):  # --save-final: each side's last weights as an HF folder quaero eval loads
        final = run["final"][name]
        assert final["final_weights"] == str(tmp_path / "final" / name)
        assert (tmp_path / "final" / name / "config.json").exists()
        assert (tmp_path / "final" / name / "model.safetensors").exists()
        assert (tmp_path / "final" / name / "tokenizer_config.json").exists()
