"""`quaero check`'s memory plan: arithmetic from the model's config, no model load."""

from dataclasses import replace
from pathlib import Path

import pytest

from quaero.models.qwen3 import NAMED_SHAPES
from quaero.preflight import memory_plan as mp

ROOT = Path(__file__).resolve().parents[4]
GIB = 2**30
V = 151936


def dims(name: str, **kw) -> mp.ModelDims:
    return mp.ModelDims.from_fields({**NAMED_SHAPES[name].config_fields(), **kw})


@pytest.mark.parametrize("name", sorted(NAMED_SHAPES))
def test_parameter_count_is_the_models_own(name):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**NAMED_SHAPES[name].config_fields()))
    assert dims(name).params() == sum(p.numel() for p in model.parameters())


def test_weights_gradients_and_adamw_state_of_the_06b_shape():
    d = dims("qwen3-0.6b-shape")
    assert d.params() == 596_049_920  # what the built folder loads (benchmarks/README.md)
    p = mp.plan(d, mp.StepShape(tokens=512, targets=64, target_span=128))
    assert (p.weights, p.gradients, p.optimizer) == (596_049_920 * 4, 596_049_920 * 4, 2 * 596_049_920 * 4)
    # gradients + AdamW's two temporaries: of the largest tensor (the embedding) per tensor on a CPU, of every
    # parameter with CUDA's foreach kernels
    assert p.update == 596_049_920 * 4 + 2 * V * 1024 * 4
    assert p.peak == p.weights + p.optimizer + p.update  # a short row: the update is the peak
    cuda = mp.plan(d, mp.StepShape(tokens=512, targets=64, target_span=128, device="cuda"))
    assert cuda.update == 3 * 596_049_920 * 4
    half = mp.plan(d, mp.StepShape(tokens=512, targets=64, target_span=128, dtype="bfloat16"))
    assert half.weights * 2 == p.weights and half.optimizer * 2 == p.optimizer
    auto = mp.plan(d, mp.StepShape(tokens=512, targets=64, target_span=128, dtype="auto"))
    assert auto.weights == half.weights  # 'auto' loads the folder's dtype: bfloat16 like the hub's


def test_lm_head_full_against_selective_and_its_chunks():
    d = dims("qwen3-0.6b-shape")
    p = mp.plan(d, mp.StepShape(tokens=8192, targets=64, target_span=2048))
    # backward's log-softmax: its saved fp32 output, the gradient gather gives it and the one it gives, in
    # either dtype more than forward's bf16 logits, their fp32 copy and the fp32 log-softmax (2 + 4 + 4)
    assert p.lm_head_full == 8192 * V * 12
    half = mp.plan(d, mp.StepShape(tokens=8192, targets=64, target_span=2048, dtype="bfloat16"))
    assert half.lm_head_full == 8192 * V * 12
    assert p.lm_head_selective == p.lm_head == 64 * V * 12
    assert p.head_grad == V * 1024 * 4 and p.tied_extra == 2 * V * 1024 * 4
    full = mp.plan(d, mp.StepShape(tokens=8192, targets=64, target_span=2048, selective=False))
    assert full.lm_head == full.lm_head_full
    # the selective head's weight gradient follows its logits; the full head's comes once they are freed
    assert p.head_peak == p.lm_head + p.head_grad and full.head_peak == full.lm_head_full
    assert full.peak - p.peak == full.lm_head_full - p.lm_head - p.head_grad
    short = mp.plan(d, mp.StepShape(tokens=128, targets=64, target_span=128, selective=False))
    assert short.head_peak == 128 * V * 4 + short.head_grad  # fp32 logits' gradient beside the head's
    many = mp.plan(d, mp.StepShape(tokens=8192, targets=4096, target_span=8192))  # 4096 x V x 4 > 128 MiB
    assert many.lm_head_selective == 256 * V * 12  # trainers/selective.py's automatic 256-row chunks
    chunked = mp.plan(d, mp.StepShape(tokens=8192, targets=4096, target_span=8192, chunk_size=64))
    assert chunked.lm_head == 64 * V * 12


