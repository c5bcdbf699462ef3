"""`quaero review` on recorded logs: table values, proofs pass, fail and n/a, --require, plots, crashed runs,
damaged files."""
import json
from types import SimpleNamespace

import pytest

from quaero import cli
from quaero.telemetry import names, proofs, runlog
from quaero.tools import review, review_command

SPARSE = {"local_train_selective_suffix_logits": True, "local_train_selective_sparse_suffix_skips": 2,
          "local_train_selective_hidden_logprob_batches": 2,
          "local_train_selective_fallback_logprob_batches": 0,
          "local_train_selective_suffix_logprob_batches": 0, "local_train_selective_compiled_ce_batches": 0,
          "local_train_compile_selective_ce_mode": "auto",
          "local_train_compile_selective_ce_fallback_reason": "cpu device"}


def record(run_dir, steps, *, end=True, torn=False, evals=()):
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    with runlog.RunLog(run_dir, run_id="r1"):
        log.info("run_start")
        for i, fields in enumerate(steps, start=1):
            runlog.set_step(i)
            log.info("train_step", phase=fields.pop("phase", "rl"), **fields)
        for step, r in evals:
            runlog.set_step(step)
            log.info("eval", eval_reward=r, eval_success_rate=r)
        if end:
            log.info("run_end", status="finished")
    if torn:
        with open(run_dir / "events.jsonl", "a") as f:
            f.write('{"event": "train_step", "step": 99, "loc')


def args(run_dir=None, **kw):
    base = {"run_dir": str(run_dir) if run_dir else None, "require_proof": False, "require": [],
            "plots": None,
            "json": False, "compare": None}
    return SimpleNamespace(**{**base, **kw})


def good_steps(n=4):
    return [dict(SPARSE, rl_loss=0.1 * i, echo_loss=5.0 - i, reward_mean=0.1 * i, action_tokens=10,
                 echo_tokens=20,
                 row_tokens=100, step_time_s=1.0, peak_mem_mb=100.0 + i, prefix_mismatches=0, env_retries=1,
                 sampler_logprob_gap_max=1e-6, rows=4) for i in range(n)]


def test_table_values_and_passing_proofs(tmp_path, capsys):
    record(tmp_path, good_steps(), evals=[(0, 0.0), (4, 0.5)])
    run = review.load_run(tmp_path)
    s = review.summarize(run)
    assert s.steps == 4 and s.selective[names.HIDDEN_BATCHES] == 8
    assert s.action_tokens == 40 and s.env_retries == 4 and s.peak_mem_mb == 103.0
    assert s.eval_reward_baseline == 0.0 and s.eval_reward_last == 0.5
    assert s.echo_loss_last < s.echo_loss_first
    assert s.policy_staleness_max is None and s.clip_fraction_max is None  # the steps logged neither
    assert review_command.main(args(tmp_path, require_proof=True)) == 0
    out = capsys.readouterr().out
    assert "[PASS] sparse ECHO proof" in out and "[PASS] ECHO loss falling" in out


