"""The LM-head/loss regions the LM-head benchmarks share (`quaero bench echo`, `quaero bench crossover`), and
the value check that guards them.

Every region has the trainer's contract: it takes the backbone's hidden states over a whole row
`[1, L, H]`, a plain `nn.Linear` LM head `[V, H]`, the input ids and the target mask, and returns
the dense shifted log-prob tensor `[1, L-1]` (0 off the targets); the benchmark runs forward and
backward of `-sum / S`. So every region also pays for finding its targets in the mask.

- `logprob_region(branch_policy(BRANCH))`: the real `trainers.selective.selected_logprobs` held on one
  branch through its public policy: "suffix" (the `logits_to_keep` shape: LM head over every slot from the
  first target to the end), "hidden" (eager selected CE), "hidden_chunked" (chunked custom-autograd
  recompute), "compiled" (`torch.compile`d CE), so the figures are those of the code users run;
- `logprob_region(policy, peer)`: a peer's LM-head method (benchmarks/peers.py), the same way;
- `selected_logsoftmax_path`: the plain selected path (LM head -> full log-softmax -> gather), the one
  shape here that no trainer branch runs: the baseline selected CE is measured against.

Before anything is timed, `check_region` compares each region's log-probs and its gradients
(hidden states and LM-head weight) with a float64 full-vocabulary reference; a region that is
wrong, or that ran a different branch than the one it is named after, raises `BenchValueError`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.measure import BenchValueError
from trainers.chunked_ce import tempered
from trainers.selective import AUTO_CHUNK_ROWS
from trainers.spec import SelectivePolicy


@dataclass
class EchoInputs:
    hidden: torch.Tensor            # [1, L, H] leaf, requires_grad
    lm_head: torch.nn.Linear        # weight [V, H], no bias
    input_ids: torch.Tensor         # [1, L]
    target_mask: torch.Tensor       # [1, L] bool: True at target tokens (positions + 1)
    positions: torch.Tensor         # [S] hidden positions that score a target (shifted index)
    targets: torch.Tensor           # [S] = input_ids[0, positions + 1]
    early_target_pos: int
    temperature: float = 1.0

    def clear_grads(self) -> None:
        self.hidden.grad = None
        self.lm_head.weight.grad = None


@dataclass
class RegionOut:
    dense: torch.Tensor             # [1, L-1] shifted target log-probs, 0 off the targets, with grad
    info: dict[str, Any] = field(default_factory=dict)


Region = Callable[[EchoInputs], RegionOut]


def selected_positions(seq_len: int, early_target_pos: int, selected_tokens: int) -> list[int]:
    """S hidden positions spread evenly from `early_target_pos` to the last one (`seq_len - 2`)."""
    slots = seq_len - 1 - early_target_pos
    if early_target_pos < 0 or slots < 1:
        raise SystemExit(f"--seq-len {seq_len} must exceed --early-target-pos {early_target_pos} + 1")
    if not 0 < selected_tokens <= slots:
        raise SystemExit(f"--selected-tokens {selected_tokens} must be in 1..{slots} (the suffix slots)")
    if selected_tokens == 1:
        return [early_target_pos]
    pos = torch.linspace(early_target_pos, seq_len - 2, selected_tokens, dtype=torch.float64).round().long()
    pos = torch.unique(pos)
    if pos.numel() < selected_tokens:  # rounding collided; fill from the start of the suffix
        free = sorted(set(range(early_target_pos, seq_len - 1)) - set(pos.tolist()))
        pos = torch.tensor(sorted(pos.tolist() + free[:selected_tokens - pos.numel()]))
    return pos.tolist()


def make_inputs(*, seq_len: int, early_target_pos: int, selected_tokens: int, vocab_size: int,
                hidden_size: int, device: torch.device, dtype: torch.dtype, seed: int = 123) -> EchoInputs:
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor(selected_positions(seq_len, early_target_pos, selected_tokens))
    input_ids = torch.randint(0, vocab_size, (1, seq_len), generator=gen)
    target_mask = torch.zeros(1, seq_len, dtype=torch.bool)
    target_mask[0, positions + 1] = True
    lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab_size, hidden_size, generator=gen) * 0.02)
    hidden = torch.randn(1, seq_len, hidden_size, generator=gen)
    return EchoInputs(
        hidden=hidden.to(device=device, dtype=dtype).requires_grad_(),
        lm_head=lm_head.to(device=device, dtype=dtype),
        input_ids=input_ids.to(device), target_mask=target_mask.to(device),
        positions=positions.to(device), targets=input_ids[0, positions + 1].to(device),
        early_target_pos=early_target_pos)


# ---- the log-prob functions users run, and the peers', as regions ----

def branch_policy(branch: str, *, chunk_size: int | None = None, compile_mode: str = "off",
                  compile_min_tokens: int = 128) -> SelectivePolicy:
    """The `selected_logprobs` options that put it on `branch` at every shape, through its public policy:
    "suffix" (the `logits_to_keep` shape, whatever the density), "hidden" (eager selected CE, never the
    suffix shortcut nor the auto-chunk budget), "hidden_chunked" (`chunk_size` rows at a time), "compiled"
    (`compile_mode` "auto" or "require"). A region named after a branch measures that branch; which one
    the default policy picks is what `echo_train_smoke` and the crossover's `default_branch` show."""
    if branch == "suffix":
        return SelectivePolicy(dense_min_density=0.0, suffix_max_bytes=2**62)
    if branch == "hidden_chunked":
        return SelectivePolicy(chunk_size=chunk_size or AUTO_CHUNK_ROWS)
    if branch in ("hidden", "compiled"):
        return SelectivePolicy(suffix_max_bytes=0, hidden_max_bytes=2**62,
                               compile_mode=compile_mode if branch == "compiled" else "off",
                               compile_min_tokens=compile_min_tokens)
    raise ValueError(f"branch {branch!r}: choose suffix, hidden, hidden_chunked or compiled")


