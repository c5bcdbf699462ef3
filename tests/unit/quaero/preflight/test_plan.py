"""A config judged against the installed components, and the trainer spec built from it."""
import os
import subprocess
import sys
from operator import attrgetter
from pathlib import Path

import pytest

from quaero.config import ConfigError, QuaeroConfig, load_config
from quaero.preflight.plan import check_components, load_checked, trainer_spec
from trainers import registry
from trainers.policy_losses import CISPO, GSPO
from trainers.spec import MemoryPolicy, SelectivePolicy, TrainerSpec, options

ROOT = Path(__file__).resolve().parents[4]
MAIN = ROOT / "envs" / "toolbench.toml"


@pytest.mark.hostile
def test_unknown_trainer_names_file_key_value_and_choices():
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, ["backend.backend='tinker'"])
    msg = str(e.value)
    assert msg.startswith(f"{MAIN} [backend] backend='tinker': unknown backend; use one of local, unsloth")
    assert "\n" not in msg


def test_echo_needs_strict_shared_forward(monkeypatch):
    weak = registry.Capabilities(False, False, False, ("cpu",), "trainers.local:LocalTrainer")
    monkeypatch.setitem(registry.TRAINERS, "loose", weak)
    with pytest.raises(ConfigError, match="ECHO needs strict shared-forward; use 'local' or 'unsloth'"):
        load_checked(MAIN, ["backend.backend='loose'"])
    assert load_checked(MAIN, ["backend.backend='loose'", "echo.enabled=false"]).echo.enabled is False
    with pytest.raises(ConfigError, match="has no LoRA support"):
        load_checked(MAIN, ["backend.backend='loose'", "echo.enabled=false", "backend.lora=true"])


def test_compiled_ce_require_needs_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so 'require' is legal here")
    with pytest.raises(ConfigError, match="needs CUDA"):
        load_checked(MAIN, ["backend.options.train_compile_selective_ce='require'"])


@pytest.mark.hostile
def test_device_cuda_without_cuda_is_one_line_at_check():
    """It was torch's AssertionError ('Torch not compiled with CUDA enabled') from the memory plan."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so device='cuda' is legal here")
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, ["run.device='cuda'"])
    assert str(e.value).startswith(f"{MAIN} [run] device='cuda': this torch has no CUDA device")
    assert "use device = 'auto'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.hostile
def test_num_iterations_past_its_bound_is_refused_at_check_with_the_figure():
    """A billion passes over a batch passed check; the RL step's mini-step list then exhausted memory."""
    from trainers.spec import MAX_ITERATIONS

    assert load_checked(MAIN, [f"training.num_iterations={MAX_ITERATIONS}"]).training.num_iterations == 64
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, ["training.num_iterations=1000000000"])
    assert str(e.value) == (f"{MAIN} [training] num_iterations=1000000000: Input should be less than or "
                            "equal to 64")


def test_component_rules_are_not_config_rules():
    """load_config reads the schema only; the recipe checks the components before any model loads."""
    cfg = load_config(MAIN, ["backend.backend='tinker'"])
    with pytest.raises(ConfigError, match="unknown backend"):
        check_components(cfg)
    from quaero.recipe.parts import build

    with pytest.raises(ConfigError, match="unknown backend"):
        build(cfg, {}, None)  # fails before the trainer, the tokenizer or the sampler is built


def test_config_module_does_not_import_the_trainer_registry():
    code = "import sys, quaero.config; print('trainers.registry' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]


def test_default_config_gives_the_default_spec():
    """TrainerSpec's defaults and the config's are one set of values."""
    assert trainer_spec(QuaeroConfig.model_validate({"env": {"entry": "x:y"}})) == TrainerSpec()


def test_every_trainer_option_is_a_config_key_with_its_default_and_bounds():
    """trainers/spec.py declares each option once: its config key exists, defaults to the spec's default and
    refuses a value past the option's bounds, in one line naming the key."""
    cfg = QuaeroConfig.model_validate({"env": {"entry": "x:y"}})
    assert len(options()) > 30
    for o in options():
        assert attrgetter(o.key)(cfg) == o.default, o.key
        for bound, limit in o.bounds.items():
            past = limit + 1 if bound in ("le", "lt") else limit if bound == "gt" else limit - 1
            with pytest.raises(ConfigError, match=rf"\[{o.section}\] {o.name}={past}: "):
                load_config(MAIN, [f"{o.key}={past}"])