def test_the_policy_loss_figures_show_where_the_run_has_them(tmp_path, capsys):
    """The loss family's metrics (clip fractions, sampler weights, KL, GSPO's sequence ratio) total over the
    RL steps that measured them; a run without them shows none."""
    steps = good_steps(3)
    for i, st in enumerate(steps):
        st.update(clip_low_fraction=0.1 * i, clip_high_fraction=0.2, kl_mean=None if i == 0 else 0.01 * i,
                  kl_max=0.5 * i, sequence_ratio_min=1.0 - 0.1 * i, sequence_ratio_max=1.0 + 0.1 * i,
                  sampler_is_weight_mean=None, reference_forward_s=0.5)
    record(tmp_path, steps)
    s = review.summarize(review.load_run(tmp_path))
    assert s.policy_loss == pytest.approx({
        "clip_low_fraction_mean": 0.1, "clip_high_fraction_mean": 0.2, "kl_mean": 0.015,
        "kl_mean_last": 0.02, "kl_max": 1.0, "sequence_ratio_min": 0.8, "sequence_ratio_max": 1.2,
        "reference_forward_s_mean": 0.5})
    assert review_command.main(args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "kl_mean_last" in out and "clip_high_fraction_mean" in out and "sampler_is" not in out
    plain = tmp_path / "plain"
    record(plain, good_steps(2))
    assert review.summarize(review.load_run(plain)).policy_loss == {}


def test_the_summary_names_the_weight_transfer_that_ran(tmp_path, capsys):
    steps = good_steps()
    steps[1].update(weights_pushed=1, weight_transfer="nccl")
    steps[3].update(weights_pushed=1, weight_transfer="nccl")
    record(tmp_path, steps)
    assert review.summarize(review.load_run(tmp_path)).weight_transfer == "nccl"
    assert review_command.main(args(tmp_path)) == 0
    assert any(line.split() == ["weight_transfer", "nccl"] for line in capsys.readouterr().out.splitlines())
    record(tmp_path / "none", good_steps())  # nothing pushed (a shared module): no transfer to name
    assert review.summarize(review.load_run(tmp_path / "none")).weight_transfer is None


def test_echo_curve_skips_steps_without_echo_targets_and_reason_keeps_latest(tmp_path):
    steps = good_steps()
    steps[-1].update(echo_loss=0.0, echo_tokens=0, local_train_compile_selective_ce_fallback_reason="")
    record(tmp_path, steps)
    s = review.summarize(review.load_run(tmp_path))
    # the 0.0 of the target-free step is not a point
    assert (s.echo_loss_first, s.echo_loss_last) == (5.0, 3.0)
    assert s.selective[names.COMPILE_FALLBACK_REASON] == "cpu device"


def test_fallback_batches_fail_the_sparse_proof(tmp_path, capsys):
    steps = good_steps()
    steps[2]["local_train_selective_fallback_logprob_batches"] = 1
    record(tmp_path, steps)
    assert review_command.main(args(tmp_path)) == 0  # without --require-proof a failed proof is reported only
    assert "[FAIL] sparse ECHO proof" in capsys.readouterr().out
    assert review_command.main(args(tmp_path, require_proof=True)) == 1


def test_compiled_ce_proof_only_in_require_mode(tmp_path):
    steps = [dict(s, local_train_compile_selective_ce_mode="require",
                  local_train_compile_selective_ce_fallback_reason="") for s in good_steps()]
    record(tmp_path, steps)
    checks = {c.name: c for c in proofs.run_checks(review.summarize(review.load_run(tmp_path)))}
    assert checks["compiled CE proof"].passed is False  # no compiled batches ran
    assert review_command.main(args(tmp_path, require_proof=True)) == 1


def test_prefix_mismatch_fails(tmp_path):
    steps = good_steps()
    steps[1]["prefix_mismatches"] = 2
    record(tmp_path, steps)
    assert review_command.main(args(tmp_path, require_proof=True)) == 1


@pytest.mark.hostile
def test_crashed_run_with_torn_line_is_reviewed(tmp_path, capsys):
    record(tmp_path, good_steps(3), end=False, torn=True)
    assert review_command.main(args(tmp_path, json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["steps"] == 3 and out["summary"]["finished"] is False


def test_resumed_step_counts_once(tmp_path):
    record(tmp_path / "a", good_steps(3))
    events = (tmp_path / "a" / "events.jsonl").read_text().splitlines()
    step3 = [e for e in events if '"train_step"' in e][-1]
    with open(tmp_path / "a" / "events.jsonl", "a") as f:  # step 3 re-run after a resume
        f.write(step3 + "\n")
    assert review.summarize(review.load_run(tmp_path / "a")).steps == 3


def test_plots_are_valid_pngs(tmp_path):
    record(tmp_path, good_steps(), evals=[(0, 0.0), (4, 0.5)])
    assert review_command.main(args(tmp_path, plots=str(tmp_path / "plots"))) == 0
    pngs = sorted((tmp_path / "plots").glob("*.png"))
    assert [p.stem for p in pngs] == ["branches", "heldout", "losses", "memory", "reward"]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000


def test_plots_keep_the_warm_start_demo_reward_out_of_train_reward_and_give_eval_intervals(tmp_path):
    # demos: the oracle's 1.0
    steps = [dict(s, phase="sft", reward_mean=1.0) for s in good_steps(3)] + good_steps(2)
    record(tmp_path, steps, evals=[(0, 0.0), (5, 0.5)])
    runlog.configure(console="none")
    with runlog.RunLog(tmp_path, run_id="r1"):
        runlog.set_step(6)
        runlog.get_logger("test").info("eval", eval_reward=0.609, eval_success_rate=39 / 64, eval_episodes=64)
    run = review.load_run(tmp_path)
    assert review_command.plot_points(run, "reward_mean") == [(4, 0.0), (5, 0.1)]  # RL steps only
    assert review.sft_span(run) == (1, 3)
    (step, rate, low, high), = review_command.eval_success_intervals(run)  # evals without a count carry none
    assert step == 6 and rate == 39 / 64 and (round(low, 4), round(high, 4)) == (0.4869, 0.7194)
    assert review_command.main(args(tmp_path, plots=str(tmp_path / "plots"))) == 0
    assert (tmp_path / "plots" / "reward.png").stat().st_size > 1000


def test_compare_side_by_side(tmp_path, capsys):
    # run folders longer than a table cell (pytest -n 2 puts its tmp_path past 60 characters): the header
    # names each run whole, or the two columns could not be told apart
    a, b = tmp_path / ("a" * 70), tmp_path / ("b" * 70)
    record(a, good_steps(2))
    record(b, good_steps(4))
    assert review_command.main(args(compare=[str(a), str(b)])) == 0
    out = capsys.readouterr().out
    assert "steps" in out and str(a) in out and str(b) in out


@pytest.mark.hostile
def test_missing_run_dir_is_a_clean_error(tmp_path, capsys):
    assert review_command.main(args(tmp_path / "nope")) == 1
    assert "no events.jsonl" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert review_command.main(args(tmp_path / "empty")) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'empty' / 'events.jsonl'}: no events.jsonl here; "
                                       "pass the run folder, e.g. runs/toolbench\n")
    record(tmp_path, good_steps())
    # the events file itself, as a careless user passes it
    assert review_command.main(args(tmp_path / "events.jsonl")) == 0


def review_cli(*argv):
    return cli.main(["review", *map(str, argv)])


def dense_steps(n=4, **over):
    """Steps whose ECHO rows were dense: every microbatch took the exact suffix branch."""
    return [dict(s, **{names.SPARSE_SUFFIX_SKIPS: 0, names.HIDDEN_BATCHES: 0, names.SUFFIX_BATCHES: 2},
                 **over)
            for s in good_steps(n)]


def test_dense_rows_make_the_sparse_proof_na_not_a_failure(tmp_path, capsys):
    record(tmp_path, dense_steps())
    assert review_cli(tmp_path, "--require-proof") == 0
    captured = capsys.readouterr()
    assert (
        "[N/A] sparse ECHO proof: dense rows took the exact suffix branch: suffix batches 8\n" in captured.out
    )
    assert captured.err == ""
    assert review_cli(tmp_path, "--json") == 0
    check = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}["sparse ECHO proof"]
    assert (check["status"], check["passed"]) == ("n/a", None)
    # named explicitly, a check must pass: n/a does not
    assert review_cli(tmp_path, "--require", "sparse ECHO proof") == 1
    assert capsys.readouterr().err == ("error: required check sparse ECHO proof: N/A (dense rows took the "
                                       "exact suffix branch: suffix batches 8)\n")


