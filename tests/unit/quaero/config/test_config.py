"""Config schema: valid configs load; bad ones fail before anything heavy, with one clean line."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from quaero.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[4]
MAIN = ROOT / "envs" / "toolbench.toml"


def write(tmp_path, body: str) -> Path:
    p = tmp_path / "job.toml"
    p.write_text(textwrap.dedent(body))
    return p


def test_main_job_config_loads_with_seed_defaults():
    cfg = load_config(MAIN)
    opts = cfg.backend.options
    assert cfg.backend.backend == "local"
    assert opts.train_selective_suffix_logits is True
    assert opts.train_compile_selective_ce_min_tokens == 128
    assert opts.train_supervised_context_tokens == 0
    assert opts.train_save_on_cpu_min_numel == 1048576


def test_override_sets_any_field_with_toml_types():
    cfg = load_config(MAIN, ["training.steps=3", "run.name=smoke",
                             "backend.options.train_logprob_chunk_size=256",
                             "echo.weight=0.5"])
    assert (cfg.training.steps, cfg.run.name) == (3, "smoke")
    assert cfg.backend.options.train_logprob_chunk_size == 256 and cfg.echo.weight == 0.5


@pytest.mark.parametrize("override, needle", [
    ("training.stepz=3", "[training] stepz: unknown key; did you mean 'steps'?"),
    ("backend.options.train_selective_sufix_logits=true", "did you mean 'train_selective_suffix_logits'?"),
    ("training.steps='many'", "[training] steps='many'"),
    ("echo.weight=-1", "[echo] weight=-1"),
    ("backend.options.train_compile_selective_ce='sometimes'", "train_compile_selective_ce='sometimes'"),
])
@pytest.mark.hostile
def test_bad_values_name_file_section_key_and_value(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, [override])
    msg = str(e.value)
    assert needle in msg and str(MAIN) in msg and "\n" not in msg


def test_env_source_rules(tmp_path):
    p = write(tmp_path, """
        [env]
        url = "ws://127.0.0.1:9"
    """)
    assert load_config(p).env.launcher == "remote"
    p = write(tmp_path, """
        [env]
        launcher = "local-server"
    """)
    with pytest.raises(ConfigError, match="needs entry"):
        load_config(p)
    p = write(tmp_path, """
        [env]
        url = "ws://127.0.0.1:9"
        kwargs = { difficulty = 1 }
    """)
    with pytest.raises(ConfigError, match="kwargs construct envs quaero starts"):
        load_config(p)
    p = write(tmp_path, "[run]\nname = 'x'\n")
    with pytest.raises(ConfigError, match=r"\[config\]: no env: add an \[env\] section \(or \[\[envs\]\]"):
        load_config(p)


def test_env_urls_mean_remote_servers_and_exclude_url(tmp_path):
    cfg = load_config(write(tmp_path, """
        [env]
        urls = ["ws://h1:8000", "ws://h2:8000"]
    """)).env
    assert (cfg.launcher, cfg.server_urls) == ("remote", ["ws://h1:8000", "ws://h2:8000"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(write(tmp_path, """
            [env]
            url = "ws://h1:8000"
            urls = ["ws://h2:8000"]
        """))
    with pytest.raises(ConfigError, match="url/urls is set but launcher='inprocess'"):
        load_config(write(tmp_path, """
            [env]
            entry = "envs.toolbench:ToolBenchEnv"
            launcher = "inprocess"
            urls = ["ws://h2:8000"]
        """))


@pytest.mark.hostile
def test_invalid_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[run\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize("override", ["training.stepz=3", "training.steps=-1", "backend.backend='tinker'"])
@pytest.mark.hostile
def test_cli_check_exits_1_with_one_line_and_no_traceback(override):
    r = subprocess.run(check=False, args=[sys.executable, "-m", "quaero.cli", "check", str(MAIN), "--set",
                                          override],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.slow
def test_cli_check_prints_plan():
    r = subprocess.run(check=False, args=[sys.executable, "-m", "quaero.cli", "check", str(MAIN)],
                       capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr
    for needle in ("renderer 'qwen3'", "strict_shared_forward=True", "train_selective_suffix_logits=True",
                   "LoRA off (supported: [backend] lora = true)", "config OK"):
        assert needle in r.stdout
    import importlib.util

    # `auto` on CPU: vLLM in one process, hf on each rank under torchrun (the line says both); the `quaero
    # check` subprocess sees this machine's vLLM as it is (this process's autouse fixture hides it)
    has_vllm = importlib.util.find_spec("vllm") is not None
    sampler = "vllm, hf on each rank of `quaero train --nproc N` (" if has_vllm else "hf ("
    assert f"\nsampler     {sampler}" in r.stdout


@pytest.mark.parametrize("override,needle", [
    ("run.name='../../x'", "[run.name]: name='../../x' must be one folder name"),
    ("run.name='/abs'", "must be one folder name"),
    ('run.name="a\\u0000b"', "must be one folder name"),
    ("echo.weight=inf", "[echo] weight=inf: Input should be a finite number"),
    ("backend.lr=nan", "[backend] lr=nan"),
    ("rollout.group_size=1", ("[rollout] group_size=1 with [training] steps=12: a group of one episode has "
                              "advantage 0")),
    pytest.param("sampler.top_p=0.5", "[sampler] top_p=0.5 with [training] steps=12: the sampler's log-probs "
                 "are renormalised", marks=pytest.mark.hostile),
    pytest.param("sampler.top_k=5", "[sampler] top_k: unknown key", marks=pytest.mark.hostile),
    ("env.url='ws://127.0.0.1:9'", ("[env] url/urls is set but launcher='local-server'; set "
                                   "launcher='remote'")),
    ("env.launcher='remote'", "[env]: launcher='remote' needs url"),
    # accepted before, yet every step's loss was inf, its gradient skipped: nothing trained
    ("rollout.all_fail_advantage=-1e308", ("[rollout.all_fail_advantage]: all_fail_advantage=-1e+308: "
                                            "advantages past +-100 make the loss overflow")),
    ("rollout.positive_advantage_weight=1e300", "positive_advantage_weight=1e+300: advantages past +-100"),
])
@pytest.mark.hostile
def test_meaningless_settings_are_refused_before_anything_loads(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, [override])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.hostile
def test_an_entry_beside_a_server_url_is_refused_not_silently_ignored():
    with pytest.raises(ConfigError, match=r"entry='envs.toolbench:ToolBenchEnv' and url='ws://127.0.0.1:9' "
                                          r"are both set"):
        load_config(MAIN, ["env.url='ws://127.0.0.1:9'", "env.launcher='remote'", "env.kwargs={}"])


def test_settings_that_only_matter_for_rl_are_fine_without_rl_steps():
    cfg = load_config(MAIN, ["training.steps=0", "rollout.group_size=1", "sampler.top_p=0.5"])
    assert cfg.rollout.group_size == 1 and cfg.sampler.top_p == 0.5


@pytest.mark.hostile
def test_unreadable_config_files_are_one_line_errors(tmp_path):
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"\xff\xfe[run]\n")
    with pytest.raises(ConfigError, match=r"latin1.toml: not UTF-8 text \(byte 0\); save the config as "
                                          r"UTF-8"):
        load_config(bad)
    with pytest.raises(ConfigError, match="is a folder; pass a TOML file"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"--set '=3': the key is empty"):
        load_config(MAIN, ["=3"])
    with pytest.raises(ConfigError, match=r"--set 'training.=3': the key is empty"):
        load_config(MAIN, ["training.=3"])


@pytest.mark.hostile
def test_a_config_or_override_nested_thousands_deep_is_one_line(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    p = tmp_path / "deep.toml"
    p.write_text(MAIN.read_text() + f"\n[logging]\nreport_to = {deep}\n")
    with pytest.raises(ConfigError, match=r"deep.toml: nests arrays or tables too deeply to read"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"^--set env.kwargs=\.\.\.: the value nests too deeply to read"):
        load_config(MAIN, [f"env.kwargs={deep}"])


@pytest.mark.hostile
def test_a_pasted_huge_value_is_cut_in_its_error_line():
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, [f"training.steps='{'x' * 100_000}'"])
    assert "[training] steps='xxx" in str(e.value) and "... (100002 characters)" in str(e.value)
    assert len(str(e.value)) < 500


@pytest.mark.hostile
def test_the_plan_of_a_huge_step_count_is_counted_not_enumerated():
    from quaero.preflight.check import work_line

    line = work_line(load_config(MAIN, ["training.steps=10000000000000000000000", "training.eval_every=7",
                                        "training.eval_tasks=64"]))
    assert work_line(load_config(MAIN, ["training.steps=9", "training.warmup_sft_steps=0",
                                        "training.eval_every=4",
                                        "training.eval_tasks=64"])) \
        .split("eval ")[1].startswith("256 (4 evals x 64)")  # 0, 4, 8 and the last, 9
    total = 500 + 10**22  # the main job's warm start, then the RL steps
    evals = 1 + total // 7 + (total % 7 != 0)  # untrained, every 7th step, and the last
    assert "(10000000000000000000000 steps x 4 x 8)" in line and f"({evals} evals x 64)" in line


@pytest.mark.hostile
def test_dynamic_sampling_with_rollouts_sampled_ahead_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, ["rollout.dynamic_sampling=true", "rollout.max_off_policy_steps=1"])
    assert "[rollout] dynamic_sampling=true with max_off_policy_steps=1" in str(e.value)
    for bad, needle in [("echo.schedule='cosine'", "[echo] schedule='cosine'"),
                        ("loss.aggregation='mean'", "[loss] aggregation='mean'"),
                        ("rollout.dynamic_sampling_max_groups=0.5", ("[rollout] "
                                                                     "dynamic_sampling_max_groups=0.5"))]:
        with pytest.raises(ConfigError) as e:
            load_config(MAIN, [bad])
        assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.hostile
@pytest.mark.parametrize("url", ["ftp://127.0.0.1:21", "127.0.0.1:8000", "file:///etc/passwd"])
def test_an_env_url_train_would_refuse_is_refused_by_check(url):
    """`quaero check` and `quaero train` agree: an [env] url the remote launcher cannot speak to is a config
    error before anything loads (it was accepted by check, refused by train)."""
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, [f"env.url='{url}'", "env.launcher='remote'", "env.entry=''", "env.kwargs={}",
                           "training.warmup_sft_steps=0"])
    assert str(e.value) == (f"{MAIN} [env] url: {url!r} is not an OpenEnv server address; write it as "
                            "\"ws://host:port\" or \"http://host:port\"")
    for good in ("ws://127.0.0.1:9", "http://10.0.0.2:8000/", "wss://env.example.org/ws"):
        load_config(MAIN, [f"env.url='{good}'", "env.launcher='remote'", "env.entry=''", "env.kwargs={}",
                           "training.warmup_sft_steps=0"])