def test_check_prints_every_trainer_option_with_the_value_the_config_sets():
    from quaero.preflight.check import SHOWN_WITH_THEIR_SECTION, trainer_option_lines

    cfg = load_config(MAIN, ["backend.lr=0.5", "backend.options.train_save_on_cpu_min_numel=11",
                             "model.max_seq_len=512", "backend.options.train_supervised_context_tokens=6"])
    text = "\n".join(trainer_option_lines(cfg))
    assert "lr=0.5, " in text and "model.max_seq_len=512," in text
    assert "train_save_on_cpu_min_numel=11," in text
    assert "train_supervised_context_tokens=6 (APPROXIMATION: rows cropped)" in text
    assert all(len(line) <= 110 for line in text.splitlines())
    for o in options():  # each printed once: on the trainer lines, or on its section's line
        assert (o.key in SHOWN_WITH_THEIR_SECTION) != (f" {o.name}=" in text or f" {o.key}=" in text), o.key


def test_every_trainer_option_reaches_the_spec():
    cfg = load_config(
        MAIN,
        [
            "model.name='m'",
            "model.dtype='bfloat16'",
            "model.max_seq_len=512",
            "run.seed=7",
            "backend.lr=0.5",
            "backend.betas=[0.8, 0.9]",
            "backend.weight_decay=0.1",
            "backend.max_grad_norm=2.0",
            "backend.micro_batch_tokens=99",
            "backend.lora=true",
            "backend.lora_r=4",
            "backend.lora_alpha=8",
            "backend.gradient_checkpointing=true",
            "backend.unsloth_fast_inference=true",
            "sampler.temperature=0.7",
            "loss.policy.type='cispo'",
            "loss.policy.clip_eps_high=4.0",
            "loss.policy.importance_sampling_level='sequence'",
            "loss.sampler_correction='sequence_mask'",
            "loss.sampler_correction_cap=2.5",
            "training.steps_per_generation=3",
            "training.num_iterations=2",
            "echo.enabled=false",
            "echo.weight=0.4",
            "loss.aggregation='constant'",
            "echo.normalization='sequence'",
            "rollout.tasks_per_step=3",
            "rollout.group_size=5",
            "env.max_turns=2",
            "sampler.max_tokens=7",
            "backend.options.train_selective_suffix_logits=false",
            "backend.options.train_logprob_chunk_size=16",
            "backend.options.train_compile_selective_ce='auto'",
            "backend.options.train_compile_selective_ce_min_tokens=3",
            "backend.options.train_selective_dense_min_density=0.25",
            "backend.options.train_selective_suffix_max_bytes=5",
            "backend.options.train_selective_hidden_max_bytes=9",
            "backend.options.train_save_on_cpu=true",
            "backend.options.train_save_on_cpu_pin_memory=true",
            "backend.options.train_save_on_cpu_min_numel=11",
            "backend.options.train_supervised_context_tokens=6",
            "distributed.strategy='ddp'",
        ],
    )
    assert trainer_spec(cfg) == TrainerSpec(
        model="m",
        dtype="bfloat16",
        max_seq_len=512,
        seed=7,
        lr=0.5,
        betas=(0.8, 0.9),
        weight_decay=0.1,
        max_grad_norm=2.0,
        micro_batch_tokens=99,
        lora=True,
        lora_r=4,
        lora_alpha=8,
        gradient_checkpointing=True,
        unsloth_fast_inference=True,
        temperature=0.7,
        policy_loss=CISPO(clip_eps_high=4.0, importance_sampling_level="sequence"),
        sampler_correction="sequence_mask",
        sampler_correction_cap=2.5,
        steps_per_generation=3,
        num_iterations=2,
        echo=False,
        echo_weight=0.4,
        loss_aggregation="constant",
        loss_constant=3 * 5 * 2 * 7,
        echo_normalization="sequence",
        selective_logits=False,
        selective=SelectivePolicy(
            dense_min_density=0.25,
            suffix_max_bytes=5,
            hidden_max_bytes=9,
            chunk_size=16,
            compile_mode="auto",
            compile_min_tokens=3,
        ),
        memory=MemoryPolicy(
            save_on_cpu=True,
            save_on_cpu_pin_memory=True,
            save_on_cpu_min_numel=11,
            supervised_context_tokens=6,
            cpu_malloc_cache=True,  # envs/toolbench.toml's
        ),
        distributed="ddp",
    )