def test_dense_rows_with_a_fallback_batch_still_fail(tmp_path, capsys):
    steps = dense_steps()
    steps[1][names.FALLBACK_BATCHES] = 1
    record(tmp_path, steps)
    assert review_cli(tmp_path, "--require-proof") == 1
    out, err = capsys.readouterr()
    assert "[FAIL] sparse ECHO proof: sparse_suffix_skips=0 > 0, hidden_logprob_batches=0 > 0, " \
           "fallback_logprob_batches=1 = 0\n" in out
    assert err.startswith("error: required check sparse ECHO proof: FAIL (")


@pytest.mark.hostile
def test_zero_trained_rows_never_pass_a_learning_proof(tmp_path, capsys):
    # every episode dropped: the steps ran, logged token counts, but no row reached the trainer
    steps = [dict(s, rows=0) for s in good_steps()]
    record(tmp_path, steps, evals=[(0, 0.0), (4, 0.5)])
    assert review_cli(tmp_path) == 0  # reported, not required
    out = capsys.readouterr().out
    assert "[FAIL] trained at least one step: steps=4 > 0, rows=0 > 0, action+echo tokens=120 > 0\n" in out
    untrained = "0 rows trained (steps=4, rows=0): nothing learned to judge"
    assert f"[WARN] ECHO loss falling: {untrained}\n" in out
    assert f"[WARN] eval reward above untrained: {untrained}\n" in out
    assert review_cli(tmp_path, "--require-proof") == 1
    assert review_cli(tmp_path, "--require", "eval reward above untrained") == 1


def test_require_named_checks(tmp_path, capsys):
    record(tmp_path / "a", good_steps(), evals=[(0, 0.0), (4, 0.5)])
    assert review_cli(tmp_path / "a", "--require-proof", "--require", "ECHO loss falling",
                      "--require", "eval reward above untrained") == 0
    assert capsys.readouterr().err == ""
    record(tmp_path / "b", good_steps())  # no eval events: the eval check cannot pass
    assert review_cli(tmp_path / "b", "--require", "ECHO loss falling") == 0
    assert review_cli(tmp_path / "b", "--require", "eval reward above untrained") == 1
    assert (
        capsys.readouterr().err == "error: required check eval reward above untrained: N/A (no eval event)\n"
    )
    steps = good_steps()
    steps[-1]["echo_loss"] = 9.0  # ECHO loss rises at the end
    record(tmp_path / "c", steps)
    assert review_cli(tmp_path / "c", "--require-proof") == 0  # a signal, not a required proof
    assert review_cli(tmp_path / "c", "--require", "ECHO loss falling") == 1
    assert capsys.readouterr().err.startswith("error: required check ECHO loss falling: FAIL (")


def test_a_run_without_an_untrained_eval_is_never_judged_against_a_later_one(tmp_path, capsys):
    # a run started from a checkpoint copied into a fresh folder: its first eval is a trained model's, and
    # "above untrained" judged against it called a step-20 eval the untrained model
    record(tmp_path, good_steps(), evals=[(2, 0.25), (4, 0.5)])
    s = review.summarize(review.load_run(tmp_path))
    assert s.eval_reward_baseline is None and s.eval_reward_last == 0.5 and s.evals_start_at == 2
    assert review_cli(tmp_path, "--require", "eval reward above untrained") == 1
    assert capsys.readouterr().err == (
        "error: required check eval reward above untrained: N/A (no eval of the untrained model (step 0): "
        "evals start at step 2 (a run started from a copied checkpoint))\n")
    record(tmp_path / "b", good_steps(), evals=[(0, 0.25), (2, 0.25), (4, 0.5)])  # the untrained eval, kept
    s = review.summarize(review.load_run(tmp_path / "b"))
    assert s.eval_reward_baseline == 0.25 and s.evals_start_at is None
    assert review_cli(tmp_path / "b", "--require", "eval reward above untrained") == 0


def test_require_an_unknown_check_lists_the_valid_names(tmp_path, capsys):
    record(tmp_path, good_steps())
    assert review_cli(tmp_path, "--require", "ECHO loss fallin") == 1
    err = capsys.readouterr().err
    assert err == ("error: --require 'ECHO loss fallin' is not a check; valid: 'sparse ECHO proof', "
                   "'compiled CE proof', 'tree training proof', 'exact rows (prefix mismatches)', "
                   "'trained at least one step', "
                   "'sampler log-probs agree with the trainer', 'RL trained (action tokens with advantage)', "
                   "'ECHO trained (env tokens)', 'ECHO loss falling', 'eval reward above untrained', "
                   "'RL kept eval at warm start', 'RL improved eval over warm start', "
                   "'process memory flat'\n")


