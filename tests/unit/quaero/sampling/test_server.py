"""Server mode without a server (quaero/sampling/server.py): the config rules, the servers' command and
environment (weight transfer, devices), and a running server judged by what it says of itself (the server
process itself: test_supervisor.py; the weight-transfer source: test_transfer.py)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from quaero.config import ConfigError, QuaeroConfig, SamplerConfig, check_rules, load_config
from quaero.preflight.plan import check_server_devices
from quaero.sampling.server import serve_argv, server_devices, server_env
from quaero.sampling.supervisor import free_port


def _cfg(**sampler) -> QuaeroConfig:
    return QuaeroConfig.model_validate({"env": {"entry": "x:y"}, "sampler": sampler})


def _load(**sampler) -> QuaeroConfig:
    """envs/toolbench.toml with these [sampler] settings, as `quaero check` reads it (its one error line)."""
    return load_config("envs/toolbench.toml", [f"sampler.{k}={json.dumps(v)}" for k, v in sampler.items()])


@pytest.mark.parametrize("sampler, match", [
    ({"mode": "server", "backend": "hf"}, (r"\[sampler\] mode='server' with backend='hf'.*set backend = "
                                          r"'vllm'")),
    ({"urls": ["http://127.0.0.1:8000"]}, r"\[sampler\] urls=.* with mode='colocated'.*set mode = 'server'"),
    ({"mode": "server", "servers": 2, "urls": ["http://127.0.0.1:8000"]}, r"servers=2 and urls=.*remove one"),
    ({"mode": "server", "urls": ["127.0.0.1:8000"]}, r"urls: '127.0.0.1:8000' is not a server address"),
])
def test_server_mode_config_rules(sampler, match):
    with pytest.raises(ConfigError, match=match):
        _load(**sampler)


def test_server_mode_config_accepts_auto_vllm_and_urls():
    for sampler in ({"mode": "server"}, {"mode": "server", "backend": "vllm", "servers": 2},
                    {"mode": "server", "urls": ["http://127.0.0.1:8000", "http://10.0.0.2:8001/"]}):
        check_rules(_cfg(**sampler), "run.toml")


SERVER = {"mode": "server"}


@pytest.mark.parametrize("sampler, match", [
    ({"weight_transfer": "nccl"}, (r"\[sampler\] weight_transfer='nccl' with mode='colocated'.*set mode = "
                                  r"'server'")),
    ({"weight_transfer": "ipc"}, r"weight_transfer='ipc' with mode='colocated'"),
    ({"server_devices": [1]}, r"server_devices=\[1\] with mode='colocated'.*set mode = 'server'"),
    ({**SERVER, "server_devices": [1], "urls": ["http://127.0.0.1:8000"]},
     r"server_devices=\[1\] and urls=.*both set.*remove server_devices"),
    ({**SERVER, "servers": 2, "server_devices": [1, 1]}, r"server_devices=\[1, 1\] names a device twice"),
    ({**SERVER, "weight_transfer": "nccl", "urls": ["http://127.0.0.1:8000"]},
     r"weight_transfer='nccl' with urls=.*remove urls and set servers and server_devices"),
    ({**SERVER, "weight_transfer": "nccl"}, (r"weight_transfer='nccl' without server_devices.*NCCL refuses "
                                            r"two ranks on one device; set server_devices = \[1\]")),
    ({**SERVER, "weight_transfer": "ipc", "server_devices": [1]},
     r"weight_transfer='ipc' with server_devices=\[1\].*on the trainer's GPU; remove server_devices"),
])
def test_weight_transfer_and_server_devices_config_rules(sampler, match):
    with pytest.raises(ConfigError, match=match):
        _load(**sampler)


def test_weight_transfer_config_accepts_the_working_combinations():
    for sampler in ({**SERVER, "weight_transfer": "file"}, {**SERVER, "server_devices": [1, 2], "servers": 2},
                    {**SERVER, "weight_transfer": "ipc"},
                    {**SERVER, "weight_transfer": "ipc", "urls": ["http://127.0.0.1:8000"]},
                    {**SERVER, "weight_transfer": "nccl", "server_devices": [1]}):
        check_rules(_cfg(**sampler), "run.toml")
    assert SamplerConfig().weight_transfer == "file" and SamplerConfig().server_devices == []


@pytest.mark.parametrize("sampler, match", [
    ({**SERVER, "weight_transfer": "nccl", "server_devices": [1]},
     r"weight_transfer='nccl': vLLM's NCCL/IPC weight transfer needs CUDA and none is available.*'file'"),
    ({**SERVER, "weight_transfer": "ipc"}, r"weight_transfer='ipc': .*needs CUDA"),
    ({**SERVER, "server_devices": [1]}, r"server_devices=\[1\]: CUDA device indices, and no CUDA device"),
])
def test_weight_transfer_is_refused_without_cuda(monkeypatch, sampler, match):
    # as on this CPU machine, also on a GPU one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=match):
        check_server_devices(_cfg(**sampler), "run.toml")
    check_server_devices(_cfg(**SERVER), "run.toml")  # file, no devices: today's server mode


@pytest.fixture
def four_gpus(monkeypatch):
    """This machine's CUDA inventory as a 4-GPU one: the device rules are plain arithmetic over it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("ranks, sampler, match", [
    (1, {"servers": 2, "server_devices": [1]}, (r"lists 1 device\(s\) for servers=2: one device per started "
                                               r"server; list 2")),
    (2, {"server_devices": [2]}, (r"for servers=1 x 2 local ranks \(each starts its own; local rank l takes "
                                 r"entries l\*servers \.\.\).*list 2")),
    (1, {"server_devices": [4]}, r"device 4 does not exist here \(4 CUDA device\(s\): 0\.\.3\)"),
    (1, {"weight_transfer": "nccl", "server_devices": [0]}, (r"cuda:0 is a trainer rank's device.*from "
                                                            r"1\.\.3")),
    (2, {"weight_transfer": "nccl", "server_devices": [2, 1]}, (r"cuda:1 is a trainer rank's device.*from "
                                                               r"2\.\.3")),
    (1, {"weight_transfer": "ipc", "server_devices": []}, None),
    (1, {"weight_transfer": "nccl", "server_devices": [3]}, None),
    (2, {"weight_transfer": "nccl", "servers": 2, "server_devices": [2, 3, 4, 5]}, (r"device 4 does not "
                                                                                   r"exist")),
    # file: a server may share its rank's GPU
    (2, {"weight_transfer": "file", "server_devices": [0, 1]}, None),
])
def test_server_devices_against_the_gpus_and_the_ranks(four_gpus, ranks, sampler, match):
    four_gpus.setenv("WORLD_SIZE", str(ranks))
    four_gpus.setenv("LOCAL_WORLD_SIZE", str(ranks))
    cfg = _cfg(**SERVER, **sampler)
    if match is None:
        check_server_devices(cfg, "run.toml")
    else:
        with pytest.raises(ConfigError, match=r"run.toml \[sampler\] .*" + match):
            check_server_devices(cfg, "run.toml")