def logprob_region(policy: SelectivePolicy, logprob_fn: Callable | None = None) -> Region:
    """A function of `selected_logprobs`' signature as a region: the trainer's own (`None`), forced onto a
    branch by `policy` (`branch_policy`), or a peer's method (benchmarks/peers.py), so the figures are
    those of the code a train step runs."""
    from trainers.selective import selected_logprobs

    fn = logprob_fn or selected_logprobs

    def region(x: EchoInputs) -> RegionOut:
        dense, info = fn(x.hidden, x.lm_head, x.input_ids, x.target_mask, temperature=x.temperature,
                         policy=policy)
        info = dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(info or {})
        return RegionOut(dense, info)

    return region


def default_branch(x: EchoInputs) -> str:
    """The branch `selected_logprobs` picks with no options (what `quaero train` runs by default)."""
    from trainers.selective import selected_logprobs

    with torch.no_grad():
        return selected_logprobs(x.hidden, x.lm_head, x.input_ids, x.target_mask)[1].branch


# ---- a shape no trainer branch runs, kept as the baseline selected CE is measured against ----

def selected_logsoftmax_path(x: EchoInputs) -> RegionOut:
    """The plain selected path: selected hidden rows -> LM head -> full fp32 log-softmax -> gather ->
    scatter (what `selected_cross_entropy_path`'s class-index CE is measured against)."""
    shifted = x.target_mask[:, 1:]                                            # [1, L-1]
    rows, cols = shifted.nonzero(as_tuple=True)                               # [S], [S]
    logits = x.lm_head(x.hidden[rows, cols])                                  # [S, V]
    logp = torch.log_softmax(tempered(logits.float(), x.temperature), dim=-1)
    lp = logp.gather(-1, x.input_ids[rows, cols + 1][:, None]).squeeze(-1)    # [S]
    return RegionOut(lp.new_zeros(shifted.shape).index_put((rows, cols), lp))


def region_loss(out: RegionOut, n_selected: int) -> torch.Tensor:
    """`-sum / S` of the dense log-probs (0 off the targets): `-mean` of the selected ones."""
    return -out.dense.sum() / n_selected