@pytest.mark.hostile
def test_unreadable_lines_are_counted_not_fatal(tmp_path, capsys):
    record(tmp_path, good_steps(3))
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'\xff\xfe not utf-8\n')  # 1
        f.write(b'[1, 2, 3]\n')  # 2: JSON, not an object
        # 3: a step that is not an integer
        f.write(b'{"event": "train_step", "step": "x", "echo_loss": 1.0}\n')
        f.write(b'{"event": "train_step", "step": 5, "phase": ["rl"]}\n')  # 4: a phase that is not a string
        f.write(b'{"event": "eval", "step": true, "eval_reward": 1.0}\n')  # 5: a boolean step
        # mistyped counters and values in a placeable step: ignored, never summed or compared
        f.write(b'{"event": "train_step", "step": 4, "rows": "4", "action_tokens": "many", '
                b'"local_train_selective_hidden_logprob_batches": "2", "echo_loss": "low", "peak_mem_mb": '
                b'NaN}\n')
        f.write(b'{"event": "eval", "step": 4, "eval_reward": "high"}\n')
    assert review_cli(tmp_path, "--json", "--require-proof") == 0
    out, err = capsys.readouterr()
    s = json.loads(out)["summary"]
    assert s["unreadable_lines"] == 5 and s["steps"] == 4
    assert s["rows"] == 12 and s["action_tokens"] == 30 and s[names.HIDDEN_BATCHES] == 6
    assert s["peak_mem_mb"] == 102.0 and s["eval_reward_last"] is None
    assert err == (f"warning: {tmp_path / 'events.jsonl'}: 5 line(s) could not be read (not UTF-8, not a "
                   "JSON object, or a step that is not an integer) and are left out\n")
    assert review_cli(tmp_path, "--plots", tmp_path / "plots") == 0
    assert len(list((tmp_path / "plots").glob("*.png"))) == 5


@pytest.mark.parametrize("content", [b"", b"\n\n", b"\xff\xfe\x00garbage\n[1]\n42\n{\"torn"])
@pytest.mark.hostile
def test_a_file_with_no_readable_line_is_a_one_line_error(tmp_path, capsys, content):
    (tmp_path / "events.jsonl").write_bytes(content)
    assert review_cli(tmp_path) == 1
    lines = content.strip().count(b"\n") + 1 if content.strip() else 0
    assert capsys.readouterr().err == (f"error: {tmp_path / 'events.jsonl'}: no readable event in {lines} "
                                       "line(s) (not UTF-8 or not JSON objects); pass the events.jsonl a "
                                       "quaero run wrote\n")


@pytest.mark.hostile
def test_events_path_that_is_a_directory_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "events.jsonl").mkdir()
    assert review_cli(tmp_path) == 1
    assert capsys.readouterr().err == (f"error: {tmp_path / 'events.jsonl'}: cannot read it (Is a "
                                       "directory); pass the run folder holding a readable events.jsonl\n")
    assert review_cli("--compare", tmp_path, tmp_path) == 1  # --compare reads runs the same way
    assert capsys.readouterr().err.count("\n") == 1


@pytest.fixture(autouse=True)
def _reset_structlog():
    yield
    runlog.configure(console="none")


def _record_phases(run_dir, *, warm: list[int] | None, end: list[int] | None, sft=3, rl=2, warm_step=None,
                   warm_phase="sft", end_reward=None, rl_fields=(), eval_fields=None, formats=None):
    """A warm start of `sft` steps (phase `warm_phase`) and `rl` RL steps; evals at 0, at the warm start's end
    and at the end, each with per-task results [index, success, reward] (successes given as 0/1 lists; None:
    no such eval); `rl_fields`: each RL step's further fields, in turn; `eval_fields`: every eval's;
    `formats`: (warm start's, end's) malformed actions per task, as `eval_formats` of 2 actions each."""
    steps = [dict(s, phase=warm_phase) for s in good_steps(sft)] + [dict(s, **f) for s, f in zip(
        good_steps(rl), list(rl_fields) + [{}] * rl)]
    runlog.configure(console="none")
    log = runlog.get_logger("test")
    evals = [(0, [0] * 64), (warm_step or sft, warm), (sft + rl, end)]
    with runlog.RunLog(run_dir, run_id="r1"):
        for i, fields in enumerate(steps, start=1):
            runlog.set_step(i)
            log.info("train_step", phase=fields.pop("phase", "rl"), **fields)
        for step, wins in evals:
            if wins is None:
                continue
            runlog.set_step(step)
            reward = end_reward if end_reward is not None and step == sft + rl else None
            results = [[i, w, float(w) if reward is None else reward] for i, w in enumerate(wins)]
            extra = dict(eval_fields or {})
            if formats and step in (warm_step or sft, sft + rl):
                bad = formats[0] if step == (warm_step or sft) else formats[1]
                extra["eval_formats"] = [[i, m, 2] for i, m in enumerate(bad)]
            log.info("eval", eval_reward=sum(wins) / len(wins), eval_success_rate=sum(wins) / len(wins),
                     eval_episodes=len(wins), eval_results=results, **extra)
        log.info("run_end", status="finished")


