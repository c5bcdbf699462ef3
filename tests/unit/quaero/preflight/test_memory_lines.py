"""`quaero check`'s memory lines: the plan of a config on a device, the sampler's share beside the step, and
the one line that says a step does not fit and which knob would make it."""

from dataclasses import replace
from pathlib import Path

from quaero.config import load_config
from quaero.models.load import config_fields
from quaero.models.qwen3 import NAMED_SHAPES
from quaero.preflight import memory_lines as ml
from quaero.preflight import memory_plan as mp

ROOT = Path(__file__).resolve().parents[4]
TOOLBENCH = ROOT / "envs" / "toolbench.toml"  # the main job
GIB = 2**30


def dims(name: str, **kw) -> mp.ModelDims:
    return mp.ModelDims.from_fields({**NAMED_SHAPES[name].config_fields(), **kw})


def test_an_oversized_plan_says_so_in_one_line_naming_the_knob_that_fits():
    d = dims("qwen3-0.6b-shape")
    step = mp.StepShape(tokens=8192, targets=64, target_span=2048, selective=False)
    p = mp.plan(d, step)
    lines = ml.plan_lines(p, capacity=24 * GIB, capacity_source="RAM available", row_note="")
    assert p.peak > 24 * GIB
    last = lines[-1]
    assert last.startswith("memory plan exceeds the device: peak ") and "24.00 GiB RAM available" in last
    # full logits off first (the chunked selective head), yet activations still overflow: checkpointing fits
    assert mp.plan(d, replace(step, selective=True, chunk_size=256)).peak > 24 * GIB
    assert "set backend.gradient_checkpointing = true" in last
    fits = ml.plan_lines(
        mp.plan(d, replace(step, tokens=512, target_span=128)),
        capacity=24 * GIB,
        capacity_source="RAM available",
        row_note="",
    )
    assert not any("exceeds" in line for line in fits)
    nothing = ml.plan_lines(p, capacity=1 * GIB, capacity_source="on cuda", row_note="")
    assert "no single knob makes it fit" in nothing[-1]


def test_the_sampler_s_share_of_the_device_is_counted_beside_the_step(monkeypatch):
    # was: the plan said 19.34 GiB of 22.49 available for the 0.6B shape at 4 x 8 episodes, and the run with
    # vLLM in process was killed at 23.13 GiB RSS (the engine's weights, KV cache and runtime not counted)
    d = dims("qwen3-0.6b-shape")
    toml = ROOT / "envs" / "toolbench.toml"

    def share(*sets, device="cpu", capacity=24 * GIB):
        cfg = load_config(toml, ["model.name='qwen3-0.6b-shape'", "model.dtype='bfloat16'", *sets])
        return ml.sampler_share(cfg, device, d, capacity)

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    engine = d.params() * 2 + 2 * GIB + ml.VLLM_CPU_RUNTIME
    assert share("sampler.backend='vllm'").bytes == engine
    assert share("sampler.backend='vllm'", "sampler.mode='server'", "sampler.servers=2").bytes == 2 * engine
    remote = share("sampler.backend='vllm'", "sampler.mode='server'", "sampler.urls=['http://h:8000']")
    assert remote.bytes == 0
    # hf shares the trainer's weights and keeps its KV reuse store (was: 0, the store not counted)
    assert share("sampler.backend='hf'").bytes == 512 * 2**20
    assert share("sampler.backend='hf'", "sampler.hf_kv_cache_mib=0").bytes == 0
    on_gpu = share("sampler.backend='vllm'", "sampler.gpu_memory_utilization=0.3", device="cuda:0",
                   capacity=100 * GIB)
    assert on_gpu.bytes == int(0.3 * 100 * GIB) and "gpu_memory_utilization 0.3" in on_gpu.how
    elsewhere = share("sampler.backend='vllm'", "sampler.mode='server'", "sampler.server_devices=[1]",
                      device="cuda:0", capacity=100 * GIB)
    assert elsewhere.bytes == 0

    step = mp.StepShape(tokens=8192, targets=8192, target_span=8192, dtype="bfloat16", rows=2)
    p = mp.plan(d, step)
    room = p.peak + GIB  # the step alone fits; with the engine beside it, it does not
    alone = ml.plan_lines(p, capacity=room, capacity_source="RAM available", row_note="")
    assert not any("exceeds" in line for line in alone)
    lines = ml.plan_lines(p, capacity=room, capacity_source="RAM available", row_note="",
                          sampler=ml.SamplerShare(engine, "vLLM in process"))
    assert f"  sampler {ml.gib(engine)} beside the step (vLLM in process)" in lines
    assert lines[-1].startswith(f"memory plan exceeds the device: peak {ml.gib(p.peak)} + sampler "
                                f"{ml.gib(engine)} > ")
    assert "set backend.gradient_checkpointing = true" in lines[-1]


