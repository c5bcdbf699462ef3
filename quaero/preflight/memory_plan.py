"""The memory plan `quaero check` prints: one train step's memory, by arithmetic from the model's config.

No model loads: the shape comes from the config fields (`quaero.models.load.config_fields`: the named models'
own tables, a local folder's or the hub cache's config.json). For the configured dtype, device and
longest row it adds up what one step of the `local` trainer holds at its peak:

- weights: every parameter, in the configured dtype (`auto`: the folder's); with the KL penalty (`[loss]
  beta` > 0) the frozen reference's copy of them too (trainers/reference.py), none with LoRA (its reference is
  the base with the adapter disabled); its no-grad forward runs before the step and holds no more than it;
- gradients and AdamW state: the trainable parameters (LoRA: the adapters), torch's AdamW keeping m and v
  in the parameter's dtype (fp32 m+v for a float32 model);
- activations: what autograd saves for backward, per token per decoder layer (`SAVED_PER_TOKEN`: the
  elements a Qwen3/Llama-style layer saves in training, counted from the layer's ops and checked against
  measured steps in benchmarks/README.md, `quaero bench real-shape`; the RMSNorms' inputs at float32's 4 bytes
  in any dtype, as transformers' RMSNorm upcasts them); with `gradient_checkpointing` one
  layer's input per layer plus one layer recomputed; `train_save_on_cpu` moves them to host memory (CUDA
  only: on a CPU device it is a no-op); `train_supervised_context_tokens` shortens the row the backbone
  runs over; with tree packing (`train_tree_packing`, trainers/tree.py) the backbone runs over the trie's
  unique tokens instead of the rows' (`StepShape.unique_tokens`), plus what the packed forward adds: the
  rows' `[B, L, H]` hidden states gathered back from the trie and its `[N, N]` ancestor mask (SDPA's
  boolean, a byte an entry);
- the LM head: full logits `[tokens, vocab]` (their fp32 log-softmax beside them) against the
  selective path's `[targets, vocab]`, chunked to `train_logprob_chunk_size` rows (or to
  trainers/selective.py's automatic chunk above `hidden_max_bytes`).

The step's peak is the resident state (weights + AdamW state) plus the larger of (activations + LM head +
the LM head's weight gradient, which backward makes first) and the optimizer update: the whole gradient
plus AdamW's temporaries (`OPTIMIZER_TEMPORARIES` of them). torch's AdamW runs per tensor on a CPU (its
temporaries are the largest parameter's size: the embedding) and with foreach kernels on CUDA (trainable-
sized sets; not yet measured here). At short rows the update is the step's peak. When it exceeds the
device (CPU: available RAM; CUDA: the device's memory), less what the sampler takes from it
(`sampler_share`: vLLM's engine beside the trainer), the plan names the first knob, in `KNOBS` order, that
would make it fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# elements saved per token per layer: a*hidden + b*intermediate + c*(heads*head_dim) + d*(kv_heads*head_dim)
# (two RMSNorms' inputs and outputs, q/k/v projections and their QK-norms, SDPA's inputs and output, the
# o_proj input, the gated MLP's gate, up, act(gate) and product)
SAVED_PER_TOKEN = {"hidden": 4, "intermediate": 4, "q": 5, "kv": 4}
# of those, what Qwen3's QK-norms add (their inputs and outputs): a layout without them (Llama,
# Mistral, Qwen2) saves these fewer (measured on one Llama layer at SmolLM2-135M's width: float32 42,796
# bytes a token, the plan 44,544; bfloat16 24,876 and 24,576; tests/unit/quaero/preflight/test_memory_plan.py)
QK_NORM_SAVED = {"q": 1, "kv": 2}
# full logits' backward: log_softmax's saved fp32 output, the gradient gather hands it and the one it gives
FULL_HEAD_BACKWARD_BYTES = 3 * 4
OPTIMIZER_TEMPORARIES = 2  # tensors torch.optim.AdamW allocates inside step(): per parameter (CPU) or per set
# the knobs, tried in this order for the one line that says what would make an oversized plan fit
KNOBS = (
    "backend.options.train_logprob_chunk_size",
    "backend.gradient_checkpointing",
    "backend.options.train_save_on_cpu",
    "backend.lora",
    "model.dtype",
)


@dataclass(frozen=True)
class ModelDims:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qk_norm: bool
    qkv_bias: bool
    dtype: str  # the folder's stored dtype (what dtype='auto' loads)

    @classmethod
    def from_fields(cls, f: dict) -> ModelDims:
        heads = f["num_attention_heads"]
        head_dim = f.get("head_dim") or f["hidden_size"] // heads
        mt = f.get("model_type", "")
        return cls(
            vocab=f["vocab_size"],
            hidden=f["hidden_size"],
            layers=f["num_hidden_layers"],
            heads=heads,
            kv_heads=f.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate=f["intermediate_size"],
            tied=bool(f.get("tie_word_embeddings", False)),
            qk_norm=mt == "qwen3",
            qkv_bias=mt == "qwen2" or bool(f.get("attention_bias", False)),
            dtype=str(f.get("dtype") or f.get("torch_dtype") or "float32"),
        )

    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h + (2 * self.head_dim if self.qk_norm else 0)

    def params(self) -> int:
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def lora_params(self, r: int) -> int:
        """LoRA on every linear layer of the decoder ("all-linear", not the LM head): r x (in + out) each."""
        h, q, kv, i = (
            self.hidden,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
            self.intermediate,
        )
        return self.layers * r * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 3)

    def largest_lora(self, r: int) -> int:
        """Elements of the largest LoRA tensor (an MLP projection's A or B)."""
        return r * max(self.hidden, self.intermediate, self.heads * self.head_dim)

    def norm_inputs_per_token(self) -> int:
        """Elements per token per layer that the RMSNorms save as float32 whatever the model's dtype
        (transformers' RMSNorm upcasts its input first): the two around attention and MLP, and Qwen3's
        q/k norms."""
        qk = self.heads * self.head_dim + self.kv_heads * self.head_dim if self.qk_norm else 0
        return 2 * self.hidden + qk

    def saved_bytes_per_token(self, b: int) -> int:
        """Bytes one decoder layer saves for backward per token, at `b` bytes an element: SAVED_PER_TOKEN's
        elements, the norms' inputs among them at float32's 4 bytes (in a 16-bit model, an extra 2 bytes each;
        measured on one Qwen3 layer at the 0.6B width: 72,360 bytes a token in bf16; this gives 71,680)."""
        return self.saved_per_token() * b + max(0, 4 - b) * self.norm_inputs_per_token()

    def lora_saved_bytes_per_token(self, b: int, r: int) -> int:
        """`saved_bytes_per_token` with LoRA on every linear layer (PEFT keeps the adapters in float32): the
        frozen norms no longer save their normalized values, each adapter's A saves its r outputs; in a 16-bit
        model each adapted layer saves its own float32 copy of its input (q, k, v, gate and up read the
        hidden state, o the attention output, down the MLP product) where the frozen layers saved none, and
        the query is saved once more (seen in autograd's count, not traced). Against one Qwen3 layer at the
        0.6B width, r 16: float32 99,944 bytes a token (this gives 99,944), bfloat16 93,288 (92,608)."""
        q, i = self.heads * self.head_dim, self.intermediate
        saved = self.saved_bytes_per_token(b) - b * self.norm_inputs_per_token() + 4 * 7 * r
        if b < 4:
            saved += 4 * (5 * self.hidden + q + i) - b * (2 * self.hidden + q + i) + b * q
        return saved

    def saved_per_token(self) -> int:
        """Elements one decoder layer saves for backward per token (see SAVED_PER_TOKEN)."""
        c, qk = SAVED_PER_TOKEN, (0 if self.qk_norm else 1)
        return (
            c["hidden"] * self.hidden
            + c["intermediate"] * self.intermediate
            + (c["q"] - qk * QK_NORM_SAVED["q"]) * self.heads * self.head_dim
            + (c["kv"] - qk * QK_NORM_SAVED["kv"]) * self.kv_heads * self.head_dim
        )


@dataclass(frozen=True)
class StepShape:
    """What one microbatch holds: tokens the backbone runs over, LM-head targets, and the knobs."""

    tokens: int
    targets: int
    target_span: int  # per row, tokens from its first target to its end (a crop keeps them and K), summed
    dtype: str = "float32"
    lora: bool = False
    lora_r: int = 16
    gradient_checkpointing: bool = False
    selective: bool = True
    chunk_size: int | None = None
    hidden_max_bytes: int = 128 * 2**20
    auto_chunk_rows: int = 256
    save_on_cpu: bool = False
    context_tokens: int = 0
    device: str = "cpu"
    rows: int = 1  # rows in the microbatch: a context crop keeps K tokens before each row's first target
    reference: bool = False  # the KL penalty's reference ([loss] beta > 0): a frozen copy unless LoRA
    unique_tokens: int = 0  # tree packing: the trie's tokens the backbone runs over (0: the rows, unpacked)


@dataclass(frozen=True)
class MemoryPlan:
    dims: ModelDims
    step: StepShape
    weights: int
    gradients: int
    optimizer: int
    activations: int  # on the device, with the configured knobs
    activations_exact: int  # full context, no checkpointing, nothing offloaded
    host_activations: int  # what train_save_on_cpu moves to host memory
    lm_head: int  # the configured LM-head path
    lm_head_full: int
    lm_head_selective: int
    head_grad: int
    head_peak: int = 0  # the LM head's part of forward + backward's peak (`plan`)
    tied_extra: int = 0
    largest: int = 0  # bytes of the largest trainable tensor (the per-tensor AdamW's temporaries)
    reference_weights: int = 0  # the KL penalty's frozen copy of the weights (none with LoRA)

    @property
    def update(self) -> int:
        """The optimizer step's transient: gradients plus AdamW's temporaries (per tensor on a CPU, foreach on
        CUDA)."""
        each = self.gradients if self.step.device.startswith("cuda") else self.largest
        return self.gradients + OPTIMIZER_TEMPORARIES * each

    @property
    def fwd_bwd(self) -> int:
        """Forward + backward's transient: activations and the LM head's peak (`plan`), or at backward's end
        the gradients (a tied embedding's two gradients and their sum, two more V x H)."""
        return max(self.activations + self.head_peak, self.gradients + self.tied_extra)

    @property
    def peak(self) -> int:
        return self.weights + self.reference_weights + self.optimizer + max(self.fwd_bwd, self.update)


def _bytes(dtype: str, dims: ModelDims) -> int:
    return DTYPE_BYTES.get(dims.dtype if dtype == "auto" else dtype, 4)


def plan(dims: ModelDims, step: StepShape) -> MemoryPlan:
    b = _bytes(step.dtype, dims)
    params = dims.params()
    trainable = dims.lora_params(step.lora_r) if step.lora else params
    tokens = step.tokens
    if step.context_tokens:
        tokens = min(tokens, step.rows * step.context_tokens + step.target_span)
    # LoRA adapters are float32 whatever the model's dtype (PEFT's autocast_adapter_dtype): their weights,
    # their gradients and AdamW's m and v (measured at the 0.6B shape in bfloat16: benchmarks/README.md)
    tb = 4 if step.lora else b
    saved = dims.lora_saved_bytes_per_token(b, step.lora_r) if step.lora else dims.saved_bytes_per_token(b)
    run = backbone_tokens(step, tokens)  # the trie's where packed; the LM head reads the rows' `tokens`
    per_layer = saved * run
    final_norm = 2 * dims.hidden * b + max(0, 4 - b) * dims.hidden  # its input (as float32) and output
    exact = (saved * dims.layers + final_norm) * step.tokens
    if step.gradient_checkpointing:  # each layer's input kept, one layer recomputed at a time in backward
        acts = dims.hidden * b * run * dims.layers + per_layer
    else:
        acts = per_layer * dims.layers
    acts += final_norm * run
    host = 0
    if step.save_on_cpu and step.device.startswith("cuda"):
        host, acts = acts, 0
    acts += tree_extra(dims, step, b, tokens)
    # LM head: the selective path's [targets, V] logits in the model dtype, their fp32 log-softmax (saved by
    # the cross entropy) and its gradient, then the head's weight gradient. The full path's [tokens, V]:
    # forward holds the logits, their float32 copy (a 16-bit model's: `.float()` of float32 logits is no
    # copy) and the fp32 log-softmax (10 bytes an entry in bfloat16, 8 in float32); backward's log-softmax
    # holds its saved output, the dense gradient the gather hands it and the one it gives, 12 bytes an entry
    # in either dtype, more than forward's; the head's weight gradient comes after those are freed, beside the
    # logits' gradient in the model dtype (trainers/selective.py full_logprobs; measured at the 0.6B width
    # from 1,024 to 8,192 tokens: benchmarks/README.md, "Fifth pass")
    per_row = dims.vocab * (b + 4 + 4)
    full = tokens * dims.vocab * FULL_HEAD_BACKWARD_BYTES
    rows = step.targets
    if step.chunk_size or step.targets * dims.vocab * 4 > step.hidden_max_bytes:
        rows = min(step.targets, step.chunk_size or step.auto_chunk_rows)
    selective = rows * per_row
    head_grad = dims.vocab * dims.hidden * b if not step.lora else 0
    head_peak = (selective + head_grad if step.selective
                 else max(full, tokens * dims.vocab * b + head_grad))
    return MemoryPlan(
        dims,
        step,
        weights=params * b + (trainable * tb if step.lora else 0),
        gradients=trainable * tb,
        optimizer=2 * trainable * tb,
        activations=acts,
        activations_exact=exact,
        host_activations=host,
        lm_head=selective if step.selective else full,
        lm_head_full=full,
        lm_head_selective=selective,
        head_grad=head_grad,
        head_peak=head_peak,
        tied_extra=2 * head_grad if dims.tied else 0,
        largest=(dims.largest_lora(step.lora_r) if step.lora else dims.vocab * dims.hidden) * tb,
        reference_weights=params * b if step.reference and not step.lora else 0,
    )


def backbone_tokens(step: StepShape, rows_tokens: int) -> int:
    """Tokens the backbone runs over: the rows' (after a context crop), or the trie's where tree packing is on
    (at most the rows': a crop leaves less to share)."""
    return min(rows_tokens, step.unique_tokens) if step.unique_tokens else rows_tokens


def tree_extra(dims: ModelDims, step: StepShape, b: int, rows_tokens: int) -> int:
    """What a packed forward holds beside the trie's activations (trainers/forward.py `hidden_states`): the
    rows' `[B, L, H]` hidden states gathered back from the trie (`TreePack.unpack`, the view the LM head
    reads) and the `[1, 1, N, N]` boolean ancestor mask (`TreePack.mask`); none unpacked."""
    if not step.unique_tokens:
        return 0
    n = backbone_tokens(step, rows_tokens)
    return rows_tokens * dims.hidden * b + n * n


def fitting_knob(dims: ModelDims, step: StepShape, capacity: int) -> tuple[str, MemoryPlan] | None:
    """The first knob (KNOBS order) that alone brings the plan's peak under `capacity`, and its plan."""
    tries = {
        "backend.options.train_logprob_chunk_size": replace(step, selective=True, chunk_size=256),
        "backend.gradient_checkpointing": replace(step, gradient_checkpointing=True),
        "backend.options.train_save_on_cpu": replace(step, save_on_cpu=True),
        "backend.lora": replace(step, lora=True),
        "model.dtype": replace(step, dtype="bfloat16"),
    }
    current = plan(dims, step)
    for knob in KNOBS:
        trial = tries[knob]
        if trial == step:
            continue
        if knob == "backend.options.train_save_on_cpu" and not step.device.startswith("cuda"):
            continue  # a CPU device has no accelerator memory to offload from
        p = plan(dims, trial)
        if p.peak < current.peak and p.peak <= capacity:
            return knob, p
    return None


KNOB_VALUES = {
    "backend.options.train_logprob_chunk_size": "256",
    "backend.gradient_checkpointing": "true",
    "backend.options.train_save_on_cpu": "true",
    "backend.lora": "true",
    "model.dtype": "'bfloat16'",
}