@pytest.mark.parametrize("warm,end,improved,kept", [
    ([1] * 20 + [0] * 44, [1] * 34 + [0] * 30, proofs.PASS, proofs.PASS),  # 14 only after RL, 0 before
    ([1] * 20 + [0] * 44, [1] * 20 + [0] * 44, proofs.FAIL, proofs.PASS),  # the same solved: no evidence
    ([1] * 20 + [0] * 44, [0] * 10 + [1] * 12 + [0] * 42, proofs.FAIL, proofs.FAIL),  # 2 more solved, 10 lost
    ([1] * 20 + [0] * 44, [0] * 2 + [1] * 23 + [0] * 39, proofs.FAIL, proofs.PASS),  # +3 net: p = 0.45
    ([1] * 20 + [0] * 44, [0] * 4 + [1] * 16 + [0] * 44, proofs.FAIL, proofs.FAIL),  # 4 lost, 0 gained:
    # the interval is below 0 though McNemar's p (0.125) is not < 0.05
])
def test_rl_improved_and_kept_eval_over_warm_start_are_paired(tmp_path, capsys, warm, end, improved, kept):
    _record_phases(tmp_path, warm=warm, end=end)
    s = review.summarize(review.load_run(tmp_path))
    checks = {c.name: c for c in proofs.run_checks(s)}
    assert checks[proofs.RL_IMPROVED].status == improved, checks[proofs.RL_IMPROVED].detail
    assert checks[proofs.RL_KEPT].status == kept, checks[proofs.RL_KEPT].detail
    c = s.rl_vs_warm_start
    assert c.pairs == 64 and c.warm_start_step == 3 and c.end_step == 5
    low, high = c.reward_diff_ci95
    for check in (checks[proofs.RL_IMPROVED], checks[proofs.RL_KEPT]):
        # the detail states each relation as it is: a p of 0.45 is never printed as "< 0.05"
        p_rel = "<" if c.mcnemar_p < proofs.RL_IMPROVED_P else ">="
        assert f"McNemar exact p = {c.mcnemar_p:.3g} {p_rel} {proofs.RL_IMPROVED_P})" in check.detail
        assert check.detail.endswith("; > 0)" if low > 0 else "; < 0)" if high < 0 else "; spans 0)")
    for name, status in ((proofs.RL_IMPROVED, improved), (proofs.RL_KEPT, kept)):
        rc = review_command.main(args(tmp_path, require=[name]))
        assert rc == (0 if status == proofs.PASS else 1)
        assert f"[{'PASS' if status == proofs.PASS else 'WARN'}] {name}" in capsys.readouterr().out


def test_a_gain_that_is_only_the_action_format_is_said_as_such(tmp_path):
    """The warm start solved 20 of 64 and wrote a malformed action in 24 of the others; after RL, 34 solved
    and none malformed. Success among well-formed episodes: 20/40 -> 34/64, so of the 14 more solved, the
    format accounts for the well-formed share (0.625 -> 1.0, 24 only after RL, p < 1e-6) and the task success
    among them barely moved (0.500 -> 0.531): the review says both, in the RL checks' line and --json."""
    warm, end = [1] * 20 + [0] * 44, [1] * 34 + [0] * 30
    _record_phases(tmp_path, warm=warm, end=end, formats=([0] * 40 + [1] * 24, [0] * 64))
    s = review.summarize(review.load_run(tmp_path))
    split = s.rl_vs_warm_start.format_task
    assert (split["pairs"], split["b_well_formed"], split["a_well_formed"]) == (64, 40 / 64, 1.0)
    assert (split["format_a_only"], split["format_b_only"]) == (24, 0)
    assert split["format_mcnemar_p"] == pytest.approx(2 / 2**24)
    assert (split["b_task_success"], split["a_task_success"]) == (0.5, 34 / 64)
    detail = {c.name: c for c in proofs.run_checks(s)}[proofs.RL_IMPROVED].detail
    assert detail.endswith("format: well-formed episodes 0.625 -> 1.000 (well formed only after RL 24, only "
                           "before 0; McNemar exact p = 1.19e-07); task: success among well-formed 0.500 -> "
                           "0.531")
    assert s.to_dict()["rl_vs_warm_start"]["format_task"] == split
    _record_phases(tmp_path / "old", warm=warm, end=end)  # a run from before eval_formats: no split, no line
    s = review.summarize(review.load_run(tmp_path / "old"))
    assert s.rl_vs_warm_start.format_task is None and "format_task" not in s.to_dict()["rl_vs_warm_start"]


def test_a_warm_start_on_recorded_traces_with_the_rl_loss_is_still_the_warm_start(tmp_path):
    """[data] traces_loss = "rl" logs its warm-start steps as phase `traces_rl`: they end the warm start the
    RL check pairs against, and are no RL step of the run's own."""
    _record_phases(tmp_path, warm=[1] * 20 + [0] * 44, end=[1] * 34 + [0] * 30, warm_phase="traces_rl")
    s = review.summarize(review.load_run(tmp_path))
    assert s.rl_vs_warm_start.warm_start_step == 3 and s.rl_vs_warm_start.improved == 14
    assert review.sft_span(review.load_run(tmp_path)) == (1, 3)


def test_rl_improved_pairs_only_shared_tasks_and_says_why_it_is_na(tmp_path):
    _record_phases(tmp_path / "shared", warm=[0] * 64, end=[1] * 20 + [0] * 44)
    ok = review.summarize(review.load_run(tmp_path / "shared")).rl_vs_warm_start
    assert ok.improved == 20 and ok.worsened == 0 and ok.mcnemar_p < 1e-5
    _record_phases(tmp_path / "noeval", warm=None, end=[1] * 64)
    _record_phases(tmp_path / "norl", warm=[0] * 64, end=[1] * 64, rl=0)
    _record_phases(tmp_path / "nowarm", warm=[0] * 64, end=[1] * 64, sft=0, warm_step=1)
    whys = {name: review.summarize(review.load_run(tmp_path / name)).rl_vs_warm_start.why
            for name in ("noeval", "norl", "nowarm")}
    assert whys == {"noeval": "no eval at the warm start's last step 3", "norl": "no RL step",
                    "nowarm": "no warm start"}
    for name, why in whys.items():
        checks = proofs.run_checks(review.summarize(review.load_run(tmp_path / name)))
        check = {c.name: c for c in checks}[proofs.RL_IMPROVED]
        assert check.status == proofs.NA and check.detail == why


