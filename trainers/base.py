"""The trainer: a causal LM, its optimizer and scheduler, and the code every trainer shares.

`Trainer` implements everything but model loading: the strict shared-forward step (trainers/step.py),
audit log-probs, weight export for the sampler (LoRA merged) and checkpoint state. `local` and
`unsloth` differ only in `_load_model`. A trainer reads a `TrainerSpec` (trainers/spec.py), never the
app config. Capabilities are declared in trainers/registry.py and enforced here at run time: the step
counts backbone forwards per microbatch and raises `SharedForwardError` unless it is exactly one.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quaero import process_group
from quaero.rows import EchoRow
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger
from trainers import distributed, memory, mini_steps, registry, step
from trainers.forward import CausalLMParts, SharedForwardError  # noqa: F401 (re-exported)
from trainers.reference import Reference
from trainers.spec import TrainerSpec

log = get_logger(__name__)


def reset_optimizer_state(optimizer: torch.optim.Optimizer, *, momentum_only: bool = False) -> None:
    """How RL starts after the warm start (`[training] rl_optimizer_start`), on any torch AdamW: forget its
    state ("reset": moments and step counts), or with `momentum_only` zero the first moments and keep the
    second moments and step counts ("reset_momentum"). `Trainer.reset_optimizer` is this on the trainer's
    optimizer; `quaero bench peers-trl` applies it to TRL's AdamW too."""
    if not momentum_only:
        optimizer.state.clear()
        return
    for state in optimizer.state.values():
        if "exp_avg" in state:
            state["exp_avg"].zero_()


