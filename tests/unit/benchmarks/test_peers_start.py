"""`quaero bench peers-trl --from RUN`: both sides' AdamW start from the checkpoint's state as the main job's
RL phase does after its warm start ([training] rl_optimizer_start), and hash alike when they do. No TRL
needed: the TRL side builds a plain torch AdamW over its model's parameters and goes through the same
function."""
import types

import pytest
import torch
from fixtures.small_model import make_spec

from benchmarks.peers_trl_sides import optimizer_sha, start_optimizer
from benchmarks.smoke import sparse_rows
from quaero.recipe import checkpoint
from trainers.local import LocalTrainer


def _cfg(start: str, lr: float = 5e-4):
    return types.SimpleNamespace(backend=types.SimpleNamespace(lr=lr),
                                 training=types.SimpleNamespace(rl_optimizer_start=start))


@pytest.fixture(scope="module")
def saved(small_model_dir, tmp_path_factory):
    """A trainer after two steps and its checkpoint folder."""
    trainer = LocalTrainer(make_spec(small_model_dir), "cpu")
    rows = sparse_rows(2, vocab=trainer.model.config.vocab_size, context=40)
    trainer.train_step(rows)
    trainer.train_step(rows)
    state = checkpoint.RunState(step=2, cursor=0, trainer=trainer.state_dict(), rng=checkpoint.rng_state(),
                                cumulative={})
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    return trainer, checkpoint.save(root, 2, state.to_state())


def _fresh(small_model_dir):
    model = LocalTrainer(make_spec(small_model_dir), "cpu").model
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("start", ["reset_momentum", "continue", "reset"])
def test_the_checkpoints_adamw_state_starts_rl_as_rl_optimizer_start_says(small_model_dir, saved, start):
    trainer, path = saved
    model, optimizer = _fresh(small_model_dir)
    start_optimizer(optimizer, {"optimizer_from": str(path)}, _cfg(start))
    assert all(g["lr"] == 5e-4 for g in optimizer.param_groups)
    params = list(model.parameters())
    if start == "reset":
        assert not optimizer.state
        return
    for p, q in zip(params, trainer.trainable):
        got, want = optimizer.state[p], trainer.optimizer.state[q]
        assert float(got["step"]) == float(want["step"]) == 2.0
        assert torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])
        if start == "continue":
            assert torch.equal(got["exp_avg"], want["exp_avg"])
        else:
            assert not got["exp_avg"].any() and want["exp_avg"].any()


def test_two_optimizers_started_alike_hash_alike_whatever_their_grouping(small_model_dir, saved):
    _, path = saved
    (m1, o1), (m2, _) = _fresh(small_model_dir), _fresh(small_model_dir)
    # TRL groups decayed and undecayed parameters apart: two groups, another order
    params = list(m2.parameters())
    o2 = torch.optim.AdamW([{"params": params[1::2]}, {"params": params[::2]}], lr=1e-3)
    assert optimizer_sha(m1, o1) == optimizer_sha(m2, o2)  # both empty
    start_optimizer(o1, {"optimizer_from": str(path)}, _cfg("reset_momentum"))
    assert optimizer_sha(m1, o1) != optimizer_sha(m2, o2)
    m3, o3 = _fresh(small_model_dir)
    start_optimizer(o3, {"optimizer_from": str(path)}, _cfg("reset_momentum"))
    assert optimizer_sha(m1, o1) == optimizer_sha(m3, o3)


def test_a_checkpoint_of_another_model_is_refused(saved):
    _, path = saved
    other = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="does not fit this model's parameters"):
        start_optimizer(torch.optim.AdamW(other.parameters()), {"optimizer_from": str(path)},
                        _cfg("continue"))