def test_eval_reward_intervals_come_from_per_task_results(tmp_path):
    _record_phases(tmp_path, warm=[1] * 32 + [0] * 32, end=[1] * 48 + [0] * 16)
    pts = review_command.eval_reward_intervals(review.load_run(tmp_path))
    assert [(s, m) for s, m, _, _ in pts] == [(0, 0.0), (3, 0.5), (5, 0.75)]
    _, mean, low, high = pts[1]
    assert low < mean < high and high - low == pytest.approx(2 * 1.96 * 0.5039 / 8, rel=1e-3)
    assert review_command.main(args(tmp_path, plots=str(tmp_path / "plots"))) == 0


@pytest.mark.hostile
def test_eval_rewards_that_are_not_finite_are_said_so_not_called_missing(tmp_path):
    """An env whose eval rewards are NaN: the paired check said "the evals carry no per-task results"."""
    _record_phases(tmp_path, warm=[1] * 20 + [0] * 44, end=[1] * 34 + [0] * 30, end_reward=float("nan"))
    why = review.summarize(review.load_run(tmp_path)).rl_vs_warm_start.why
    assert why == ("the eval rewards of step(s) 5 are not finite (NaN or inf, null in eval_results): the "
                   "env's "
                   "rewards cannot be compared")


GUIDED_STEPS = [  # two RL steps of a guided run: the first guided 2 of its 4 groups, 2 of its 3 signal groups
    {"guidance_members": 1, "groups": 4, "groups_guided": 2, "signal_groups": 3, "signal_groups_guided": 2,
     "guided_members": 2, "guided_members_succeeded": 1, "guided_members_dropped": 1,
     "guided_action_tokens": 30, "onpolicy_action_tokens": 90},
    {"guidance_members": 0, "groups": 4, "groups_guided": 0, "signal_groups": 1, "signal_groups_guided": 0,
     "guided_members": 0, "guided_members_succeeded": 0, "guided_members_dropped": 0,
     "guided_action_tokens": 0, "onpolicy_action_tokens": 80},
]


def test_the_review_says_how_much_signal_came_from_guidance_and_judges_rl_on_unguided_evals(tmp_path,
                                                                                          capsys):
    warm, end = [1] * 20 + [0] * 44, [1] * 34 + [0] * 30
    _record_phases(tmp_path, warm=warm, end=end, rl_fields=GUIDED_STEPS,
                   eval_fields={"eval_guided_tokens": 0})
    s = review.summarize(review.load_run(tmp_path))
    g = s.guidance
    assert (g.groups, g.groups_guided, g.signal_groups, g.signal_groups_guided) == (8, 2, 4, 2)
    assert (g.guided_members, g.guided_members_succeeded, g.guided_members_dropped) == (2, 1, 1)
    assert (g.guided_action_tokens, g.onpolicy_action_tokens) == (30, 170)
    assert s.rl_vs_warm_start.unguided is True
    check = next(c for c in proofs.run_checks(s) if c.name == proofs.RL_IMPROVED)
    assert check.status == proofs.PASS and check.detail.endswith("; unguided greedy evals")
    assert review_command.main(args(tmp_path)) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("guidance: "))
    assert line == ("guidance: 2 of 8 (25%) RL groups guided (2 members, 1 succeeded, 1 dropped); 2 of 4 "
                    "(50%) groups with signal were guided; 30 of 200 (15%) trained action tokens a "
                    "guide's; RL over warm start judged on unguided greedy evals (eval_guided_tokens = 0 in "
                    "both)")
    assert review.summarize(review.load_run(tmp_path)).to_dict()["guidance"]["groups_guided"] == 2
    # an eval that counted guided tokens is not the policy's own: RL over the warm start is not judged on it
    _record_phases(tmp_path / "guided", warm=warm, end=end, rl_fields=GUIDED_STEPS,
                   eval_fields={"eval_guided_tokens": 7})
    s = review.summarize(review.load_run(tmp_path / "guided"))
    check = next(c for c in proofs.run_checks(s) if c.name == proofs.RL_IMPROVED)
    assert check.status == proofs.NA and "has 7 guided tokens" in check.detail
    # a run without guidance has no guidance figures, and says nothing of it
    _record_phases(tmp_path / "plain", warm=warm, end=end)
    assert review.summarize(review.load_run(tmp_path / "plain")).guidance is None
    assert "guidance" not in review.summarize(review.load_run(tmp_path / "plain")).to_dict()


def _record_held_out(run_dir):
    """A warm start (steps 1-3) and 2 RL steps of 100 and 150 generated tokens; evals at 0 (64 tasks, none
    solved), 3 (2 of 8 solved, tasks 2 and 3 malformed) and 5 (3 of 8: 2 and 3 fixed, 1 regressed; task 4
    malformed), each with pass@2's sampled episodes of 3 tasks: (2 of 2, 1 of 2, 0 of 2)."""
    _record_phases(run_dir, warm=[1, 1, 0, 0, 0, 0, 0, 0], end=[1, 0, 1, 1, 0, 0, 0, 0],
                   formats=([0, 0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0, 0, 0]),
                   rl_fields=[{"generated_tokens": 100}, {"generated_tokens": 150}],
                   eval_fields={"eval_pass_k": 2, "eval_pass_results": [[0, 2, 2], [1, 1, 2], [2, 0, 2]]})


