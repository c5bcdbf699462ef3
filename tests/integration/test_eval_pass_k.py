"""pass@k, success's standard error, format failures and per-task fixed / regressed lists on the real
toolbench server: `quaero eval --pass-k` with scripted policies (known outcomes) and with tiny-qwen3 sampling,
and training's in-loop evaluation with `[training] eval_pass_k`, reviewed by `quaero review`."""
import json
from pathlib import Path

import pytest
from fixtures.runs import events_of, make_config

from quaero import cli
from quaero.telemetry.heldout import pass_figures
from quaero.tools import review_command

ROOT = Path(__file__).resolve().parents[2]
TOOLBENCH = str(ROOT / "envs" / "toolbench.toml")


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_pass_at_k_and_fixed_tasks_of_the_oracle_against_wrong_answers(tmp_path, capsys):
    """The oracle solves every sample and the wrong-answer policy none, every action well formed: pass@1 =
    pass@2 = 1 and 0, every failure a wrong answer, and every task fixed B -> A."""
    code = cli.main(["eval", TOOLBENCH, "--set", f"run.output_dir={tmp_path}", "--tasks", "3",
                     "--pass-k", "2", "--out", str(tmp_path / "cmp"), "--compare",
                     "envs.toolbench:oracle_policy", "fixtures.scripted:wrong_answer_policy"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    good, bad = _summary(tmp_path / "cmp")["results"]
    assert good["pass_at_k"] == {"k": 2, "tasks": 3, "pass_at_1": 1.0, "pass_at_k": 1.0, "pass_at_k_se": 0.0}
    assert bad["pass_at_k"] == {"k": 2, "tasks": 3, "pass_at_1": 0.0, "pass_at_k": 0.0, "pass_at_k_se": 0.0}
    assert [(p["task"], p["successes"], p["samples"]) for p in good["pass_results"]] == [(0, 2, 2), (1, 2, 2),
                                                                                         (2, 2, 2)]
    assert (good["success_se"], bad["success_se"]) == (0.0, 0.0)
    assert (bad["format_failures"], bad["wrong_answers"]) == (0.0, 1.0)
    paired = _summary(tmp_path / "cmp")["paired"]
    assert (paired["fixed"], paired["regressed"]) == ([[0, 0], [0, 1], [0, 2]], [])
    assert "B -> A per task: fixed (A only) 3: 0, 1, 2; regressed (B only) none" in printed
    assert ("A pass@k, k = 2 samples per task at the sampler's temperature, 3 tasks: pass@1 1.000, pass@2 "
            "1.000 (s.e. 0.000)") in printed
    assert ("B failures: 0.000 format (a malformed action), 1.000 wrong answers (every action well "
            "formed)") in printed


def test_pass_at_k_of_tiny_qwen3_samples_k_per_task_and_leaves_the_greedy_eval_as_it_was(tmp_path, capsys):
    """tiny-qwen3 (the config's [model]) on 2 tasks: `--pass-k 2` samples 2 episodes per task after the greedy
    ones, whose transcripts are those of an eval without it; pass@k is the estimator on the logged counts."""
    common = ["eval", TOOLBENCH, "--set", "sampler.max_tokens=12", "--set", "env.max_turns=2", "--set",
              "sampler.backend=hf", "--set", f"run.output_dir={tmp_path}", "--tasks", "2"]
    assert cli.main([*common, "--out", str(tmp_path / "plain")]) == 0
    assert cli.main([*common, "--pass-k", "2", "--out", str(tmp_path / "k2")]) == 0
    printed = capsys.readouterr().out
    plain, k2 = ((tmp_path / d / "transcripts.jsonl").read_text() for d in ("plain", "k2"))
    assert plain == k2  # the greedy episodes are untouched by pass@k's sampling
    s = _summary(tmp_path / "k2")["results"][0]
    assert _summary(tmp_path / "plain")["results"][0].get("pass_at_k") is None
    counts = [(p["successes"], p["samples"]) for p in s["pass_results"]]
    assert [p["task"] for p in s["pass_results"]] == [0, 1] and all(n == 2 for _, n in counts)
    assert s["pass_at_k"] == pass_figures(counts, 2)
    assert "pass@k, k = 2 samples per task" in printed


@pytest.mark.slow
def test_training_evals_log_pass_at_k_and_review_reads_and_plots_them(tmp_path, capsys):
    """A tiny run with `[training] eval_pass_k = 2`: each eval event carries the greedy figures (success, its
    s.e., format failures and wrong answers) and pass@k's; `quaero review` prints and plots them."""
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "passk", steps=1, warmup=1, eval_every=1, eval_tasks=2,
                         extra=["training.eval_pass_k=2"])
    run_dir = train(cfg)
    evals = events_of(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 1, 2]
    for e in evals:
        results, formats = e["eval_results"], e["eval_formats"]
        assert e["eval_episodes"] == len(results) == 2  # the greedy episodes alone
        p = sum(r[1] for r in results) / len(results)
        assert e["eval_success_se"] == pytest.approx((p * (1 - p) / len(results)) ** 0.5)
        fails = [f[1] > 0 for r, f in zip(results, formats) if not r[1]]
        assert e["eval_format_failures"] == pytest.approx(sum(fails) / 2)
        assert e["eval_wrong_answers"] == pytest.approx((len(fails) - sum(fails)) / 2)
        assert e["eval_pass_k"] == 2 and [r[0] for r in e["eval_pass_results"]] == [0, 1]
        # each task's template and tier from toolbench's Task API (the config serves difficulty 1)
        assert [(g[0], g[2]) for g in e["eval_task_groups"]] == [(0, 1), (1, 1)]
        assert e["eval_task_groups"][0][1] == "price"
        counts = [(c, n) for _, c, n in e["eval_pass_results"]]
        assert e["eval_pass_at_k"] == pytest.approx(pass_figures(counts, 2)["pass_at_k"])
    assert review_command.main(_args(run_dir, plots=True)) == 0
    out = capsys.readouterr().out
    assert "last eval's pass@k, k = 2 samples per task" in out and "held-out success (last eval)" in out
    assert (run_dir / "plots" / "heldout.png").stat().st_size > 5000


def _args(run_dir, **kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{"run_dir": str(run_dir), "require_proof": False, "require": [], "plots": None,
                              "json": False, "compare": None, **kw})
