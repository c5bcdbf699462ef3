"""One sampler contract, run against the transformers sampler and vLLM (CPU build in CI): token ids in,
completions out, seeded, stop ids and finish reasons right, log-probs equal to the trainer model's."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from quaero.config import SamplerConfig
from quaero.sampling import Completion, request_seed, resolve_backend

STOP = [151645, 151643]
PROMPTS = [[151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198],
           [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198]]
BACKENDS = ["hf", pytest.param("vllm", marks=pytest.mark.vllm),
            pytest.param("server", marks=[pytest.mark.vllm, pytest.mark.slow])]


@pytest.fixture(scope="module")
def model():
    from quaero.models.load import load_causal_lm

    return load_causal_lm("tiny-qwen3").eval()


@pytest.fixture(scope="module")
def vllm_server(tiny_model_dir):
    """One `vllm serve` process on tiny-qwen3 for this module (about a minute to start on CPU), started with
    vLLM's IPC weight-transfer engine too (`[sampler] weight_transfer = "ipc"`'s command and environment):
    the samplers here push by file, and the weight-sync client's routes are checked against it."""
    from fixtures import require_vllm

    require_vllm()
    from quaero.sampling.server import start_vllm_servers

    (proc,) = start_vllm_servers(str(tiny_model_dir), SamplerConfig(mode="server", weight_transfer="ipc"),
                                 count=1,
                            dtype="float32", max_model_len=4096, max_num_seqs=16)
    yield proc
    proc.close()


@pytest.fixture(params=BACKENDS)
def make(request, model, tiny_model_dir):
    """make(stop=..., **SamplerConfig fields) -> a sampler of this backend over tiny-qwen3."""
    def build(stop=STOP, max_seq_len=4096, **cfg):
        sc = SamplerConfig(**{"temperature": 0.7, "max_tokens": 12, **cfg})
        if request.param == "hf":
            from quaero.sampling.hf import HFSampler

            return HFSampler(model, sc, stop_token_ids=stop, max_seq_len=max_seq_len)
        # the server's engine settings are its own; the sampler's apply per request
        if request.param == "server":
            from quaero.sampling.server import VLLMServerSampler

            return VLLMServerSampler([request.getfixturevalue("vllm_server").url], sc, stop_token_ids=stop,
                                     max_model_len=max_seq_len)
        from quaero.sampling.vllm import VLLMSampler

        return VLLMSampler(str(tiny_model_dir), sc, stop_token_ids=stop, max_model_len=max_seq_len,
                           llm=request.getfixturevalue("vllm_engine"))
    return build