@pytest.mark.hostile
def test_fsdp2_with_lora_is_refused_naming_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, ["distributed.strategy='fsdp2'", "backend.lora=true"])
    assert str(e.value).startswith(f"{MAIN} [distributed] strategy='fsdp2' with [backend] lora=true: ")
    assert "use strategy = 'ddp'" in str(e.value)


def test_strategy_none_under_a_launcher_is_refused_at_check(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"\[distributed\] strategy='none' under torchrun with 2 ranks"):
        check_components(load_config(MAIN), MAIN)
    check_components(load_config(MAIN, ["distributed.strategy='ddp'"]), MAIN)
    with pytest.raises(ConfigError, match=r"\[rollout\] dynamic_sampling=true under torchrun \(2 ranks\)"):
        check_components(load_config(MAIN, ["distributed.strategy='ddp'", "rollout.dynamic_sampling=true"]),
                         MAIN)


def test_an_unknown_distributed_strategy_is_refused_with_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, ["distributed.strategy='zero3'"])
    assert str(e.value).startswith(f"{MAIN} [distributed] strategy='zero3': ")
    assert "'none', 'ddp' or 'fsdp2'" in str(e.value)


@pytest.mark.parametrize("override,needle", [
    ("model.renderer='nope'", "[model.renderer]: renderer='nope' is not a renderer quaero knows: 'auto', "),
    # with openai-harmony's vocabulary reachable, the probe finds tiny-qwen3 lacks harmony's tokens; offline
    # (no vocabulary file), the check's line names TIKTOKEN_ENCODINGS_BASE: either is one line, no download
    ("model.renderer='gpt-oss'", ("Special token '<|start|>' not found in tokenizer vocabulary",
                                  "set TIKTOKEN_ENCODINGS_BASE to that folder")),
    ("model.renderer='default'", ("[model] name='tiny-qwen3', renderer 'default' (named in [model] renderer) "
                                  "cannot append an env response exactly")),
    ("model.name='/no/such/model'", ("[model] name='/no/such/model': model '/no/such/model': not a local "
                                    "folder")),
    ("run.output_dir='/proc/quaero-runs'", ("[run] output_dir='/proc/quaero-runs': cannot create folders in "
                                           "/proc")),
])
@pytest.mark.hostile
@pytest.mark.slow
def test_check_probes_the_model_renderer_and_run_folder_before_any_model_loads(override, needle):
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, [override])
    needles = needle if isinstance(needle, tuple) else (needle,)
    assert any(n in str(e.value) for n in needles) and "\n" not in str(e.value)


def test_a_renderer_that_cannot_bridge_is_fine_without_echo():
    assert load_checked(MAIN, ["model.renderer='default'", "echo.enabled=false"]).model.renderer == "default"


@pytest.mark.hostile
def test_output_dir_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        load_checked(MAIN, [f"run.output_dir='{tmp_path / 'file' / 'runs'}'"])
    assert not any(p.name.startswith(".quaero-probe-") for p in tmp_path.iterdir())  # the probe cleans up


