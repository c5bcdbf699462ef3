"""quaero/telemetry/proofs.py: the names a real trainer step emits are the ones it declares; each check's
verdict."""
import subprocess
import sys

import pytest

from quaero.telemetry import names, proofs
from quaero.telemetry.summary import RunRecord
from quaero.tools import review


def test_trainer_step_emits_exactly_the_declared_counter_names(local_smoke_metrics):
    emitted = set(local_smoke_metrics)
    assert {k for k in emitted if k.startswith("local_train_selective_")} == {names.SELECTIVE_SUFFIX_LOGITS,
                                                                              *proofs.BRANCH_COUNTERS}
    assert {k for k in emitted if k.startswith("local_train_compile_")} == {names.COMPILE_MODE,
                                                                            names.COMPILE_FALLBACK_REASON}
    assert set(names.SELECTIVE_METRICS) <= emitted and set(proofs.STEP_PROOF_METRICS) <= emitted
    # every retrain `local_train_*` name the step emits is declared in quaero/telemetry/names.py
    assert {k for k in emitted if k.startswith("local_train_")} == {*names.SELECTIVE_METRICS,
                                                                  *proofs.BRANCH_COUNTERS, names.SAVE_ON_CPU,
                                                                  *names.TREE_METRICS}
    # the smoke's rows are sparse by construction: the proof passes on the real step's counters
    assert [c.status for c in proofs.branch_checks(local_smoke_metrics)] == ["pass", "n/a", "n/a"]


def test_a_counter_added_to_proofs_is_emitted_and_reviewed(monkeypatch, tiny_model_dir, tmp_path):
    from benchmarks.smoke import run

    name = "local_train_selective_probe_batches"
    monkeypatch.setitem(proofs.BRANCH_COUNTERS, name, lambda info: info.branch == "hidden")
    m = run("local")
    assert m[name] == m[names.HIDDEN_BATCHES] > 0
    run_log = RunRecord(path="", events=[], steps=[{"step": 1, name: m[name]}, {"step": 2, name: 3}],
                        evals=[], unreadable=0, ended=True)
    assert review.summarize(run_log).selective[name] == m[name] + 3


def test_proofs_module_stays_light():
    """trainers/ import it; importing it must not pull torch (or any quaero module but the names, their
    declarations and the run summary's types) in."""
    code = ("import sys, quaero.telemetry.proofs; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'quaero', 'trainers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert (
        out.strip() == "['quaero', 'quaero.telemetry', 'quaero.telemetry.metrics', 'quaero.telemetry.names', "
                       "'quaero.telemetry.proofs', 'quaero.telemetry.summary']"
    )


def counters(skips=0, hidden=0, suffix=0, fallback=0, **kw):
    return {names.SPARSE_SUFFIX_SKIPS: skips, names.HIDDEN_BATCHES: hidden, names.SUFFIX_BATCHES: suffix,
            names.FALLBACK_BATCHES: fallback, **kw}


@pytest.mark.parametrize(("totals", "status"), [
    (counters(skips=2, hidden=2), "pass"),
    (counters(skips=2, hidden=2, suffix=3), "pass"),  # some rows sparse, some dense
    (counters(suffix=3), "n/a"),  # every row dense: the exact suffix branch is the right one
    (counters(suffix=3, fallback=1), "fail"),  # a fallback fails whatever the rows were
    (counters(skips=2, hidden=2, fallback=1), "fail"),
    (counters(hidden=2), "fail"),  # hidden path without a sparse skip (an explicit chunk size forces it)
    (counters(skips=2), "fail"),  # declined the suffix shortcut but the hidden path never ran
    (counters(), "n/a"),  # no microbatch trained: "trained at least one step" fails that run, not this proof
    (counters(local_train_selective_dense_logprob_batches=2), "fail"),  # trained with selective off
])
def test_sparse_echo_verdicts(totals, status):
    check = proofs.sparse_echo(totals)
    assert (check.status, check.passed) == (status, {"pass": True, "fail": False, "n/a": None}[status])


