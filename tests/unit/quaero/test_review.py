"""`quaero review` on recorded logs: table values, proofs pass and fail, plots, crashed runs."""
import json
from types import SimpleNamespace

import pytest

from quaero import metrics, proofs, review

SPARSE = {"local_train_selective_suffix_logits": True, "local_train_selective_sparse_suffix_skips": 2,
          "local_train_selective_hidden_logprob_batches": 2, "local_train_selective_fallback_logprob_batches": 0,
          "local_train_selective_suffix_logprob_batches": 0, "local_train_selective_compiled_ce_batches": 0,
          "local_train_compile_selective_ce_mode": "auto",
          "local_train_compile_selective_ce_fallback_reason": "cpu device"}


def record(run_dir, steps, *, end=True, torn=False, evals=()):
    metrics.configure(console="none")
    log = metrics.get_logger("test")
    with metrics.RunLog(run_dir, run_id="r1"):
        log.info("run_start")
        for i, fields in enumerate(steps, start=1):
            metrics.set_step(i)
            log.info("train_step", phase=fields.pop("phase", "rl"), **fields)
        for step, r in evals:
            metrics.set_step(step)
            log.info("eval", eval_reward=r, eval_success_rate=r)
        if end:
            log.info("run_end", status="finished")
    if torn:
        with open(run_dir / "events.jsonl", "a") as f:
            f.write('{"event": "train_step", "step": 99, "loc')


def args(run_dir=None, **kw):
    base = {"run_dir": str(run_dir) if run_dir else None, "require_proof": False, "require": [], "plots": None,
            "json": False, "compare": None}
    return SimpleNamespace(**{**base, **kw})


def good_steps(n=4):
    return [dict(SPARSE, rl_loss=0.1 * i, echo_loss=5.0 - i, reward_mean=0.1 * i, action_tokens=10, echo_tokens=20,
                 row_tokens=100, step_time_s=1.0, peak_mem_mb=100.0 + i, prefix_mismatches=0, env_retries=1,
                 sampler_logprob_gap_max=1e-6) for i in range(n)]


def test_table_values_and_passing_proofs(tmp_path, capsys):
    record(tmp_path, good_steps(), evals=[(0, 0.0), (4, 0.5)])
    run = review.load_run(tmp_path)
    s = review.summarize(run)
    assert s["steps"] == 4 and s["local_train_selective_hidden_logprob_batches"] == 8
    assert s["action_tokens"] == 40 and s["env_retries"] == 4 and s["peak_mem_mb"] == 103.0
    assert s["eval_reward_baseline"] == 0.0 and s["eval_reward_last"] == 0.5
    assert s["echo_loss_last"] < s["echo_loss_first"]
    assert review.main(args(tmp_path, require_proof=True)) == 0
    out = capsys.readouterr().out
    assert "[PASS] sparse ECHO proof" in out and "[PASS] ECHO loss falling" in out


def test_echo_curve_skips_steps_without_echo_targets_and_reason_keeps_latest(tmp_path):
    steps = good_steps()
    steps[-1].update(echo_loss=0.0, echo_tokens=0, local_train_compile_selective_ce_fallback_reason="")
    record(tmp_path, steps)
    s = review.summarize(review.load_run(tmp_path))
    assert (s["echo_loss_first"], s["echo_loss_last"]) == (5.0, 3.0)  # the 0.0 of the target-free step is not a point
    assert s["local_train_compile_selective_ce_fallback_reason"] == "cpu device"


def test_fallback_batches_fail_the_sparse_proof(tmp_path, capsys):
    steps = good_steps()
    steps[2]["local_train_selective_fallback_logprob_batches"] = 1
    record(tmp_path, steps)
    assert review.main(args(tmp_path)) == 0  # without --require-proof a failed proof is reported only
    assert "[FAIL] sparse ECHO proof" in capsys.readouterr().out
    assert review.main(args(tmp_path, require_proof=True)) == 1


def test_compiled_ce_proof_only_in_require_mode(tmp_path):
    steps = [dict(s, local_train_compile_selective_ce_mode="require",
                  local_train_compile_selective_ce_fallback_reason="") for s in good_steps()]
    record(tmp_path, steps)
    names = {c["name"]: c for c in proofs.run_checks(review.summarize(review.load_run(tmp_path)))}
    assert names["compiled CE proof"]["passed"] is False  # no compiled batches ran
    assert review.main(args(tmp_path, require_proof=True)) == 1


def test_prefix_mismatch_fails(tmp_path):
    steps = good_steps()
    steps[1]["prefix_mismatches"] = 2
    record(tmp_path, steps)
    assert review.main(args(tmp_path, require_proof=True)) == 1


def test_crashed_run_with_torn_line_is_reviewed(tmp_path, capsys):
    record(tmp_path, good_steps(3), end=False, torn=True)
    assert review.main(args(tmp_path, json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["steps"] == 3 and out["summary"]["finished"] is False


def test_resumed_step_counts_once(tmp_path):
    record(tmp_path / "a", good_steps(3))
    events = (tmp_path / "a" / "events.jsonl").read_text().splitlines()
    step3 = [e for e in events if '"train_step"' in e][-1]
    with open(tmp_path / "a" / "events.jsonl", "a") as f:  # step 3 re-run after a resume
        f.write(step3 + "\n")
    assert review.summarize(review.load_run(tmp_path / "a"))["steps"] == 3


def test_plots_are_valid_pngs(tmp_path):
    record(tmp_path, good_steps(), evals=[(0, 0.0), (4, 0.5)])
    assert review.main(args(tmp_path, plots=str(tmp_path / "plots"))) == 0
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.stem for p in pngs] == ["branches", "losses", "memory", "reward"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_compare_side_by_side(tmp_path, capsys):
    record(tmp_path / "a", good_steps(2))
    record(tmp_path / "b", good_steps(4))
    assert review.main(args(compare=[str(tmp_path / "a"), str(tmp_path / "b")])) == 0
    out = capsys.readouterr().out
    assert "steps" in out and str(tmp_path / "b") in out


def test_missing_run_dir_is_a_clean_error(tmp_path, capsys):
    assert review.main(args(tmp_path / "nope")) == 1
    assert "no events.jsonl" in capsys.readouterr().err


@pytest.fixture(autouse=True)
def _reset_structlog():
    yield
    metrics.configure(console="none")