def run_region(region: Region, x: EchoInputs) -> float:
    """One forward + backward of the region; returns the loss value."""
    loss = region_loss(region(x), x.positions.numel())
    loss.backward()
    return float(loss.detach())


def branch_of(info: dict[str, Any]) -> str | None:
    """The branch name a `selected_logprobs` info dict reports."""
    for key in ("branch", "path", "mode"):
        if isinstance(info.get(key), str):
            return info[key]
    return None


# ---- the value check ----

TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 5e-2), torch.float16: (2e-2, 2e-2)}


@dataclass
class Reference:
    logprobs: torch.Tensor          # [S] float64
    grad_hidden: torch.Tensor       # [1, L, H] float64
    grad_weight: torch.Tensor       # [V, H] float64


def reference(x: EchoInputs, rows_per_chunk: int = 256) -> Reference:
    """float64 full-vocabulary log_softmax at each selected position, and the gradients of
    `-mean(selected)`; chunked over rows only to bound memory (each row is exact)."""
    h = x.hidden.detach()[0, x.positions].double().requires_grad_()
    w = x.lm_head.weight.detach().double().requires_grad_()
    n = x.positions.numel()
    out = []
    for start in range(0, n, rows_per_chunk):
        sl = slice(start, start + rows_per_chunk)
        logp = torch.log_softmax(F.linear(h[sl], w) / x.temperature, dim=-1)
        sel = logp.gather(-1, x.targets[sl, None]).squeeze(-1)
        (-sel.sum() / n).backward()
        out.append(sel.detach())
    grad_hidden = torch.zeros(x.hidden.shape, dtype=torch.float64, device=h.device)
    grad_hidden[0, x.positions] = h.grad
    return Reference(torch.cat(out), grad_hidden, w.grad)


def _rel(a: torch.Tensor | None, ref: torch.Tensor) -> float:
    if a is None:
        return float("inf")
    scale = ref.abs().max().clamp_min(1e-30)
    return float((a.double() - ref).abs().max() / scale)


def check_region(name: str, region: Region, x: EchoInputs, ref: Reference,
                 expect_branch: str | None = None, allow_fallback: bool = False) -> dict[str, Any]:
    """Run `region` once and compare with `ref`; raise BenchValueError on any disagreement."""
    x.clear_grads()
    out = region(x)
    region_loss(out, x.positions.numel()).backward()
    lp_tol, grad_tol = TOLERANCES[x.hidden.dtype]
    lp_err = float((out.dense.detach()[0, x.positions].double() - ref.logprobs).abs().max())
    g_h, g_w = _rel(x.hidden.grad, ref.grad_hidden), _rel(x.lm_head.weight.grad, ref.grad_weight)
    keep = torch.ones(out.dense.shape[-1], dtype=torch.bool, device=out.dense.device)
    keep[x.positions] = False
    unselected = int((out.dense.detach()[0, keep] != 0).sum())
    branch = branch_of(out.info)
    x.clear_grads()
    result = {"max_abs_logprob_err": lp_err, "max_rel_grad_err_hidden": g_h, "max_rel_grad_err_weight": g_w,
              "nonzero_unselected": unselected, "logprob_tol": lp_tol, "grad_rel_tol": grad_tol,
              "branch": branch,
              "info": {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
                                          for k, v in out.info.items()}}
    problems = []
    if not lp_err <= lp_tol:
        problems.append(f"max |logprob - reference| = {lp_err:.3g} > {lp_tol}")
    if not g_h <= grad_tol:
        problems.append(f"hidden-state gradient rel. error {g_h:.3g} > {grad_tol}")
    if not g_w <= grad_tol:
        problems.append(f"LM-head gradient rel. error {g_w:.3g} > {grad_tol}")
    if unselected:
        problems.append(f"{unselected} unselected positions are not 0")
    if expect_branch and branch != expect_branch and not allow_fallback:
        problems.append(f"ran branch {branch!r}, expected {expect_branch!r} (info={out.info})")
    if problems:
        raise BenchValueError(f"region {name} fails the value check against the full-vocabulary "
                              f"reference: {'; '.join(problems)}")
    result["ok"] = True
    return result
