"""Bounded lengths: `[model] max_seq_len` holds for every sampler and every row, env text is cut to
`[env] max_observation_tokens` with a visible marker, and an episode that outgrows the context ends
truncated, never a success. Real Qwen3 renderer, real tiny-qwen3, the driver on in-test envs."""
from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest
from fixtures import REPO_DIR
from fixtures.floodenv import FloodEnv, filler, lookups_forever
from fixtures.rollout import assert_exact, drive, spans_of
from fixtures.toyenv import TOOLS, HostileToyEnv

from quaero.config import ConfigError, load_config
from quaero.rollout.env_text import bound_text, truncation_marker

pytestmark = pytest.mark.hostile
FIVE_MB = 5_000_000


def n_tokens(render, text: str) -> int:
    return len(render.tokenizer.encode(text, add_special_tokens=False))


def dropped_chars(cut: str) -> int:
    """The character count a truncation marker names."""
    return int(cut.rsplit("[truncated: ", 1)[1].split()[0])


def assert_rows_fit(eps, max_seq_len: int) -> None:
    for ep in eps:
        assert all(len(row) <= max_seq_len for row in ep.rows)
        assert all(len(t.ids) <= max_seq_len for t in ep.transitions)


# ── bound_text ──────────────────────────────────────────────────────────────────────────────────────


def test_bound_text_keeps_short_text_and_cuts_long_text_to_the_bound(qwen3_render):
    tok = qwen3_render.tokenizer
    short = filler(300)
    assert bound_text(short, 512, tok) is short
    for text in (filler(20_000), "😀é" * 5_000):  # multi-byte characters: cut on a character boundary
        cut = bound_text(text, 256, tok)
        dropped = dropped_chars(cut)
        assert cut == text[:len(text) - dropped] + truncation_marker(dropped)
        assert 240 <= n_tokens(qwen3_render, cut) <= 256


# ── observations ────────────────────────────────────────────────────────────────────────────────────


def test_a_5mb_observation_is_cut_with_a_marker_counted_and_rows_fit(qwen3_render):
    rss0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.monotonic()
    envs = [FloodEnv(step_chars=FIVE_MB, reset_chars=FIVE_MB)]
    eps, stats = drive(qwen3_render, envs=envs, tasks=1, env__max_observation_tokens=512)
    elapsed, grown_mb = (
        time.monotonic() - t0,
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
    )
    assert elapsed < 30 and grown_mb < 500  # unbounded: a 655k-token row, 5.6 GB, killed at 240 s
    (ep,) = eps
    task = next(m["content"] for m in ep.messages if m["role"] == "user")
    tool = next(m["content"] for m in ep.messages if m["role"] == "tool")
    for text in (task, tool):
        assert "… [truncated: " in text and text.endswith(" more characters]")
        assert n_tokens(qwen3_render, text) <= 512
    full = "apple: 3 EUR " + filler(FIVE_MB)
    assert tool == full[:len(full) - dropped_chars(tool)] + truncation_marker(dropped_chars(tool))
    # the cut text is what the sampling prompt and the bridged row hold: exact, and the task still succeeds
    assert stats["observations_truncated"] == 2 and stats["prefix_mismatches"] == 0
    assert stats["env_responses_captured"] == 2 and stats["context_exhausted"] == 0
    assert ep.success and not ep.truncated
    assert_exact(qwen3_render, ep)
    assert task.split("… [truncated")[0] in qwen3_render.tokenizer.decode(ep.rows[0].input_ids)
    assert_rows_fit(eps, 4096)


def test_a_flood_of_added_token_strings_is_bounded_as_the_template_sees_it(qwen3_render):
    """`<|im_end|>` is one token raw and about seven defused: a bound counted on raw text let this flood
    through at ~3,500 tokens per 512-token observation."""
    env = HostileToyEnv("<|im_end|>" * 20_000)
    env.tools = TOOLS  # tool specs are not observations: the flood goes into every message instead
    eps, stats = drive(qwen3_render, envs=[env], tasks=1, env__max_observation_tokens=512)
    (ep,) = eps
    assert stats["observations_truncated"] == 4 and stats["prefix_mismatches"] == 0 and ep.success
    # each tool result as the rows hold it (a token may merge at an edge)
    for row, span in spans_of(ep, "env"):
        assert 400 < span.end - span.start <= 513
    for m in ep.messages:  # every env message as the sampling prompt holds it
        if m["role"] != "assistant":
            content = len(qwen3_render.prompt_ids([m], None)) - len(
                qwen3_render.prompt_ids([{**m, "content": ""}], None)
            )
            assert 400 < content <= 513


# ── the context ─────────────────────────────────────────────────────────────────────────────────────


def test_a_long_episode_ends_context_exhausted_truncated_not_a_success(qwen3_render):
    eps, stats = drive(qwen3_render, envs=[FloodEnv(step_chars=3000)], tasks=2, policy=lookups_forever,
                       env__max_turns=100, model__max_seq_len=2048)
    assert all(ep.truncated and not ep.success and ep.turns < 100 for ep in eps)
    assert stats["context_exhausted"] == stats["episodes_truncated"] == 2 and stats["success_rate"] == 0.0
    assert stats["episodes_dropped"] == 0 and stats["prefix_mismatches"] == 0
    for ep in eps:  # every turn started with room for a full completion (max_tokens 8)
        assert all(len(t.prompt_ids) + 8 <= 2048 for t in ep.transitions)
    # the last response ran past the context: its tail is cut, the tokens kept are the bridged ones
    assert stats["env_responses_clipped"] == 2
    assert_rows_fit(eps, 2048)
    assert [len(row) for ep in eps for row in ep.rows] == [2048, 2048]
    for ep in eps:
        t = ep.transitions[-1]
        (row,) = ep.rows
        assert row.input_ids[:len(t.prompt_ids) + len(t.action_ids)] == t.prompt_ids + t.action_ids


def test_an_episode_whose_first_prompt_leaves_no_room_ends_at_once(qwen3_render):
    eps, stats = drive(qwen3_render, envs=[FloodEnv(reset_chars=FIVE_MB)], tasks=1,
                       env__max_observation_tokens=480, model__max_seq_len=512)
    (ep,) = eps
    assert ep.truncated and not ep.success and ep.turns == 0 and ep.rows == []
    assert stats["context_exhausted"] == stats["episodes_truncated"] == 1 and stats["turns"] == 0


# ── samplers ────────────────────────────────────────────────────────────────────────────────────────


# ── check ───────────────────────────────────────────────────────────────────────────────────────────


def test_check_refuses_max_tokens_at_or_past_the_context():
    proc = subprocess.run([sys.executable, "-m", "quaero.cli", "check", "envs/toolbench.toml",
                           "--set", "sampler.max_tokens=1000000000"],
                          cwd=REPO_DIR, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert (
        "[sampler] max_tokens=1000000000 >= [model] max_seq_len=4096" in line
        and "envs/toolbench.toml" in line
    )


def test_check_refuses_an_observation_bound_that_fills_the_context():
    path = REPO_DIR / "envs/toolbench.toml"
    with pytest.raises(ConfigError, match=r"\[env\] max_observation_tokens=1024 >= \[model\] "
                                          r"max_seq_len=1024"):
        load_config(path, ["model.max_seq_len=1024", "env.max_observation_tokens=1024"])
    cfg = load_config(path, ["model.max_seq_len=1024"])
    assert cfg.observation_token_limit == 512
    assert load_config(path, ["env.max_observation_tokens=300"]).observation_token_limit == 300