def test_review_says_held_out_success_with_its_se_format_failures_pass_at_k_and_fixed_tasks(tmp_path,
                                                                                             capsys):
    _record_held_out(tmp_path)
    s = review.summarize(review.load_run(tmp_path))
    se = (3 / 8 * 5 / 8 / 8) ** 0.5
    assert s.eval_last == pytest.approx({
        "eval_success_se_last": se, "eval_format_failures_last": 1 / 8, "eval_wrong_answers_last": 4 / 8,
        "eval_pass_k": 2, "eval_pass_tasks_last": 3, "eval_pass_at_1_last": 0.5, "eval_pass_at_k_last": 2 / 3,
        "eval_pass_at_k_se_last": ((1 / 3) ** 2 * 2 + (2 / 3) ** 2) ** 0.5 / 3})
    c = s.rl_vs_warm_start
    assert (c.fixed, c.regressed, c.improved, c.worsened) == ([2, 3], [1], 2, 1)
    assert review_command.main(args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert (f"held-out success (last eval) 0.375 ± {se:.3f} s.e.; failures: 0.125 format (a malformed "
            "action), 0.500 wrong answers (every action well formed)") in out
    assert ("last eval's pass@k, k = 2 samples per task at the sampler's temperature, 3 tasks: pass@1 0.500, "
            "pass@2 0.667 (s.e. 0.272)") in out
    assert "RL over warm start per task: fixed 2: 2, 3; regressed 1: 1" in out
    assert review_command.main(args(tmp_path, json=True)) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["eval_pass_at_k_last"] == pytest.approx(2 / 3) and summary["eval_success_se_last"] == (
        pytest.approx(se))
    assert (summary["rl_vs_warm_start"]["fixed"], summary["rl_vs_warm_start"]["regressed"]) == ([2, 3], [1])


def test_the_held_out_plot_draws_the_events_points_against_step_and_generated_tokens(tmp_path, capsys):
    _record_held_out(tmp_path)
    run = review.load_run(tmp_path)
    curves = review_command.held_out_curves(run)
    # (eval step, RL generated tokens by then, value, s.e.): the same numbers as the events'
    want = [(0, 0, 0.0, 0.0), (3, 0, 0.25, (0.25 * 0.75 / 8) ** 0.5),
            (5, 250, 0.375, (3 / 8 * 5 / 8 / 8) ** 0.5)]
    assert [p[:2] for p in curves["success"]] == [w[:2] for w in want]
    assert [v for p in curves["success"] for v in p[2:]] == pytest.approx([v for w in want for v in w[2:]])
    assert [p[:3] for p in curves["pass@2"]] == [(0, 0, pytest.approx(2 / 3)), (3, 0, pytest.approx(2 / 3)),
                                                 (5, 250, pytest.approx(2 / 3))]
    import matplotlib.pyplot as plt

    fig = review_command._held_out_figure(run, plt)  # what the PNG draws: the points above, on both axes
    by_step, by_tokens = ({c.get_label(): (list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata()))
                           for c in ax.containers} for ax in fig.axes)
    plt.close(fig)
    assert by_step["success"] == ([0, 3, 5], [0.0, 0.25, 0.375])
    assert by_tokens["success"] == ([0, 0, 250], [0.0, 0.25, 0.375])
    assert review_cli(tmp_path, "--plots") == 0  # bare: into the run's own plots/ folder
    assert f"plot {tmp_path / 'plots' / 'heldout.png'}" in capsys.readouterr().out
    png = (tmp_path / "plots" / "heldout.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_an_eval_from_before_the_per_task_lists_gives_its_pooled_figures(tmp_path):
    record(tmp_path, good_steps(2), evals=[(0, 0.5)])
    e = review.load_run(tmp_path).evals[0]
    assert review.held_out(e) == {"success": 0.5}  # no s.e. logged, none made up
    e.update(eval_success_se=0.1, eval_format_failures=0.2, eval_wrong_answers=0.3)
    assert review.held_out(e) == {"success": 0.5, "success_se": 0.1, "format_failures": 0.2,
                                  "wrong_answers": 0.3}


def test_the_held_out_curves_split_by_task_group_and_tier_where_the_evals_name_them(tmp_path):
    # the end eval's 8 tasks: templates price (0-3) and city (4-7), tiers 1 (even) and 2 (odd)
    groups = [[i, "price" if i < 4 else "city", 1 + i % 2] for i in range(8)]
    _record_phases(tmp_path, warm=None, end=[1, 0, 1, 1, 0, 0, 1, 0],
                   eval_fields={"eval_task_groups": groups})
    run = review.load_run(tmp_path)
    end = run.evals[-1]
    se = review.held_out_by(end, "group")
    assert se == {"price": (0.75, pytest.approx((0.75 * 0.25 / 4) ** 0.5)),
                  "city": (0.25, pytest.approx((0.25 * 0.75 / 4) ** 0.5))}
    assert review.held_out_by(end, "difficulty") == {1: (0.75, pytest.approx((0.75 * 0.25 / 4) ** 0.5)),
                                                     2: (0.25, pytest.approx((0.25 * 0.75 / 4) ** 0.5))}
    curves = review_command.held_out_curves(run)
    # the step-0 eval's 64 tasks are named too, but all in one list: only tasks 0-7 are grouped
    assert [(p[0], p[2]) for p in curves["success, group price"]] == [(0, 0.0), (5, 0.75)]
    assert [(p[0], p[2]) for p in curves["success, tier 2"]] == [(0, 0.0), (5, 0.25)]
    assert review.held_out_by({"eval_results": [[0, 1, 1.0]]}, "group") == {}  # no groups logged: none


def test_compare_names_the_tasks_one_runs_last_eval_solves_and_the_others_does_not(tmp_path, capsys):
    _record_phases(tmp_path / "a", warm=None, end=[1, 1, 0, 0, 1])
    _record_phases(tmp_path / "b", warm=None, end=[1, 0, 1, 0, 0])
    assert review_command.main(args(compare=[str(tmp_path / "a"), str(tmp_path / "b")])) == 0
    assert ("last evals per task (B -> A, 5 shared tasks): fixed (A only) 2: 1, 4; regressed (B only) 1: 2"
            in capsys.readouterr().out)
    assert review_command.main(args(compare=[str(tmp_path / "a"), str(tmp_path / "b")], json=True)) == 0
    paired = json.loads(capsys.readouterr().out)["last_evals"]
    assert paired == {"pairs": 5, "fixed": [1, 4], "regressed": [2]}


def _rss_steps(sft_rss: list[float], rl_rss: list[float]) -> list[dict]:
    return [dict(good_steps(1)[0], phase=phase, process_rss_mb=rss)
            for phase, series in (("sft", sft_rss), ("rl", rl_rss)) for rss in series]


def test_a_run_whose_rss_grows_after_its_warm_up_is_flagged(tmp_path, capsys):
    # the main job's shape: flat until the warm-up's end, then ~40 MB a step (1.4 GB -> 7.1 GB)
    record(tmp_path, _rss_steps([900.0] * 5 + [1400.0 + 40 * i for i in range(45)], [1500.0] * 12))
    s = review.summarize(review.load_run(tmp_path))
    assert s.rss_growth["sft"]["reference_step"] == 11 and s.rss_growth["sft"]["reference_rss_mb"] == 1600.0
    assert s.rss_growth["sft"]["largest_step"] == 50 and s.rss_growth["sft"]["growth"] > 0.9
    check = {c.name: c for c in proofs.run_checks(s)}[proofs.MEMORY_FLAT]
    assert check.status == proofs.FAIL and "sft 1600 MiB at step 11 -> 3160 at 50" in check.detail
    assert review_command.main(args(tmp_path)) == 0  # a flag, not a required proof
    assert "[WARN] process memory flat: sft 1600 MiB at step 11" in capsys.readouterr().out


def test_a_flat_rss_passes_and_a_run_without_readings_is_not_judged(tmp_path):
    flat = tmp_path / "flat"
    # a warm-up that fills malloc's caches, then readings that move within 10% both ways
    record(flat, _rss_steps([700.0] * 10 + [1400.0 + (i % 7) * 10 for i in range(90)], [1500.0] * 12))
    check = {c.name: c for c in proofs.run_checks(review.summarize(review.load_run(flat)))}
    assert check[proofs.MEMORY_FLAT].status == proofs.PASS
    old = tmp_path / "old"
    record(old, good_steps(20))  # a run from before `process_rss_mb`
    s = review.summarize(review.load_run(old))
    assert s.rss_growth == {} and "rss_growth" not in s.to_dict()
    check = {c.name: c for c in proofs.run_checks(s)}
    assert check[proofs.MEMORY_FLAT].status == proofs.NA


def test_a_resumed_process_s_rss_is_judged_apart_from_the_first_s(tmp_path):
    # steps 1-30 by one process at ~1000 MiB, then a resume whose process holds more from its first step on
    first = [dict(good_steps(1)[0], phase="sft", process_rss_mb=1000.0, run_id="a") for _ in range(30)]
    second = [dict(good_steps(1)[0], phase="sft", process_rss_mb=1300.0 + i, run_id="b") for i in range(30)]
    steps = [dict(st, step=i) for i, st in enumerate(first + second, start=1)]
    growth = review.rss_growth(steps)["sft"]
    assert growth["reference_rss_mb"] == 1306.0 and growth["largest_rss_mb"] == 1329.0  # the second's own
    assert proofs.memory_flat(review.rss_growth(steps)).status == proofs.PASS
    grown = [dict(st, process_rss_mb=1000.0 + 20 * i) for i, st in enumerate(steps[:30])]
    assert proofs.memory_flat(review.rss_growth(grown + steps[30:])).status == proofs.FAIL


def test_rss_growth_says_whether_malloc_still_holds_it_or_kept_it_after_it_was_freed():
    # RSS +20 MiB a step over an RL phase; malloc's memory in use +2 a step (freed, kept) or +20 (still held)
    def run(held_per_step: float) -> list[dict]:
        return [dict(good_steps(1)[0], step=i, phase="rl", process_rss_mb=2000.0 + 20 * i,
                     process_malloc_in_use_mb=1000.0 + held_per_step * i) for i in range(31)]

    kept = review.rss_growth(run(2))["rl"]
    assert (kept["reference_step"], kept["largest_step"]) == (6, 30)  # after the warm-up: a fifth of them
    assert (kept["reference_malloc_mb"], kept["largest_malloc_mb"]) == (1012.0, 1060.0)
    check = proofs.memory_flat(review.rss_growth(run(2)))
    assert check.status == proofs.FAIL, check
    assert "rl 2120 MiB at step 6 -> 2600 at 30 (+23%; malloc in use 1012 -> 1060)" in check.detail, check
    assert "most of it is memory freed and kept by the allocator" in check.detail, check
    held = proofs.memory_flat(review.rss_growth(run(20)))
    assert held.status == proofs.FAIL, held
    assert "the process keeps memory it does not give back" in held.detail, held
    assert "freed and kept" not in held.detail, held
    without = [{k: v for k, v in st.items() if k != "process_malloc_in_use_mb"} for st in run(2)]
    assert "malloc" not in proofs.memory_flat(review.rss_growth(without)).detail