def test_weight_transfer_needs_the_trainer_on_cuda(four_gpus):
    cfg = QuaeroConfig.model_validate({"env": {"entry": "x:y"}, "run": {"device": "cpu"},
                                       "sampler": {**SERVER, "weight_transfer": "ipc"}})
    with pytest.raises(ConfigError, match=r"weight_transfer='ipc' with \[run\] device='cpu'.*set device = "
                                          r"'cuda'"):
        check_server_devices(cfg, "run.toml")


def test_serve_argv_and_env_carry_the_weight_transfer(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    for backend in ("nccl", "ipc"):
        sc = SamplerConfig(mode="server", weight_transfer=backend,
                           server_devices=[1] if backend == "nccl" else [])
        argv = serve_argv("/m", sc, port=8000, on_cpu=False)
        flag = argv.index("--weight-transfer-config")
        assert json.loads(argv[flag + 1]) == {"backend": backend}  # vLLM's engine arg (EngineArgs)
        env = server_env(sc, device=None, on_cpu=False)
        assert env["VLLM_SERVER_DEV_MODE"] == "1"  # the weight-transfer routes are dev routes
        assert env.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == ("1" if backend == "ipc" else None)
    file = SamplerConfig(mode="server")
    assert "--weight-transfer-config" not in serve_argv("/m", file, port=8000, on_cpu=True)
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in server_env(file, device=None, on_cpu=True)


def test_each_started_server_gets_its_device(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    sc = SamplerConfig(mode="server", servers=2, server_devices=[1, 2])
    assert server_devices(sc, 2, on_cpu=False) == [1, 2]
    envs = [server_env(sc, device=d, on_cpu=False) for d in server_devices(sc, 2, on_cpu=False)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")  # indices are this process's: cuda:1 is GPU 5
    assert server_env(sc, device=1, on_cpu=False)["CUDA_VISIBLE_DEVICES"] == "5"
    assert server_env(sc, device=None, on_cpu=False)["CUDA_VISIBLE_DEVICES"] == "4,5,6"  # inherited: today's
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun: local rank l takes entries l*servers ..
    monkeypatch.setenv("LOCAL_RANK", "1")
    node = SamplerConfig(mode="server", servers=2, server_devices=[2, 3, 4, 5])
    assert server_devices(node, 2, on_cpu=False) == [4, 5]
    # the rank's GPU
    assert server_devices(SamplerConfig(mode="server", servers=2), 2, on_cpu=False) == [1, 1]
    assert server_devices(SamplerConfig(mode="server"), 1, on_cpu=True) == [None]  # CPU: nothing to place


@pytest.mark.vllm
def test_a_server_sampler_refuses_nccl_and_ipc_without_cuda(monkeypatch):
    from quaero.sampling.server import VLLMServerSampler

    # as on this CPU machine, also on a GPU one
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    for backend in ("nccl", "ipc"):
        with pytest.raises(RuntimeError, match=rf"weight_transfer='{backend}': .*needs CUDA and none is "
                                               r"available"):
            sc = SamplerConfig(mode="server", weight_transfer=backend,
                               server_devices=[1] if backend == "nccl" else [])
            VLLMServerSampler(["http://127.0.0.1:9"], sc, stop_token_ids=[0])


# ── [sampler] urls: a running server is asked what it is before any model loads ──────────────────────────


def _vllm_replies(**changes) -> dict:
    """A vLLM server's /v1/models and /server_info replies, its engine settings changed by `changes`
    ({"model_config.logprobs_mode": "raw_logprobs", ...}; None for /server_info = dev routes off)."""
    from pathlib import Path

    recorded = json.loads((Path(__file__).parents[3] / "fixtures" / "vllm_server_info.json").read_text())
    info = recorded["server_info"]
    for key, value in changes.items():
        if key == "server_info":
            info = value
            continue
        if "." in key:
            section, field = key.split(".")
            info["vllm_config"][section][field] = value
        else:
            info["vllm_config"][key] = value
    replies = {"/v1/models": (200, recorded["models"])}
    if info is not None:
        replies["/server_info?config_format=json"] = (200, info)
    return replies


@pytest.mark.parametrize("changes, cfg, problem", [
    ({}, {}, None),
    ({"server_info": None}, {}, (r"answers without vLLM's dev routes \(GET /server_info: "
                                r"404\).*VLLM_SERVER_DEV_MODE=1")),
    ({"model_config.logprobs_mode": "raw_logprobs"}, {},
     r"reports log-probs as 'raw_logprobs'.*--logprobs-mode processed_logprobs"),
    ({"model_config.max_model_len": 1024}, {}, (r"holds 1024 tokens per sequence and \[model\] "
                                               r"max_seq_len=4096")),
    ({"parallel_config.worker_extension_cls": None}, {},
     r"CPU build without quaero's weight reload.*--worker-extension-cls quaero.sampling.vllm.CPUWeightSync"),
    ({"device_config.device": "cuda", "parallel_config.worker_extension_cls": None}, {}, None),
    ({}, {"weight_transfer": "ipc"}, (r"started with weight transfer None and \[sampler\] "
                                     r"weight_transfer='ipc'")),
    ({"weight_transfer_config": {"backend": "ipc"}}, {"weight_transfer": "ipc"}, None),
])
def test_a_running_server_is_judged_by_what_it_says_of_itself(http_server, changes, cfg, problem):
    from quaero.sampling.server import server_problem

    url = http_server(_vllm_replies(**changes))
    found = server_problem(url, SamplerConfig(mode="server", **cfg), max_seq_len=4096)
    if problem is None:
        assert found is None
    else:
        assert found is not None and re.search(problem, found), found


def test_a_server_too_slow_to_describe_itself_is_refused_in_one_line(monkeypatch, http_server):
    """A vLLM server that answers /v1/models but not /server_info within the probe's wait (a loaded CPU
    machine: vLLM writes that reply from its whole engine config) is refused with what it did not answer and
    the wait, never a raw timeout; given the time, the same server passes."""
    import time

    from quaero.sampling import server as server_mod

    replies = _vllm_replies()
    delay = {"s": 1.0}

    def slow(method, path, body):
        if path.startswith("/server_info"):
            time.sleep(delay["s"])
        return replies.get(path, (404, b""))

    url = http_server(slow)
    monkeypatch.setattr(server_mod, "PROBE_TIMEOUT_S", 0.2)
    found = server_mod.server_problem(url, SamplerConfig(mode="server"), max_seq_len=4096)
    assert found is not None and found.startswith("answers GET /v1/models but not GET /server_info ("), found
    assert "waited 0.2 s" in found and "not overloaded" in found, found
    delay["s"] = 0.0
    assert server_mod.server_problem(url, SamplerConfig(mode="server"), max_seq_len=4096) is None


def test_a_wrong_address_fails_the_config_before_any_model_loads(http_server):
    """Nothing listening, and a server that is not vLLM's: `quaero check` (and so `quaero train`) stops in one
    line naming the url, before a model or an env loads."""
    from quaero.preflight.plan import check_server_urls

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"run.toml \[sampler\] urls: {dead} does not answer .*start it or "
                                          r"fix"):
        check_server_urls(_cfg(mode="server", urls=[dead]), "run.toml")
    foreign = http_server({"/v1/models": (200, b"<html>a web page</html>")})
    from fixtures.runs import ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "quaero.cli", "check", "envs/toolbench.toml", "--set", "sampler.mode='server'",
         "--set",
         f"sampler.urls=['{foreign}']"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: envs/toolbench.toml [sampler] urls: {foreign} is not a vLLM "
                                  "OpenAI server (GET /v1/models answered 200 without a vLLM model)")


@pytest.mark.hostile
def test_a_dropped_connection_is_sent_again_and_a_lasting_one_names_the_retries(monkeypatch, http_server):
    """A flaky network between quaero and its servers: a completion whose connection drops is sent again
    (same seed, same reply); a server that keeps dropping it ends in one error naming the retries. The fault
    is a local server that closes the first connections without a reply."""
    import structlog

    from quaero.sampling import server as server_mod
    from quaero.sampling.server import ServerError, VLLMServerSampler

    monkeypatch.setattr(server_mod, "RETRY_WAITS_S", (0.01, 0.01, 0.01))
    drops = {"left": 2, "seen": 0}
    reply = {"choices": [{"index": 0, "token_ids": [9707, 151645], "logprobs": {"token_logprobs": [-0.5,
                                                                                                   -0.25]}}]}

    def flaky(method, path, body):
        drops["seen"] += 1
        if drops["left"]:
            drops["left"] -= 1
            return None
        return 200, reply

    url = http_server(flaky)
    sampler = VLLMServerSampler([url], SamplerConfig(mode="server", max_tokens=4), stop_token_ids=[151645])
    with structlog.testing.capture_logs() as logs:
        (c,), = sampler.generate([[151644, 872]], seed=1)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([9707, 151645], [-0.5, -0.25], "stop")
    assert drops["seen"] == 3  # two dropped, the third answered
    retried = [e for e in logs if e["event"] == "sampler_request_retried"]
    assert [(e["path"], e["retries_left"]) for e in retried] == [("/v1/completions", 2), ("/v1/completions",
                                                                                          1)]
    drops.update(left=10, seen=0)
    with pytest.raises(ServerError, match=rf"vLLM server {url}/v1/completions unreachable \(.*\) \(after 3 "
                                          r"retries\)"):
        sampler.generate([[151644, 872]], seed=1)
    assert drops["seen"] == 4
    # a weight push's control calls are not sent again (vLLM's engines rendezvous)
    drops.update(left=1, seen=0)
    with pytest.raises(ServerError, match=r"/start_weight_update unreachable"):
        sampler._post(url, "/start_weight_update", None)
    assert drops["seen"] == 1


@pytest.mark.hostile
def test_a_vllm_server_failing_mid_run_ends_quaero_train_in_one_error(monkeypatch, tmp_path, capsys):
    """`quaero train`: a server that fails during the run (the fault, raised where the recipe would meet it)
    ends the command with `error: ...` naming the server, exit 1, no traceback; its checkpoints stay."""
    import quaero.recipe.train
    from quaero import cli
    from quaero.sampling.server import ServerError

    def failing(cfg, **kwargs):
        raise ServerError("vLLM server http://127.0.0.1:9/v1/completions unreachable (refused) (after 3 "
                          "retries)")

    monkeypatch.setattr(quaero.recipe.train, "train", failing)
    from fixtures.runs import ROOT

    code = cli.main(["train", str(ROOT / "envs" / "toolbench.toml"), "--set", f"run.output_dir='{tmp_path}'"])
    err = capsys.readouterr().err
    assert code == 1 and err == ("error: vLLM server http://127.0.0.1:9/v1/completions unreachable (refused) "
                                 "(after 3 retries)\n")