@pytest.mark.parametrize("overrides,needle", [
    # a remote env has no entry module to find oracle_policy in
    (["env.entry=''", "env.kwargs={}", "env.launcher='remote'", "env.url='http://127.0.0.1:9'"],
     "[training] warmup_sft_steps=500 with a remote env: quaero finds oracle_policy next to [env] entry"),
    (["training.oracle='envs.toolbench.oracle'"],
     "[training] oracle='envs.toolbench.oracle': expected 'package.module:Name'"),
    (["training.oracle='no_such_pkg.oracle:oracle_policy'"],
     "[training] oracle='no_such_pkg.oracle:oracle_policy': cannot import module 'no_such_pkg.oracle'"),
    (["training.oracle='envs.toolbench.oracle:no_such_function'"],
     ("[training] oracle='envs.toolbench.oracle:no_such_function': module 'envs.toolbench.oracle' has no "
     "attribute 'no_such_function'; write oracle_policy(info)")),
    (["env.entry='fixtures.guess:GuessEnv'"], ("[training] oracle (unset: beside [env] entry)="
     "'fixtures.guess:oracle_policy': module 'fixtures.guess' has no attribute 'oracle_policy'")),
])
@pytest.mark.hostile
def test_a_warm_start_without_a_demonstrator_fails_at_check(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_warm_start_oracle_comes_from_the_entry_or_from_training_oracle():
    from envs.toolbench.oracle import oracle_policy
    from quaero.preflight.plan import resolve_oracle

    assert resolve_oracle(load_checked(MAIN)) is oracle_policy
    remote = load_checked(MAIN, ["env.entry=''", "env.kwargs={}", "env.launcher='remote'",
                                 "env.url='http://127.0.0.1:9'",
                                 "training.oracle='envs.toolbench.oracle:oracle_policy'"])
    assert resolve_oracle(remote) is oracle_policy


def test_an_openenv_overwritten_by_openenv_core_fails_at_check(monkeypatch):
    from quaero.openenv_client import loading

    fix = (
        "openenv 0.10.0's files (openenv/x.py) were overwritten by openenv-core 0.3.0 ...; "
        "restore them with: "
        + loading.openenv_repair_command("0.10.0")
    )
    monkeypatch.setattr(loading, "overwritten_openenv", lambda: fix)
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN)
    assert str(e.value).endswith("pip install --force-reinstall --no-deps openenv==0.10.0")


def test_a_trainer_runs_only_the_distributed_strategies_it_is_built_for():
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, ["backend.backend='unsloth'", "distributed.strategy='ddp'"])
    assert "[distributed] strategy='ddp': backend 'unsloth' is built for 'none' only; use backend='local'" \
        in str(e.value)
    for strategy in ("none", "ddp", "fsdp2"):
        assert strategy in registry.TRAINERS["local"].strategies