def test_each_knob_changes_what_it_changes():
    d = dims("qwen3-0.6b-shape")
    base = mp.StepShape(tokens=8192, targets=64, target_span=2048)
    exact = mp.plan(d, base)
    per_token = d.saved_per_token() * 4
    assert exact.activations == exact.activations_exact == 28 * per_token * 8192 + 2 * 1024 * 4 * 8192
    ckpt = mp.plan(d, replace(base, gradient_checkpointing=True))
    assert ckpt.activations == 28 * 1024 * 4 * 8192 + per_token * 8192 + 2 * 1024 * 4 * 8192
    crop = mp.plan(d, replace(base, context_tokens=1024))  # 1024 + the 2048-token target span
    assert crop.activations == 28 * per_token * 3072 + 2 * 1024 * 4 * 3072
    # two rows of 4096: each keeps its own K tokens before its first target
    crop2 = mp.plan(d, replace(base, context_tokens=1024, rows=2))
    assert crop2.activations == 28 * per_token * (2 * 1024 + 2048) + 2 * 1024 * 4 * (2 * 1024 + 2048)
    # tree packing: the backbone over the trie's 2048 tokens, the rows' [8192, H] hidden states gathered back
    # and the [2048, 2048] boolean ancestor mask beside; checkpointing keeps each layer's input of the trie
    tree = mp.plan(d, replace(base, unique_tokens=2048))
    gathered = 8192 * 1024 * 4 + 2048**2
    assert tree.activations == 28 * per_token * 2048 + 2 * 1024 * 4 * 2048 + gathered
    assert tree.activations_exact == exact.activations_exact and tree.lm_head == exact.lm_head
    tree_ckpt = mp.plan(d, replace(base, unique_tokens=2048, gradient_checkpointing=True))
    assert tree_ckpt.activations == 28 * 1024 * 4 * 2048 + per_token * 2048 + 2 * 1024 * 4 * 2048 + gathered
    cpu = mp.plan(d, replace(base, save_on_cpu=True))
    assert cpu.activations == exact.activations and cpu.host_activations == 0  # no-op on a CPU device
    gpu = mp.plan(d, replace(base, save_on_cpu=True, device="cuda"))
    assert gpu.activations == 0 and gpu.host_activations == exact.activations
    lora = mp.plan(d, replace(base, lora=True, lora_r=16))
    assert lora.gradients == d.lora_params(16) * 4 < exact.gradients / 50
    assert lora.weights == exact.weights + d.lora_params(16) * 4  # the adapters beside the frozen weights
    half = replace(base, dtype="bfloat16")
    half_lora = mp.plan(d, replace(half, lora=True, lora_r=16))  # float32 adapters, gradients, m and v
    assert (half_lora.weights, half_lora.gradients, half_lora.optimizer) == (
        mp.plan(d, half).weights + d.lora_params(16) * 4, d.lora_params(16) * 4, 2 * d.lora_params(16) * 4)


def family_fields(family: str) -> dict:
    """One decoder layer's config fields: Qwen3 at the 0.6B shape's width, Llama at SmolLM2-135M's."""
    from quaero.models.smollm2 import SMOLLM2_135M

    fields = (NAMED_SHAPES["qwen3-0.6b-shape"].config_fields() if family == "qwen3"
              else SMOLLM2_135M.config_fields("float32"))
    return {**fields, "num_hidden_layers": 1}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decoder_layers_saved_bytes_per_token_are_what_autograd_saves(dtype, lora, family):
    """The per-token activation figure against what one real decoder layer saves for backward
    (transformers' own model, one layer, 64 tokens; LoRA r 16 through PEFT as the local trainer applies it):
    in bfloat16 the RMSNorms save their inputs as float32, which a plan counting every element at 2 bytes
    missed by 15%, and LoRA's adapters save float32 copies of their inputs. A Llama layer (no QK-norm) saves
    less than a Qwen3 layer: counted with Qwen3's figures, the plan read it 13-15% high in float32."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = family_fields(family)
    small = {**fields, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    config = AutoConfig.for_model(**{k: v for k, v in small.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tokens, dt = 64, getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config).to(dt)
    if lora:
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                 target_modules="all-linear"))
    inner = model.get_decoder()  # PEFT forwards it to the wrapped model
    layer = inner.layers[0]
    x = torch.randn(1, tokens, config.hidden_size, dtype=dt, requires_grad=True)
    positions = torch.arange(tokens)[None]
    rope = inner.rotary_emb(x, positions)
    skip = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=positions, position_embeddings=rope)
    measured = sum(saved.values()) / tokens
    d, b = mp.ModelDims.from_fields(fields), mp.DTYPE_BYTES[dtype]
    planned = d.lora_saved_bytes_per_token(b, 16) if lora else d.saved_bytes_per_token(b)
    assert abs(planned - measured) / measured < 0.05, (planned, measured)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_full_heads_bytes_an_entry_are_what_its_backward_holds(dtype):
    """The full path (trainers/selective.py full_logprobs over the model's logits), forward and backward under
    torch's allocator count: its peak is the plan's bytes an entry (FULL_HEAD_BACKWARD_BYTES, the
    log-softmax's backward) over [tokens, V], in either dtype. The plan used forward's 8 (float32) / 10
    (bfloat16) and read 8.5% low at 8k tokens."""
    import torch

    from benchmarks.measure import cpu_peak_bytes
    from trainers.selective import full_logprobs

    tokens, vocab, hidden = 512, 4096, 32
    dt = getattr(torch, dtype)
    weight = torch.randn(vocab, hidden, dtype=dt, requires_grad=True)
    states = torch.randn(1, tokens, hidden, dtype=dt, requires_grad=True)
    ids = torch.randint(0, vocab, (1, tokens))
    mask = torch.zeros(1, tokens, dtype=torch.bool)
    mask[0, -64:] = True

    def step():
        full_logprobs(states @ weight.t(), ids, mask).sum().backward()

    _, peak = cpu_peak_bytes(step)
    assert peak / (tokens * vocab) == pytest.approx(mp.FULL_HEAD_BACKWARD_BYTES, rel=0.03)


def test_the_kl_reference_adds_a_copy_of_the_weights_unless_lora():
    """[loss] beta > 0: full fine-tuning holds a frozen copy of every weight (trainers/reference.py), in
    the model's dtype, beside the step; a LoRA run's reference is the base, adapter disabled: nothing more."""
    d = dims("qwen3-0.6b-shape")
    step = mp.StepShape(tokens=512, targets=64, target_span=128, dtype="bfloat16")
    plain, kl = mp.plan(d, step), mp.plan(d, replace(step, reference=True))
    assert kl.reference_weights == 596_049_920 * 2 and plain.reference_weights == 0
    assert kl.peak - plain.peak == kl.reference_weights
    lora = replace(step, lora=True)
    assert mp.plan(d, replace(lora, reference=True)).peak == mp.plan(d, lora).peak