def test_compiled_ce_is_judged_only_in_require_mode():
    assert proofs.compiled_ce({names.COMPILE_MODE: "auto"}).status == "n/a"
    ok = {names.COMPILE_MODE: "require", names.COMPILED_CE_BATCHES: 3, names.COMPILE_FALLBACK_REASON: ""}
    assert proofs.compiled_ce(ok).status == "pass"
    assert proofs.compiled_ce({**ok, names.COMPILED_CE_BATCHES: 0}).status == "fail"
    assert proofs.compiled_ce({**ok, names.COMPILE_FALLBACK_REASON: "cpu device"}).status == "fail"


def test_tree_training_is_judged_when_packing_is_asked_for():
    assert proofs.tree_training({names.TREE_PACKING: "off"}).status == "n/a"
    on = {names.TREE_PACKING: "on", names.TREE_BATCHES: 2, names.TREE_UNIQUE_TOKENS: 300,
          names.TREE_ROW_TOKENS: 1000, names.TREE_FALLBACK_BATCHES: 0}
    passed = proofs.tree_training(on)
    assert passed.status == "pass" and "300/1000 = 0.300" in passed.detail
    failed = proofs.tree_training({**on, names.TREE_FALLBACK_BATCHES: 1,
                                   names.TREE_FALLBACK_REASON: "eager?"})
    assert failed.status == "fail" and "eager?" in failed.detail
    auto = {**on, names.TREE_PACKING: "auto", names.TREE_BATCHES: 0}
    assert proofs.tree_training(auto).status == "n/a"  # nothing shared enough to pay
    mixed = {**auto, names.TREE_BATCHES: 1, names.TREE_FALLBACK_BATCHES: 1}
    assert proofs.tree_training(mixed).status == "pass"


def test_unmet_counts_na_only_for_named_checks():
    checks = proofs.branch_checks(counters(suffix=3))  # sparse n/a, compiled n/a
    assert proofs.unmet(checks, require_proof=True) == []
    assert proofs.unmet(checks, require_proof=True, names=[proofs.SPARSE_ECHO, proofs.SPARSE_ECHO]) == [
        "sparse ECHO proof: N/A (dense rows took the exact suffix branch: suffix batches 3)"]
    failed = proofs.branch_checks(counters(suffix=3, fallback=1))
    assert len(proofs.unmet(failed, require_proof=True, names=[proofs.SPARSE_ECHO])) == 1  # listed once
    assert proofs.unmet(failed, require_proof=False) == []


def test_sparse_echo_is_not_applicable_when_no_microbatch_was_trained():
    check = proofs.sparse_echo(counters())
    assert check.status == "n/a" and "no microbatch was trained" in check.detail


def _gap_run(*steps) -> RunRecord:
    """An event log of RL steps (gap max, gap mean, policy staleness) for `quaero review`'s summary."""
    return RunRecord(path="", events=[], steps=[
        {"step": i + 1, "phase": "rl", "rows": 2, "action_tokens": 8, "echo_tokens": 4,
         "sampler_logprob_gap_max": worst, "sampler_logprob_gap_mean": mean, "policy_staleness": stale}
        for i, (worst, mean, stale) in enumerate(steps)], evals=[], unreadable=0, ended=True)


@pytest.mark.hostile
@pytest.mark.parametrize("steps, status", [
    ([(3.4e-4, 1e-5, 0)], "pass"),  # the CPU main job's measured gap
    ([(62.0, 50.0, 0)], "fail"),  # a sampler +50 nats off (ratios ~2e-27, clip fraction 1.0)
    ([(10.6, 0.05, 0)], "fail"),  # one token 10.6 nats off
    ([(1.5, 0.3, 0)], "fail"),  # every token a little off: the mean says so
    ([(None, None, 0)], "n/a"),  # no RL token measured (all-SFT, or every advantage 0)
    ([(0.0, 0.0, 0), (9.0, 2.0, 1)], "pass"),  # sampled ahead: that gap includes the policy's change
])
def test_the_logprob_gap_proof_fails_past_its_tolerance(steps, status):
    s = review.summarize(_gap_run(*steps))
    (check,) = [c for c in proofs.run_checks(s) if c.name == proofs.LOGPROB_GAP]
    assert check.status == status and check.required, check
    missed = proofs.unmet(proofs.run_checks(s), require_proof=True)
    assert any(line.startswith(f"{proofs.LOGPROB_GAP}: FAIL (over 1 on-policy step(s): max")
               for line in missed) \
        == (status == "fail")
