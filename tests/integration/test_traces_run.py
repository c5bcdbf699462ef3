"""OpenEnv's token formats over a real tiny run (toolbench in process, tiny-qwen3, the local trainer;
quaero/rollout/traces.py): saved rows -> RFC 010 records and TrainingTraces (validated by OpenEnv's own model)
-> rows with the same ids and span kinds; a second run warm-started from the first one's trace file passes
`quaero review --require-proof`; inexact records are refused one line each and never trained."""
import json

import pytest
from fixtures.runs import events_of, make_config
from openenv.core.harness.training import TrainingTrace

from quaero import cli
from quaero.rollout.traces import load_traces, rfc010_row, token_kinds, trace_row, vocab_size_of
from quaero.tools.inspect_rows import load_rows

ROLE_MASKS = {"action_mask": "action", "obs_mask": "env", "warning_mask": "corrective"}


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    from quaero.recipe.train import train

    tmp = tmp_path_factory.mktemp("traces")
    _, cfg = make_config(tmp, "source", steps=1, warmup=1, eval_every=0, eval_tasks=0,
                         extra=["env.launcher=inprocess", "logging.save_rows=all"])
    return train(cfg), tmp


def _traces_config(tmp_path, name, data):
    """A one-warm-step, one-RL-step config in process whose [data] section is `data`."""
    path, _ = make_config(tmp_path, name, steps=1, warmup=1, eval_every=0, eval_tasks=0,
                          extra=["env.launcher=inprocess"])
    path.write_text(path.read_text().replace('launcher = "local-server"', 'launcher = "inprocess"')
                    + f"\n[data]\n{data}\n")
    return path


