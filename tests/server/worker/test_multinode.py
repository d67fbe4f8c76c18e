"""Tensor parallelism across hosts, on loopback: a leader (`serve --nnodes 2 --node-rank 0`) and a
headless node (`serve --headless --node-rank 1`) as two processes answer as one TP=1 server does;
either one's death ends the other non-zero, naming who went away; a node that never comes is named
(the channel's own cases, refusals included, are in test_rank_channel.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from api_factories import live_server, serve_command, serve_process, wait_ready
from fault_doubles import FAULTS_ENV, WORKER

from pagedllm.server.config import ConfigError, EngineConfig
from pagedllm.server.demo import save_tiny_llama
from pagedllm.server.entrypoints.cli import main
from pagedllm.server.entrypoints.headless import check_node_role
from tests.support import free_port

pytestmark = pytest.mark.timeout(300)
ENV = {"OMP_NUM_THREADS": "1", "PAGEDLLM_TP_JOIN_TIMEOUT": "120"}
Nodes = tuple[subprocess.Popen, subprocess.Popen, str]
"""The leader's process, the headless node's process and the leader's URL."""
ENGINE = ["--max-model-len", "256", "--kv-cache-memory", "0.02", "--swap-space", "0.01", "--block-size", "8"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("multinode")
    return save_tiny_llama(
        str(root / "llama"),
        seed=11,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=64,
        intermediate_size=128,
        initializer_range=0.2,
    )


def node_flags(master_port: int, node_rank: int) -> list[str]:
    return [
        "--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(node_rank),
        "--master-addr", "127.0.0.1", "--master-port", str(master_port),
    ]  # fmt: skip


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **ENV, **(env or {})},
        start_new_session=True,
    )


def stop(proc: subprocess.Popen) -> str:
    """Kill ``proc`` if it still runs; its output."""
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out or ""


@contextlib.contextmanager
def two_nodes(
    model: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen, subprocess.Popen, str]]:
    """Leader (node 0, HTTP on a free port) and headless node 1, ready; both killed afterwards.

    NOTE: the ports are free when picked, not reserved: where another process binds one first
    (the leader then exits naming EADDRINUSE), both nodes start again on fresh ports, up to three times.
    """
    for attempt in range(3):
        master = free_port(consecutive=2)  # NOTE: the control channel takes P, torch.distributed's store P+1
        http = free_port()
        while http in (master, master + 1):
            http = free_port()
        leader_cmd = [*serve_command(model, http), "--served-model-name", "tiny", "--log-level", "warning", *ENGINE]
        leader_cmd += node_flags(master, 0)
        worker_cmd = [*serve_command(model, 0)[:-4], "--log-level", "info", *ENGINE, "--headless"]
        worker_cmd += node_flags(master, 1)
        leader = start(leader_cmd, env)
        worker = start(worker_cmd, env)
        try:
            try:
                wait_ready(f"http://127.0.0.1:{http}", timeout=240, proc=leader)
            except RuntimeError as error:
                if "EADDRINUSE" in str(error) and attempt < 2:
                    continue  # the finally below stops both nodes
                raise
            yield leader, worker, f"http://127.0.0.1:{http}"
            return
        finally:
            for proc in (worker, leader):
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate(timeout=30)


def complete(url: str) -> dict:
    body = {"model": "tiny", "prompt": [5, 9, 2, 7, 1, 3], "max_tokens": 8, "temperature": 0, "logprobs": 2}
    response = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]


def test_two_nodes_answer_as_one_rank_does(model):
    with serve_process(model, *ENGINE, env=ENV) as (_, url):
        one = complete(url)
    with two_nodes(model) as (_, _, url):
        two = complete(url)
        assert httpx.get(f"{url}/health").status_code == 200
    assert two["text"] == one["text"]
    assert two["logprobs"]["tokens"] == one["logprobs"]["tokens"]
    for a, b in zip(two["logprobs"]["token_logprobs"], one["logprobs"]["token_logprobs"]):
        assert a == pytest.approx(b, abs=1e-4)


def test_a_killed_worker_node_ends_the_leader_naming_node_and_rank(model):
    with two_nodes(model) as (leader, worker, url):
        worker.kill()
        assert leader.wait(timeout=60) != 0
        out = stop(leader)
    assert "rank 1 on node 1" in out and "closed its connection" in out, out[-3000:]