def reference(model, prompt: list[int], comp: list[int], temperature: float) -> torch.Tensor:
    """The trainer's view: log_softmax(logits / T) at each completion token, one full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + comp])).logits[0, len(prompt) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)


def test_completions_stop_at_the_context_the_prompt_leaves(make):
    s = make(max_seq_len=15)  # prompts of 9 and 12 tokens leave 6 and 3 of the 12 max_tokens
    for prompt, (c,) in zip(PROMPTS, s.generate(PROMPTS, seed=3)):
        room = 15 - len(prompt)
        assert len(c.token_ids) <= room
        assert c.finish_reason == "stop" or (len(c.token_ids) == room and c.finish_reason == "length")
    with pytest.raises(ValueError, match="leaves no room"):
        s.generate([PROMPTS[1] + [9707] * 3])


def test_completions_are_valid_seeded_and_distinct(make):
    s = make()
    out = s.generate(PROMPTS + [PROMPTS[0]], n=2, seed=7)
    assert len(out) == 3 and all(len(cs) == 2 for cs in out)
    for c in (c for cs in out for c in cs):
        assert isinstance(c,
                          Completion) and 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        assert c.finish_reason == ("stop" if c.token_ids[-1] in STOP else "length")
        assert all(lp <= 0 for lp in c.logprobs)
    ids = [c.token_ids for cs in out for c in cs]
    assert len({tuple(i) for i in ids}) == len(ids)  # n samples and equal prompts in a batch all differ
    again = s.generate(PROMPTS + [PROMPTS[0]], n=2, seed=7)
    assert [[c.token_ids for c in cs] for cs in again] == [[c.token_ids for c in cs] for cs in out]
    assert s.generate(PROMPTS, n=2, seed=8)[0][0].token_ids != out[0][0].token_ids


def test_logprobs_match_the_trainer_model(make, model):
    s = make(temperature=0.7)
    for prompt, cs in zip(PROMPTS, s.generate(PROMPTS, n=2, seed=3)):
        for c in cs:
            gap = (torch.tensor(c.logprobs) - reference(model, prompt, c.token_ids, 0.7)).abs().max()
            assert gap < 1e-4
    g = s.generate(PROMPTS[:1], greedy=True)[0][0]  # greedy: argmax path, untempered log-probs
    ref = reference(model, PROMPTS[0], g.token_ids, 1.0)
    assert (torch.tensor(g.logprobs) - ref).abs().max() < 1e-4


def test_a_seeded_batch_longer_than_one_prefill_step(make):
    """10 seeded prompts of 260 tokens: more prompt than vLLM's default 2048-token step, which on the CPU
    build split a prefill and killed the engine (quaero/sampling/vllm.py `cpu_whole_prefill`)."""
    prompts = [PROMPTS[0][:3] + [1000 + 7 * i + k for k in range(251)] + PROMPTS[0][3:] for i in range(10)]
    out = make(max_tokens=3).generate(prompts, n=2, seed=4)
    assert [len(cs) for cs in out] == [2] * 10 and all(1 <= len(c.token_ids) <= 3 for cs in out for c in cs)


def test_stop_ids_and_finish_reasons(make):
    first = make().generate(PROMPTS[:1], greedy=True)[0][0].token_ids[0]
    stopped = make(stop=[first]).generate(PROMPTS[:1], greedy=True)[0][0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    long = make(max_tokens=5).generate(PROMPTS[:1], seed=1)[0][0]
    assert len(long.token_ids) == 5 and long.finish_reason == "length"


def test_update_weights_reaches_the_sampler(make, model):
    """A push moves layer 0 and the embedding; tiny-qwen3 ties its LM head to the embedding, so the head must
    follow it (vLLM's CPU build computes the head with a packed copy that the in-place reload alone keeps)."""
    trained = copy.deepcopy(model)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    with torch.no_grad():
        for p in [*trained.model.layers[0].parameters(), trained.model.embed_tokens.weight]:
            p.add_(0.05 * torch.randn_like(p))
    s = make(temperature=1.0)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    if hasattr(s, "model"):  # hf: give it its own module so the update is a real copy
        s.model = copy.deepcopy(model)
    try:
        s.update_weights(trained.state_dict())
        c = s.generate(PROMPTS[:1], seed=2)[0][0]
    finally:
        s.update_weights(original)  # the vLLM engine (or server) is shared by the session (module)
    assert (torch.tensor(c.logprobs) - reference(trained, PROMPTS[0], c.token_ids, 1.0)).abs().max() < 1e-4
    assert (torch.tensor(c.logprobs) - reference(model, PROMPTS[0], c.token_ids, 1.0)).abs().max() > 1e-3
    back = s.generate(PROMPTS[:1], seed=2)[0][0]  # and the push back reaches it too
    assert (torch.tensor(back.logprobs) - reference(model, PROMPTS[0], back.token_ids,
                                                    1.0)).abs().max() < 1e-4


@pytest.mark.vllm
@pytest.mark.slow
def test_weight_sync_client_drives_the_servers_weight_transfer_routes(vllm_server):
    """quaero's `VLLMWeightSyncClient` against a real server with `--weight-transfer-config ipc`: each call is
    the route and JSON body vLLM's HTTP router takes (IPC handles pickled, which the server accepts only with
    the VLLM_ALLOW_INSECURE_SERIALIZATION that `server_env` sets), and the server answers all four. The CPU
    build moves no weights by IPC: the update here is empty, and the model is unchanged by the round."""
    import base64
    import pickle

    from quaero.sampling.server import ServerError, VLLMServerSampler
    from quaero.sampling.transfer import ServerWeightSync

    sampler = VLLMServerSampler([vllm_server.url], SamplerConfig(max_tokens=6), stop_token_ids=STOP)
    calls = []

    def post(url, path, body):  # the sampler's own _post, recorded
        calls.append((path, body))
        return sampler._post(url, path, body)

    before = sampler.generate(PROMPTS[:1], greedy=True)[0][0]
    client = ServerWeightSync(vllm_server.url, post)
    client.init_weight_transfer_engine({"packed": False})
    client.start_weight_update()
    client.update_weights({"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []})
    client.finish_weight_update()
    pickled = base64.b64encode(pickle.dumps([])).decode()
    assert calls == [("/init_weight_transfer_engine", {"init_info": {"packed": False}}),
                     ("/start_weight_update", None),
                     ("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": [],
                                                          "ipc_handles_pickled": pickled}}),
                     ("/finish_weight_update", None)]
    after = sampler.generate(PROMPTS[:1], greedy=True)[0][0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    # a fault: vLLM's worker refuses a finish without a start; quaero's error names the route and the reason
    with pytest.raises(ServerError, match=r"/finish_weight_update answered 500: .*finish_weight_update "
                                          r"called without a matching start_weight_update"):
        client.finish_weight_update("v1")
    assert calls[-1] == ("/finish_weight_update", {"weight_version": "v1"})
    # the server lives on
    assert sampler.generate(PROMPTS[:1], greedy=True)[0][0].token_ids == before.token_ids
    with pytest.raises(ServerError, match=r"/update_weights answered 4\d\d"):  # a body vLLM's router refuses
        sampler._post(vllm_server.url, "/update_weights", {"update_info": "not a payload"})


@pytest.mark.vllm
@pytest.mark.slow
def test_a_real_server_passes_the_urls_check_and_says_what_it_lacks(vllm_server):
    """`[sampler] urls` servers are asked what they are before any model loads (quaero/preflight/plan.py
    check_server_urls): the server quaero starts passes; asked for what it was not started with, it is
    refused naming the flag (tests/unit/quaero/sampling/test_server.py has the other refusals)."""
    from quaero.sampling.server import server_problem

    assert server_problem(vllm_server.url, SamplerConfig(mode="server"), max_seq_len=4096) is None
    assert server_problem(vllm_server.url, SamplerConfig(mode="server", weight_transfer="ipc"),
                          max_seq_len=4096) is None
    # (nccl names the servers' own GPUs: the config alone refuses it without them)
    nccl = server_problem(vllm_server.url, SamplerConfig(mode="server", weight_transfer="nccl",
                                                         server_devices=[1]), max_seq_len=4096)
    assert nccl.startswith("was started with weight transfer 'ipc' and [sampler] weight_transfer='nccl'")
    longer = server_problem(vllm_server.url, SamplerConfig(mode="server"), max_seq_len=8192)
    assert longer.startswith("holds 4096 tokens per sequence and [model] max_seq_len=8192")


def test_backend_choice_and_request_seeds(monkeypatch):
    import quaero.sampler_registry

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for installed in (True, False):  # `auto`: vLLM where it imports (benchmarks/README.md), else hf
        monkeypatch.setattr(quaero.sampler_registry, "installed", lambda name, ok=installed: ok)
        for device in ("cpu", "cuda:0"):
            assert resolve_backend("auto", device) == ("vllm" if installed else "hf")
            assert resolve_backend("hf", device) == "hf" and resolve_backend("vllm", device) == "vllm"
    monkeypatch.setattr(quaero.sampler_registry, "installed", lambda name: True)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a torchrun rank: its CPU engine could not run in its process
    assert resolve_backend("auto", "cpu") == "hf" and resolve_backend("auto", "cuda:0") == "vllm"
    seeds = {request_seed(5, i, 4) + j for i in range(8) for j in range(4)}
    assert len(seeds) == 32  # vLLM's per-sample seeds never collide inside one call


def test_engine_runs_in_process_alone_and_beside_no_other(monkeypatch):
    import gc
    import weakref

    from quaero.sampling import vllm as v

    monkeypatch.delenv(v.MULTIPROCESSING, raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(v, "_in_process_engines", weakref.WeakSet())
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    assert v.engine_in_process()
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not v.engine_in_process()  # a torchrun rank
    monkeypatch.delenv("WORLD_SIZE")

    class Engine:
        pass

    live = Engine()
    v._in_process_engines.add(live)
    assert not v.engine_in_process()  # two would share vLLM's module-level parallel state
    del live
    gc.collect()
    assert v.engine_in_process()
    monkeypatch.setenv(v.MULTIPROCESSING, "1")  # the user's explicit choice wins, either way
    assert not v.engine_in_process()
    monkeypatch.setenv(v.MULTIPROCESSING, "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert v.engine_in_process()


@pytest.mark.vllm
def test_engine_placement_leaves_the_process_as_it_was(vllm_engine):
    """vLLM seeds the global RNGs and swaps `torch.set_num_threads` for a no-op in the process it runs in."""
    import random

    from quaero.sampling import vllm as v

    assert torch.set_num_threads.__name__ == "set_num_threads"  # the session engine's build gave it back
    before = (torch.get_rng_state(), random.getstate(), torch.set_num_threads,
              os.environ.get(v.MULTIPROCESSING))
    with v._engine_placement(in_process=True):
        assert os.environ[v.MULTIPROCESSING] == "0"
        torch.manual_seed(123)
        random.seed(123)
        torch.set_num_threads = lambda n: None
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert torch.set_num_threads is before[2] and os.environ.get(v.MULTIPROCESSING) == before[3]


def test_auto_falls_back_to_hf_when_vllm_cannot_start(monkeypatch, model, capsys):
    import quaero.sampling
    import quaero.sampling.vllm
    from quaero.config import QuaeroConfig
    from quaero.sampling import make_sampler

    def broken(*args, **kwargs):
        raise ValueError("Head size 16 is not supported by the CPU attention backend")

    monkeypatch.setattr(quaero.sampling, "resolve_backend", lambda name, device: "vllm")
    monkeypatch.setattr(quaero.sampling.vllm, "VLLMSampler", broken)
    cfg = QuaeroConfig.model_validate({"env": {"entry": "x:y"}, "sampler": {"backend": "auto"}})
    s = make_sampler(cfg, model=model, stop_token_ids=STOP, device="cpu")
    assert type(s).__name__ == "HFSampler" and s.shares_model
    printed = capsys.readouterr()
    assert "sampler_fallback" in printed.err + printed.out
    cfg = QuaeroConfig.model_validate({"env": {"entry": "x:y"}, "sampler": {"backend": "vllm"}})
    with pytest.raises(ValueError, match="Head size 16"):  # asked for by name: an error, not a fallback
        make_sampler(cfg, model=model, stop_token_ids=STOP, device="cpu")


def test_make_sampler_shares_the_trainer_module(model):
    from quaero.config import QuaeroConfig
    from quaero.sampling import make_sampler

    cfg = QuaeroConfig.model_validate({"env": {"entry": "x:y"}, "sampler": {"backend": "hf"}})
    s = make_sampler(cfg, model=model, stop_token_ids=STOP, device="cpu")
    assert s.model is model and s.shares_model
    s.update_weights(model.state_dict())  # shared tensors: a no-op, not a copy


def test_top_p_keeps_the_smallest_nucleus_and_renormalises():
    from quaero.sampling.hf import processed_logprobs

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = processed_logprobs(logits, temperature=1.0, top_p=0.7, greedy=False)
    assert torch.isinf(lp[0, 2:]).all() and torch.allclose(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    assert torch.allclose(processed_logprobs(logits, 2.0, 1.0, False).exp().sum(), torch.tensor(1.0))


@pytest.mark.parametrize("make", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)], indirect=True)
def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_counted(make):
    """A group's members send one prompt: its KV is computed once (hf: once per call and kept; vLLM: its
    prefix cache, full blocks only), and the sampler counts the tokens it reused (the driver adds them)."""
    from quaero.telemetry import names

    s = make(temperature=1.0)
    prompt = PROMPTS[1] * 25  # 300 tokens: two whole KV blocks of vLLM's CPU build (128 tokens a block)
    s.take_counts()
    s.generate([prompt], seed=0)
    first = s.take_counts()
    s.generate([prompt] * 2, seed=1)
    second = s.take_counts()
    assert first[names.SAMPLER_REUSED_TOKENS] + first[names.SAMPLER_PREFILL_TOKENS] == len(prompt)
    assert second[names.SAMPLER_REUSED_TOKENS] >= len(prompt)  # the second member's copy at the least
    assert second[names.SAMPLER_PREFIX_HITS] >= 1