def _export(run_dir, fmt, out):
    assert cli.main(["inspect", "rows", str(run_dir), "--export", fmt, str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _assert_same_row(row, rec):
    assert row.input_ids == rec["input_ids"]
    assert token_kinds(len(row), row.spans) == token_kinds(len(rec["input_ids"]), rec["spans"])
    assert row.echo_weights == rec["echo_weights"]  # env tokens, token 0 excluded (include_scaffold = false)
    kinds = token_kinds(len(row), row.spans)
    assert [lp for lp, k in zip(row.sampler_logprobs, kinds) if k == "action"] == \
           [lp for lp, k in zip(rec["sampler_logprobs"], kinds) if k == "action"]


@pytest.mark.slow
def test_saved_rows_round_trip_through_rfc010_and_openenv_training_traces(source_run, tmp_path):
    run_dir, _ = source_run
    saved, _ = load_rows(run_dir)
    assert {r["phase"] for r in saved} == {"sft", "rl"} and any(
        k == "corrective" or k == "env" for r in saved for k, *_ in r["spans"])
    vocab = vocab_size_of("tiny-qwen3")

    records = _export(run_dir, "rfc010", tmp_path / "rows.rfc010.jsonl")
    assert len(records) == len(saved)
    for rec, row in zip(records, saved):
        assert rec["input_ids"] == row["input_ids"] and rec["world_model_coeff"] == 0.1
        kinds = token_kinds(len(row["input_ids"]), row["spans"])
        for mask, kind in ROLE_MASKS.items():
            assert rec[mask] == [int(k == kind) for k in kinds], mask
        _assert_same_row(rfc010_row(rec, vocab, include_scaffold=False), row)

    traces = _export(run_dir, "openenv-trace", tmp_path / "rows.trace.jsonl")
    assert len(traces) == len(saved)
    for trace, row in zip(traces, saved):
        checked = TrainingTrace.model_validate(trace)  # OpenEnv's own validator, strict
        actions = sorted((s for s in row["spans"] if s[0] == "action"), key=lambda s: s[1])
        assert [t.completion_token_ids for t in checked.turns] == [row["input_ids"][s:e] for _, s, e,
                                                                   _ in actions]
        assert all(t.prompt_token_ids == row["input_ids"][:s] for t, (_, s, _, _) in zip(checked.turns,
                                                                                         actions))
        _assert_same_row(trace_row(trace, vocab, include_scaffold=False), row)


@pytest.mark.slow
def test_a_run_warm_starts_from_another_runs_trace_file_and_passes_review(source_run, tmp_path, capsys):
    run_dir, _ = source_run
    traces = tmp_path / "demos.trace.jsonl"  # the source run's warm-start rows: the oracle's demos
    assert cli.main(["inspect", "rows", str(run_dir), "--step", "1", "--export", "openenv-trace",
                     str(traces)]) == 0
    bad_line = len(traces.read_text().splitlines()) + 1
    bad = {"turns": [{"node_id": "x", "prompt_token_ids": [1, 2], "completion_token_ids": [3],
                      "per_token_logps": [-0.1], "loss_mask": [0, 0, 1]},
                     {"node_id": "y", "prompt_token_ids": [9, 9, 9], "completion_token_ids": [4],
                      "per_token_logps": [-0.1], "loss_mask": [0, 0, 0, 1]}]}
    with traces.open("a") as f:
        f.write(json.dumps(bad) + "\n")
    path = _traces_config(tmp_path, "warm", f'traces = "{traces}"')
    assert cli.main(["check", str(path)]) == 0
    assert "data        traces" in capsys.readouterr().out
    assert cli.main(["train", str(path)]) == 0
    warm = tmp_path / "runs" / "warm"
    refused = events_of(warm, "trace_record_refused")
    assert len(refused) == 1 and f":{bad_line}: turn 1's prompt is not an extension" in refused[0]["reason"]
    steps = events_of(warm, "train_step")
    assert steps[0]["phase"] == "sft" and steps[0]["rows"] == 2 and steps[0]["echo_tokens"] > 0
    assert "of 1 RL steps trained action tokens" in events_of(warm, "rl_signal")[0]["note"]  # said at the end
    assert cli.main(["review", str(warm), "--require-proof"]) == 0


def test_each_kind_of_inexact_record_is_refused_in_one_line(tmp_path):
    vocab = vocab_size_of("tiny-qwen3")
    good = {"input_ids": [1, 2, 3, 4], "action_mask": [0, 1, 1, 0], "obs_mask": [0, 0, 0, 1],
            "warning_mask": [0] * 4}
    turn = {"node_id": "a", "prompt_token_ids": [1, 2], "completion_token_ids": [3],
            "per_token_logps": [-0.5],
            "loss_mask": [0, 0, 1]}
    lines = [good,
             {**good, "obs_mask": [0, 0, 1]},                                  # mask shorter than the ids
             {**good, "obs_mask": [0, 1, 0, 1]},                               # action and obs overlap
             {**good, "input_ids": [1, 2, vocab, 4]},                          # id outside the vocabulary
             {"turns": [turn, {**turn, "node_id": "b", "prompt_token_ids": [1, 5, 3, 6],
                               "loss_mask": [0, 0, 0, 0, 1]}]},                # turn 1 does not extend turn 0
             {"turns": [{**turn, "metadata": {"quaero": {"roles": [["env", 3]]}}}]},  # roles vs loss_mask
             # OpenEnv's validator: prompt trained
             {"turns": [{**turn, "loss_mask": [1, 0, 1]}]},
             [1, 2, 3]]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    rows, refused = load_traces(path, vocab)
    assert len(rows) == 1 and rows[0].input_ids == [1, 2, 3, 4] and rows[0].echo_weights == [0, 0, 0, 1.0]
    assert [r.split(": ", 1)[0] for r in refused] == [f"{path}:{n}" for n in range(2, 10)]
    reasons = [r.split(": ", 1)[1] for r in refused]
    for reason, expected in zip(reasons, ["obs_mask does not cover the 4 input_ids", ("token 1 is marked "
                                                                                     "action and env"),
                                          f"input_ids holds id {vocab}", ("turn 1's prompt is not an "
                                                                         "extension"),
                                          "quaero roles disagree", "not a valid OpenEnv TrainingTrace",
                                          "neither an RFC 010 record", "not a UTF-8 JSON object"]):
        assert reason.startswith(expected) and "\n" not in reason, reason


@pytest.mark.slow
def test_recorded_rl_rows_train_the_rl_loss_off_policy_with_traces_loss_rl(source_run, tmp_path, capsys):
    """[data] traces_loss = "rl": the source run's RL rows (sampled, with the sampler's log-probs), exported
    as RFC 010 records with a group each, train the RL term (action tokens, an importance ratio) in the
    warm-start steps; its warm-start (oracle demo) rows have no sampler log-probs and are refused one line
    each."""
    run_dir, _ = source_run
    out = tmp_path / "rows.rfc010.jsonl"
    records = _export(run_dir, "rfc010", out)
    rl = [r for r in records if r["quaero"]["phase"] == "rl"]
    assert rl and all(r.get("group") for r in rl)  # the export names each row's group
    # the random-init model's groups have equal rewards (advantage 0): give the records a reward spread, as a
    # capable policy's would have
    for k, r in enumerate(rl):
        r["reward"], r["group"] = float(k % 2), "spread"
        r.pop("advantage")
    demos = [r for r in records if r["quaero"]["phase"] == "sft"]
    out.write_text("".join(json.dumps(r) + "\n" for r in rl + demos))
    path = _traces_config(tmp_path, "offpolicy", f'traces = "{out}"\ntraces_loss = "rl"')
    assert cli.main(["check", str(path)]) == 0
    assert "off-policy RL (importance ratio over the recorded log-probs)" in capsys.readouterr().out
    assert cli.main(["train", str(path)]) == 0
    run = tmp_path / "runs" / "offpolicy"
    refused = events_of(run, "trace_record_refused")
    assert len(refused) == len(demos) and all("no sampler log-probs" in e["reason"] for e in refused)
    warm = events_of(run, "train_step")[0]
    assert warm["phase"] == "traces_rl" and warm["action_tokens"] > 0 and warm["rl_loss"] != 0.0
    assert warm["sft_loss"] == 0.0 and warm["importance_ratio_mean"] is not None


@pytest.mark.slow
def test_a_run_guides_its_all_fail_groups_by_replaying_another_runs_recorded_episodes(source_run, tmp_path,
                                                                                      capsys):
    """`[guidance] traces`: the source run's saved rows (its warm start: the oracle's demos on the
    first tasks of the run seed's order; its RL step: the random policy's failures), exported to RFC 010,
    guide a fresh run from random init. Its first RL step draws the same tasks, every group fails, and each
    gets one member replayed from the recording: the recorded success, token for token."""
    from quaero.recipe.train import train

    run_dir, _ = source_run
    recorded = tmp_path / "recorded.rfc010.jsonl"
    records = _export(run_dir, "rfc010", recorded)
    extra = ["env.launcher=inprocess", "guidance.mode=episode", "guidance.members=1",
             f"guidance.traces={str(recorded)!r}",
             "logging.save_rows=all"]
    path, cfg = make_config(tmp_path, "replayed", steps=1, warmup=0, eval_every=0, eval_tasks=0, extra=extra)
    assert cli.main(["check", str(path), *[a for kv in extra for a in ("--set", kv)]]) == 0
    out = capsys.readouterr().out
    assert f"guide       traces {recorded}: {len(records)} exact rows" in out
    assert "replayed from the recorded episodes in" in out
    run = train(cfg)
    (step,) = events_of(run, "train_step")
    assert step["groups_guided"] == step["guided_members"] == 2  # both groups failed; each replayed
    assert step["guided_members_succeeded"] == 2 and step["guides_unmatched"] == 0
    assert step["guided_action_tokens"] > 0
    successes = [r for r in load_rows(run, 1)[0] if r["meta"]["reward"] == 1.0]
    demos = {tuple(rec["input_ids"]) for rec in records}
    assert len(successes) == 2 and all(tuple(r["input_ids"]) in demos for r in successes)