def test_check_prints_the_plan_for_the_configured_model():
    cfg = load_config(
        ROOT / "envs" / "toolbench.toml", ["model.name='qwen3-0.6b-shape'", "model.max_seq_len=8192"]
    )
    lines = ml.memory_lines(cfg, "cpu")
    assert lines[0].startswith(
        "memory plan 0.596B params (tied embeddings), float32, cpu; microbatch 8192 tokens"
    )
    assert any(line.startswith("  LM head") and "full logits [8192, 151936]" in line for line in lines)
    kl = ml.memory_lines(load_config(ROOT / "envs" / "toolbench.toml",
                                     ["model.name='qwen3-0.6b-shape'", "loss.beta=0.04"]), "cpu")
    assert ", KL reference 2.22 GiB (a frozen copy)" in kl[1]
    lora = ml.memory_lines(load_config(ROOT / "envs" / "toolbench.toml", [
        "model.name='qwen3-0.6b-shape'", "loss.beta=0.04", "backend.lora=true"]), "cpu")
    assert "KL reference: the base, adapter disabled (no copy)" in lora[1]
    unknown = load_config(ROOT / "envs" / "toolbench.toml", ["model.name='Qwen/Not-Cached-0B'"])
    assert ml.memory_lines(unknown, "cpu")[0].startswith(
        "memory plan none: 'Qwen/Not-Cached-0B' has no config.json"
    )


def tree_plans(*overrides: str) -> tuple[mp.ModelDims, tuple, tuple]:
    """The main job's (dims, (step, tree estimate) with `train_tree_packing` off, the same with it on)."""
    cfgs = [load_config(TOOLBENCH, [*overrides, f"backend.options.train_tree_packing={m!r}"])
            for m in ("off", "on")]
    fields = config_fields(cfgs[0].model.name)
    off, on = (ml.step_shape(cfg, "cpu", fields) for cfg in cfgs)
    return mp.ModelDims.from_fields(fields), off[::2], on[::2]


def test_tree_packing_plans_the_backbone_over_the_tries_unique_tokens():
    d, (off_step, none), (on_step, tree) = tree_plans()
    assert none is None and off_step.unique_tokens == 0
    # the microbatch's rows are one group's: its prompt once, the rest of each row alone
    assert tree.rows < tree.group and tree.unique == tree.prompt + tree.rows * (tree.row - tree.prompt)
    assert on_step.unique_tokens == tree.unique < on_step.tokens == off_step.tokens
    off, on = mp.plan(d, off_step), mp.plan(d, on_step)
    # the plan's own figure per backbone token (every layer's saved bytes and the final norm's), read off the
    # unpacked plan; packed, the trie's tokens take it, and the rows' [B, L, H] hidden states gathered back
    # from the trie and its [N, N] boolean ancestor mask come beside
    per_token, b = off.activations // off_step.tokens, 4
    assert off.activations == per_token * off_step.tokens
    gathered = off_step.tokens * d.hidden * b + tree.unique**2
    saved = per_token * (off_step.tokens - tree.unique) - gathered
    assert saved > 0 and off.activations - on.activations == saved
    assert on.peak == off.peak - saved  # forward+backward is the main job's peak, not the update
    assert (on.activations_exact, on.lm_head, on.weights) == (off.activations_exact, off.lm_head, off.weights)