class Trainer:
    """Shared trainer: subclasses set `name` (their registry key) and implement `_load_model() ->
    nn.Module`."""

    name = "base"

    def __init__(self, spec: TrainerSpec, device: str) -> None:
        self.spec = spec
        self.capabilities = registry.TRAINERS[self.name]
        if torch.device(device).type not in self.capabilities.devices:
            raise ValueError(f"[backend] backend={self.name!r} runs on {self.capabilities.devices}, not "
                             f"{device!r}")
        self.device = process_group.setup(spec.distributed, torch.device(device))
        # before the model loads: freed CPU tensors go back to the system or stay (trainers/memory.py)
        mmap_threshold = memory.fix_cpu_mmap_threshold(self.device, spec.memory.cpu_mmap_threshold)
        malloc_cache = memory.keep_cpu_malloc_cache(self.device, spec.memory.cpu_malloc_cache)
        torch.manual_seed(spec.seed)
        self.model = self._load_model()
        self.model.config.use_cache = False
        self.parts = CausalLMParts(self.model, spec.model)
        if spec.selective_logits:
            self.parts.verify_transform()  # on the whole model, before any sharding
        # every step's forward goes through this module (wrapped for DDP or FSDP2 under torchrun);
        # `self.model` stays the causal LM itself (under FSDP2 its parameters become shards)
        layers = list(getattr(self.parts.backbone, "layers", []))
        self.microbatch_forward = distributed.wrap_model(step.MicrobatchForward(self.parts, spec),
                                                         spec.distributed, self.device, layers)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=spec.lr, betas=spec.betas,
                                           weight_decay=spec.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda _: 1.0)  # constant lr
        self.steps_done = 0
        self.reference: Reference | None = None  # the KL penalty's, once taken (`take_reference`)
        log.info(names.TRAINER_READY_EVENT, trainer=self.name, model=spec.model, device=str(self.device),
                 distributed=spec.distributed, rank=process_group.rank(), ranks=process_group.world_size(),
                 dtype=spec.dtype, lora=spec.lora, trainable_params=sum(p.numel() for p in self.trainable),
                 selective=spec.selective_logits, logit_transform=str(self.parts.transform),
                 cpu_mmap_threshold=mmap_threshold, cpu_malloc_cache=malloc_cache)

    def _load_model(self) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def is_lora(self) -> bool:
        return hasattr(self.model, "peft_config")

    def take_reference(self) -> None:
        """Freeze the KL penalty's reference (`[loss] beta` > 0; trainers/reference.py) from the weights
        now: a copy of them, or with LoRA the base model (the adapter disabled). Once per run: the recipe
        calls it at the first RL step; a resumed run restores the one it took."""
        if self.spec.beta <= 0 or self.reference is not None:
            return
        if self.sharded:
            raise ValueError("[loss] beta > 0 under FSDP2 without LoRA: a sharded model has no reference "
                             "copy yet; use [backend] lora = true (the base is the reference) or ddp")
        if self.is_lora:
            self.reference = Reference(self.parts, self.parts_forward(self.parts), self.model.disable_adapter)
        else:
            parts = CausalLMParts(Reference.frozen_copy(self.model), f"{self.spec.model} (reference)")
            self.reference = Reference(parts, self.parts_forward(parts))

    def parts_forward(self, parts: CausalLMParts) -> step.MicrobatchForward:
        """The step's selective log-prob forward over `parts` (unwrapped: the reference's never trains)."""
        return step.MicrobatchForward(parts, self.spec)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following steps (the recipe's phases use different ones)."""
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)

    def reset_optimizer(self, *, momentum_only: bool = False) -> None:
        """Forget the optimizer's moments (AdamW's step counts restart too): the next step starts afresh. With
        `momentum_only`, zero the first moment and keep the second and the step counts."""
        reset_optimizer_state(self.optimizer, momentum_only=momentum_only)

    def train_step(self, rows: list[EchoRow], *, sft: bool = False, echo_weight: float | None = None
                   ) -> dict[str, Any]:
        """One rollout batch's optimizer steps over all rows (one, unless `steps_per_generation` or
        `num_iterations` ask for more: trainers/mini_steps.py; `echo_weight`: this step's λ, else the
        spec's); see trainers/step.py for the losses and metrics."""
        metrics = mini_steps.rollout_batch_step(self, rows, sft=sft, echo_weight=echo_weight)
        self.steps_done += 1
        return metrics

    @torch.no_grad()
    def logprobs(self, rows: list[EchoRow], *, temperature: float | None = None) -> list[list[float]]:
        """Per-token target log-probs (length L; targets = action and ECHO tokens; 0 elsewhere), at
        `temperature` (default: the sampler's, the one an RL step scores at)."""
        return step.audit_logprobs(self, rows, self.spec.temperature if temperature is None else temperature)

    @torch.no_grad()
    def export_weights(self) -> dict[str, torch.Tensor]:
        """The full model state for a sampler, LoRA deltas merged (the live model is not modified).

        Tensors alias the live parameters where no merge is needed: consume them before the next step.
        """
        if not self.is_lora:  # under FSDP2 every rank gathers the full tensors (a collective)
            return {k: _full(v).detach() for k, v in self.model.state_dict().items()}
        base = self.model.get_base_model()
        merged = {}
        for name, module in base.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
                w = module.base_layer.weight
                for adapter in module.active_adapters:
                    w = w + module.get_delta_weight(adapter).to(w.dtype)
                merged[f"{name}.weight"] = w.detach()
        out = {}
        for key, value in base.state_dict().items():
            if "lora_" in key:
                continue
            key = key.replace(".base_layer.", ".")
            out[key] = merged.get(key, value.detach())
        return out

    @property
    def sharded(self) -> bool:
        """Parameters and optimizer state are FSDP2 shards: checkpoints hold them through `save_shards`."""
        return self.spec.distributed == "fsdp2" and process_group.world_size() > 1

    def state_dict(self) -> dict:
        """Model (the adapter only, with LoRA) + optimizer + scheduler, for checkpoint/resume.

        A sharded trainer's model and optimizer are not in it (`"shards": "dcp"` says where they are):
        every rank writes its own with `save_shards`."""
        if self.sharded:
            return {"backend": self.name, "lora": self.is_lora, "steps_done": self.steps_done,
                    "shards": "dcp",
                    "scheduler": self.scheduler.state_dict()}
        if self.is_lora:
            from peft import get_peft_model_state_dict

            model_state = get_peft_model_state_dict(self.model)
        else:
            model_state = self.model.state_dict()
        return {"backend": self.name, "lora": self.is_lora, "steps_done": self.steps_done,
                "model": {k: v.detach().cpu().clone() for k, v in model_state.items()},
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                **({} if self.reference is None else {"reference": self.reference.state_dict()})}

    def _dcp_state(self) -> dict:
        """Model and optimizer state keyed by parameter name, as torch.distributed.checkpoint saves and loads
        them: DTensor shards under FSDP2, whole tensors in one process (so one process reads any shards)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.microbatch_forward, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def save_shards(self, folder) -> None:
        """Every rank writes its shards of the model and optimizer into `folder` (a collective)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self._dcp_state(), checkpoint_id=str(folder), no_dist=process_group.world_size() == 1)

    def _load_shards(self, folder) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from trainers.shard_reader import SafeLoadPlanner, SafeShardReader

        state = self._dcp_state()  # the layout to read into: this trainer's (any number of ranks)
        # DCP's default reader unpickles: a crafted shards/ folder would run code (trainers/shard_reader.py)
        reader = SafeShardReader(folder)
        reader.read_metadata()  # a refused or missing metadata file fails here, as itself
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                     no_dist=process_group.world_size() == 1)
        except dcp.CheckpointException as e:  # a BaseException: make it an error callers catch
            raise ValueError(f"shards in {folder} cannot be read: {e}") from None
        set_state_dict(self.microbatch_forward, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def load_state_dict(self, state: dict, shards=None) -> None:
        """`state` from `state_dict()`; `shards`: the folder `save_shards` wrote, for a sharded checkpoint."""
        if state.get("lora", False) != self.is_lora:
            raise ValueError(f"checkpoint lora={state.get('lora')} but this trainer has lora={self.is_lora}; "
                             "resume with the [backend] lora setting the run was started with")
        if state.get("shards") == "dcp":
            if shards is None:
                raise ValueError("a sharded checkpoint's model and optimizer are in its shards/ folder: pass "
                                 "it")
            self._load_shards(shards)
            self.scheduler.load_state_dict(state["scheduler"])
            self.steps_done = state.get("steps_done", 0)
            return
        if self.is_lora:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = state.get("steps_done", 0)
        self._load_reference(state.get("reference"))

    def _load_reference(self, saved: dict | None) -> None:
        """The reference a checkpoint holds (none: not taken yet, and the recipe takes it at the first RL
        step)."""
        self.reference = None
        if saved is None or self.spec.beta <= 0:
            return
        if saved.get("kind") != ("lora_base" if self.is_lora else "copy"):
            raise ValueError(f"the checkpoint's KL reference is a {saved.get('kind')!r} but this trainer has "
                             f"lora={self.is_lora}; resume with the [backend] lora setting the run started "
                             "with")
        self.take_reference()  # the base, or a copy of these weights to overwrite with the saved ones
        if not self.is_lora:
            self.reference.parts.model.load_state_dict(saved["model"])


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (gathered from every rank), or `t` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