@pytest.mark.hostile
@pytest.mark.parametrize("entry,needle", [
    ("json", "[env] entry='json': expected 'package.module:Name'"),
    ("json:JSONDecodeError", "[env] entry='json:JSONDecodeError'"),
])
def test_check_imports_and_inspects_the_env_entry(entry, needle, capsys):
    from quaero.cli import main

    assert main(["check", str(MAIN), "--set", f"env.entry='{entry}'", "--set", "env.kwargs={}",
                 "--set", "training.warmup_sft_steps=0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


@pytest.mark.hostile
def test_a_run_folder_that_is_a_file_a_link_outside_or_holds_a_link_is_refused(tmp_path):
    out, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("precious")

    def refusal(name: str) -> str:
        with pytest.raises(ConfigError) as e:
            load_checked(MAIN, [f"run.output_dir='{out}'", f"run.name='{name}'"])
        assert "\n" not in str(e.value)
        return str(e.value)

    (out / "afile").write_text("x")
    assert f"[run] name='afile': {out / 'afile'} is a file, not a run folder" in refusal("afile")
    (out / "away").symlink_to(elsewhere)  # checkpoints would be written, renamed and pruned over there
    assert f"{out / 'away'} is a link to {elsewhere}, outside output_dir" in refusal("away")
    (out / "trap" / "checkpoints").mkdir(parents=True)  # a planted link: quaero would write through it
    (out / "trap" / "checkpoints" / "train.lock").symlink_to(elsewhere / "precious.txt")
    assert (
        f"{out / 'trap' / 'checkpoints' / 'train.lock'} is a link to {elsewhere / 'precious.txt'}; "
        "quaero would "
        "write through it" in refusal("trap")
    )
    assert (elsewhere / "precious.txt").read_text() == "precious"
    # a link that stays in output_dir is fine
    (out / "alias").symlink_to(out / "afile2", target_is_directory=True)
    (out / "afile2").mkdir()
    assert load_checked(MAIN, [f"run.output_dir='{out}'", "run.name='alias'"]).run_dir == out / "alias"
    # as check judges
    assert load_config(MAIN, ["run.output_dir='~/q'"]).run_dir == Path.home() / "q" / "toolbench"


@pytest.mark.hostile
@pytest.mark.parametrize("name", ["train.lock", "config.json", "events.jsonl", "rows/step-000001.jsonl"])
def test_a_run_folder_file_that_is_a_hard_link_is_refused(tmp_path, name):
    """A hard link is another name for a file elsewhere: truncating train.lock, replacing config.json or
    appending to events.jsonl would write that file. `quaero check` (and so `train`) refuses it in one
    line."""
    out, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    (out / "trap" / "rows").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "precious.txt").write_text("precious")
    os.link(elsewhere / "precious.txt", out / "trap" / name)
    with pytest.raises(ConfigError) as e:
        load_checked(MAIN, [f"run.output_dir='{out}'", "run.name='trap'"])
    assert str(e.value) == (f"{MAIN} [run] name='trap': {out / 'trap' / name} is a hard link (2 names for "
                            "one file); quaero would write through it (train.lock, config.json, events, "
                            "checkpoints): a run folder holds no links; remove it (or replace it by a copy)")
    assert (elsewhere / "precious.txt").read_text() == "precious"


@pytest.mark.hostile
@pytest.mark.parametrize("entry", ["os:system", "json:dumps"])
def test_check_never_calls_an_env_factory(tmp_path, entry, capsys):
    """`entry = "os:system"` with a `command` kwarg: `quaero check` imports the entry and reads a factory's
    return annotation, and calls nothing (the command would run at check time); it says so on its env line."""
    from quaero.cli import main

    marker = tmp_path / "ran"
    code = main(["check", str(MAIN), "--set", f"env.entry='{entry}'", "--set",
                 f"env.kwargs={{command='touch {marker}'}}",
                 "--set", "training.warmup_sft_steps=0"])
    out = capsys.readouterr().out
    assert code == 0 and not marker.exists()
    assert (
        f"env action  {entry} is a factory function: not called here (it would run with [env] kwargs)" in out
    )


def test_the_policy_loss_is_one_check_line_and_a_bad_one_one_error():
    from quaero.preflight.check import loop_line, policy_loss_line, rollout_line

    cfg = load_config(MAIN, [])
    assert policy_loss_line(cfg).startswith("loss        ppo_clip -min(r A, clip(r, 0.8, 1.2) A)")
    assert "advantage='grpo'" in rollout_line(cfg) and "optimizer steps" not in loop_line(cfg)
    cfg = load_config(MAIN, ["loss.policy.type='cispo'", "loss.policy.clip_eps_high=4.0",
                             "loss.sampler_correction='token_truncate'",
                             "rollout.positive_advantage_weight=0.1", "training.steps_per_generation=2"])
    line = policy_loss_line(cfg)
    assert "cispo -sg(min(r, 5)) A log pi" in line and "token_truncate at cap 3" in line
    # each line names its own section's keys: the estimator is [rollout]'s, the optimizer steps [training]'s
    assert "positive_advantage_weight=0.1" in rollout_line(cfg) and "advantage" not in line
    assert "2 optimizer steps per rollout batch" in loop_line(cfg)
    with pytest.raises(ConfigError, match=r"\[loss.policy\]: clip_eps_low=1\.5: .* inverts"):
        load_config(MAIN, ["loss.policy.clip_eps_low=1.5"])
    with pytest.raises(ConfigError, match=r"\[loss.policy\] importance_sampling_level: unknown key"):
        load_config(MAIN, ["loss.policy.type='gspo'", "loss.policy.importance_sampling_level='token'"])
    with pytest.raises(ConfigError, match="sampler_correction_cap=0.5: below 1"):
        load_config(MAIN, ["loss.sampler_correction='token_mask'", "loss.sampler_correction_cap=0.5"])
    assert trainer_spec(load_config(MAIN, ["loss.policy.type='gspo'"])).policy_loss == GSPO()


def test_each_check_line_names_the_keys_of_its_own_section():
    """`quaero check`'s training, rollout and loss lines spell each key as its TOML section does."""
    import re

    from quaero.config.loop import TrainingConfig
    from quaero.config.rollout import RolloutConfig
    from quaero.preflight.check import loop_line, rollout_line

    cfg = load_config("envs/toolbench_smollm2_rl.toml", ["training.num_iterations=2"])
    for line, section in ((loop_line(cfg), TrainingConfig), (rollout_line(cfg), RolloutConfig)):
        keys = set(re.findall(r"(\w+)=", line))
        assert keys and keys <= set(section.model_fields), (line, keys - set(section.model_fields))
    assert rollout_line(cfg).startswith("rollout     2 tasks x group 8 a step, dynamic_sampling=True (<= 2x")
    assert loop_line(cfg).startswith("training    steps=80 (lr 0.0003), warmup_sft_steps=10 (lr 0.001), 2 ")


def test_the_kl_penalty_is_on_the_loss_line_and_a_kl_without_a_reference_is_refused():
    from quaero.preflight.check import policy_loss_line

    line = policy_loss_line(load_config(MAIN, ["loss.beta=0.04"]))
    assert "+ 0.04 x KL k3 to the frozen reference" in line
    assert "KL" not in policy_loss_line(load_config(MAIN, []))
    spec = trainer_spec(load_config(MAIN, ["loss.beta=0.04", "loss.kl_estimator='k1'"]))
    assert (spec.beta, spec.kl_estimator) == (0.04, "k1")
    with pytest.raises(ConfigError) as e:
        load_config(MAIN, ["loss.beta=0.1", "distributed.strategy='fsdp2'"])
    assert str(e.value).startswith(f"{MAIN} [loss] beta=0.1 with [distributed] strategy='fsdp2': ")
    with pytest.raises(ConfigError, match="kl_estimator"):
        load_config(MAIN, ["loss.kl_estimator='k4'"])
    with pytest.raises(ConfigError, match="beta"):
        load_config(MAIN, ["loss.beta=-1"])


@pytest.mark.hostile
def test_check_of_an_unbuilt_named_shape_says_its_size_and_builds_nothing(tmp_path, monkeypatch, capsys):
    """The first `quaero check` of qwen3-1.7b-shape built the model silently (143 s, 9.5 GB); now it reads the
    tokenizer alone and says what the first run's build costs."""
    from quaero import cli

    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path / "cache"))
    assert cli.main(["check", "envs/toolbench.toml", "--set", 'model.name="qwen3-1.7b-shape"',
                     "--set", f'run.output_dir="{tmp_path / "runs"}"']) == 0
    out = capsys.readouterr().out
    assert ("qwen3-1.7b-shape is not built yet: the first run builds it once into "
            f"{tmp_path / 'cache' / 'models' / 'qwen3-1.7b-shape-v1'} (1,721M parameters, 3.44 GB on disk in "
            "bfloat16, about 10.3 GB of memory while it builds") in out
    assert not (tmp_path / "cache" / "models").exists()


@pytest.mark.hostile
def test_a_named_models_first_build_is_announced_with_its_size_before_it_starts(tmp_path, monkeypatch):
    import structlog

    from quaero.models import cache as model

    monkeypatch.setenv("QUAERO_CACHE", str(tmp_path))
    monkeypatch.setattr(model, "materialize_folder", lambda folder, build: folder)  # no build here
    with structlog.testing.capture_logs() as logs:
        model.materialize_named("qwen3-0.6b-shape")
    (line,) = [e for e in logs if e["event"] == "model_build"]
    assert line["params"] == 596_049_920 and line["disk_gb"] == 1.19 and line["dtype"] == "bfloat16"
    assert line["folder"] == str(tmp_path / "models" / "qwen3-0.6b-shape-v1")