def test_a_packed_microbatch_holds_the_rows_whose_trie_fits_the_budget():
    """At the 0.6B width, one-turn rows of a 1,000-token prompt and a 100-token reply at a 4,096-token budget:
    padded, 3 rows to
    a microbatch; packing's planner (trainers/batch.py) costs the trie, so the plan's microbatch holds the 16
    rows of 2 groups (3,600 unique tokens, the gathered hidden states and the mask within the budget) and
    says so; the backbone is planned over those unique tokens, the LM head over the 16 rows' tokens."""
    from types import SimpleNamespace

    from trainers.tree import packed_cost

    shape = ["model.name='qwen3-0.6b-shape'", "env.max_turns=1", "env.max_observation_tokens=1000",
             "sampler.max_tokens=100", "backend.micro_batch_tokens=4096"]
    d, (off_step, _), (on_step, tree) = tree_plans(*shape)
    assert (off_step.rows, tree.padded_rows, tree.rows, tree.group) == (3, 3, 16, 8)
    assert on_step.rows == 16 and on_step.tokens == 16 * 1100 and on_step.unique_tokens == tree.unique == 3600
    fields = SimpleNamespace(**config_fields("qwen3-0.6b-shape"))
    assert packed_cost(3600, (16, 1100), fields) <= 4096 < packed_cost(3000 + 1700, (17, 1100), fields)
    line = tree.line()
    assert "3,600/17,600 = 0.20 (16 row(s) of 1100 from 2 group(s) of 8" in line
    assert line.endswith("; planned on the trie's tokens, 16 row(s) to a microbatch where padded rows fit 3")
    # the packed microbatch's activations stay within what the budget's tokens hold unpacked
    off, on = mp.plan(d, off_step), mp.plan(d, on_step)
    per_token = off.activations // off_step.tokens
    assert per_token * 3600 < on.activations < per_token * 4096


def test_check_prints_the_expected_ratio_and_what_auto_decides():
    cfg = load_config(TOOLBENCH, ["backend.options.train_tree_packing='on'"])
    lines = ml.memory_lines(cfg, "cpu")
    assert lines[1].startswith("  tree packing 'on': expected unique/row tokens 6,144/8,192 = 0.75 (2 row(s) "
                               "of 4096 from 1 group(s) of 8, a group sharing its prompt of <= 2048 tokens")
    assert "tree packing: backbone over 6144 unique tokens" in lines[3]
    assert not any("tree packing" in line for line in ml.memory_lines(load_config(TOOLBENCH), "cpu"))
    # auto packs where trainers/tree.py's tree_pays says the trie's FLOPs pay: one-turn rows of a mostly
    # shared prompt at the 0.6B width pay, the main job's longest rows (the trie's N^2 attention) do not
    short = ["model.name='qwen3-0.6b-shape'", "env.max_turns=1", "env.max_observation_tokens=400",
             "backend.options.train_tree_packing='auto'"]
    for overrides, pays in ((short, True), (short[-1:], False)):
        cfg = load_config(TOOLBENCH, overrides)
        step, _, tree = ml.step_shape(cfg, "cpu", config_fields(cfg.model.name))
        assert tree.pays is pays and step.unique_tokens == (tree.unique if pays else 0)
        line = next(line for line in ml.memory_lines(cfg, "cpu") if line.startswith("  tree packing 'auto'"))
        assert ("auto packs at this shape" in line) is pays
        assert line.endswith("; activations planned on the rows") is not pays


def test_a_cpu_plan_says_the_rss_a_run_should_reach_and_counts_the_baseline_against_the_host():
    # was: "peak 0.94 GiB" for the main job whose process held 1.3 GiB in SFT with the hf sampler and 3.2-4.1
    # GiB with vLLM in process; the runtime (Python, torch, transformers, quaero) was nowhere in the plan
    cfg = load_config(TOOLBENCH, ["sampler.backend='hf'"])
    lines = ml.memory_lines(cfg, "cpu")
    parts = ml.expected_rss(cfg, "cpu")
    assert parts["baseline"] == ml.PROCESS_BASELINE_CPU and parts["sampler"] == 512 * 2**20
    assert parts["process"] == parts["peak"] + parts["sampler"] + parts["baseline"]
    assert f"  process {ml.gib(parts['process'])} expected RSS: peak + sampler + baseline 0.50 GiB" in (
        "\n".join(lines))
    assert ml.process_baseline("cuda:0") == 0  # an accelerator's plan is its own memory, not the host's
    d = dims("qwen3-0.6b-shape")
    p = mp.plan(d, mp.StepShape(tokens=512, targets=512, target_span=512, rows=1))
    room = p.peak + GIB // 4  # the step fits; with the process's baseline beside it on the host, it does not
    assert not any("exceeds" in line for line in ml.plan_lines(p, capacity=room, capacity_source="RAM",
                                                                  row_note=""))
    over = ml.plan_lines(p, capacity=room, capacity_source="RAM", row_note="", baseline=GIB // 2)
    assert over[-1].startswith(f"memory plan exceeds the device: peak {ml.gib(p.peak)} + process baseline "
                               "0.50 GiB > ")