def test_the_leader_answers_503_on_health_once_a_worker_node_is_gone(model):
    """The leader's engine runs in this process here, so /health can be read after the failure too."""
    master = free_port(consecutive=2)
    worker = start([*serve_command(model, 0)[:-4], *ENGINE, "--headless", *node_flags(master, 1)])
    try:
        layout = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=master)
        with live_server(model, block_size=8, **layout) as server:
            assert httpx.get(f"{server.url}/health").status_code == 200
            worker.kill()
            deadline = time.monotonic() + 30
            while httpx.get(f"{server.url}/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503
            assert "rank 1 on node 1" in health.json()["error"]["message"]
    finally:
        stop(worker)


def test_a_hung_rank_on_another_node_is_named_and_stopped(model, monkeypatch):
    from pagedllm.server import LLM, SamplingParams
    from pagedllm.server.engine.faults import EngineFatalError

    monkeypatch.setenv("PAGEDLLM_TP_HANG_TIMEOUT", "3")
    monkeypatch.setenv(FAULTS_ENV, "hang=1")  # rank 1 (on node 1) hangs in its first step
    master = free_port(consecutive=2)
    worker = start([*serve_command(model, 0)[:-4], *ENGINE, "--headless", *node_flags(master, 1)])
    try:
        layout = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=master)
        with LLM(model=model, block_size=8, num_gpu_blocks_override=64, worker_cls=WORKER, **layout) as llm:
            engine = llm.llm_engine
            engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))
            with pytest.raises(EngineFatalError, match=r"did not finish within 3s \(still in it: rank 1 on node 1\)"):
                while engine.has_unfinished_requests():
                    engine.step()
        assert worker.wait(timeout=30) == 1  # told to stop by the leader
    finally:
        out = stop(worker)
    assert "stopped this rank" in out, out[-3000:]


def test_a_killed_leader_ends_the_worker_node(model):
    with two_nodes(model) as (leader, worker, _):
        leader.kill()
        assert worker.wait(timeout=60) != 0
        out = stop(worker)
    assert "the leader at 127.0.0.1" in out and "closed the connection" in out, out[-3000:]


def test_a_node_that_never_joins_is_named(model):
    master = free_port(consecutive=2)
    http = free_port()
    cmd = [*serve_command(model, http), *ENGINE, *node_flags(master, 0)]
    leader = start(cmd, {"PAGEDLLM_TP_JOIN_TIMEOUT": "3"})
    try:
        assert leader.wait(timeout=120) != 0
    finally:
        out = stop(leader)
    assert "node 1 (ranks 1) did not join within 3s" in out, out[-3000:]


@pytest.mark.parametrize(
    "kwargs, field, text",
    [
        (dict(tensor_parallel_size=2, nnodes=3), "nnodes", "a divisor of tensor_parallel_size=2"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank", "must be >= 0 and <= 1"),
        (dict(nnodes=0), "nnodes", "must be >= 1"),
        (dict(master_port=70000), "master_port", "<= 65534"),
    ],
)
def test_bad_layouts_are_refused_naming_the_value(kwargs, field, text):
    with pytest.raises(ConfigError, match=text) as info:
        EngineConfig.from_kwargs(**kwargs)
    assert info.value.field == field


def test_node_roles_are_checked():
    worker = EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2, node_rank=1)
    check_node_role(worker, headless=True)
    with pytest.raises(ConfigError, match="--node-rank=1 needs --headless") as info:
        check_node_role(worker, headless=False)
    assert info.value.field == "node_rank"
    with pytest.raises(ConfigError, match="--node-rank=0 cannot be headless: --node-rank 1..1 with --headless"):
        check_node_role(EngineConfig.from_kwargs(tensor_parallel_size=2, nnodes=2), headless=True)


def test_the_cli_shows_a_bad_layout_under_its_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--tensor-parallel-size", "2", "--nnodes", "3"])
    assert info.value.code == 2
    assert "--nnodes=3 is not allowed: a divisor of tensor_parallel_size=2" in capsys.readouterr().err
