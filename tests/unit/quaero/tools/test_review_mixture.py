"""`quaero review` on a mixture (quaero/tools/review.py): per-env lines, "RL improved eval over warm start"
per env, and the pooled check pairing tasks of different envs apart."""
from __future__ import annotations

from quaero.telemetry.summary import RunRecord
from quaero.tools.review import env_line, eval_outcomes, summarize


def _eval(step, results):
    by_env = {}
    for env in ("a", "b"):
        mine = [r for r in results if r[3] == env]
        by_env[env] = {"eval_success_rate": sum(r[1] for r in mine) / len(mine)}
    return {"event": "eval", "step": step, "eval_results": results, "eval_by_env": by_env}


def _step(step, phase, by_env=None):
    out = {"event": "train_step", "step": step, "phase": phase}
    if by_env:
        out["by_env"] = by_env
        out["signal_groups"] = sum(v["signal_groups"] for v in by_env.values())
        out["generated_tokens"] = sum(v["generated_tokens"] for v in by_env.values())
    return out


def test_a_mixture_review_pairs_each_env_on_its_own_tasks_and_the_pool_keeps_them_apart():
    # the same task index 0 in two envs: env a improves on it, env b worsens
    warm = [[0, 0, 0.0, "a"], [1, 0, 0.0, "a"], [0, 1, 1.0, "b"], [1, 1, 1.0, "b"]]
    end = [[0, 1, 1.0, "a"], [1, 1, 1.0, "a"], [0, 0, 0.0, "b"], [1, 1, 1.0, "b"]]
    fig = {"groups": 2, "signal_groups": 1, "generated_tokens": 400, "episodes_lost": 1}
    run = RunRecord(path="", events=[],
                    steps=[_step(1, "sft"), _step(2, "rl", {"a": fig, "b": {**fig, "episodes_lost": 0}})],
                    evals=[_eval(1, warm), _eval(2, end)], unreadable=0, ended=True)
    keyed = {"a:0": (0, 0.0), "a:1": (0, 0.0), "b:0": (1, 1.0), "b:1": (1, 1.0)}
    assert eval_outcomes(run.evals[0]) == keyed
    assert eval_outcomes(run.evals[0], "b") == {0: (1, 1.0), 1: (1, 1.0)}
    s = summarize(run)
    pooled = s.rl_vs_warm_start
    assert (pooled.pairs, pooled.improved, pooled.worsened) == (4, 2, 1)
    a, b = s.per_env["a"], s.per_env["b"]
    assert (a.rl_vs_warm_start.improved, a.rl_vs_warm_start.worsened) == (2, 0)
    assert (b.rl_vs_warm_start.improved, b.rl_vs_warm_start.worsened) == (0, 1)
    assert (a.signal_groups, a.signal_groups_per_1k_tokens, a.episodes_lost) == (1, 2.5, 1)
    assert s.rl_signal_groups_per_1k_tokens == 2.5
    line = env_line("a", a)
    assert line.startswith("env a: 2 RL groups, 1 with signal (2.5 per 1k generated tokens), 1 episodes "
                           "lost, last eval success 1; RL over warm start 0.000 -> 1.000 on 2 tasks (+2/-0")
    one_env = RunRecord(path="", events=[], steps=[_step(1, "sft"), _step(2, "rl")], evals=[], unreadable=0,
                        ended=True)
    # a one-env run's review is unchanged: no per_env key in its --json summary
    assert summarize(one_env).per_env == {} and "per_env" not in summarize(one_env).to_dict()
