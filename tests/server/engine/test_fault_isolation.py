"""One failing request never takes the engine down; a failing model step fails only its requests.

Faults are injected by a test double of the worker (:mod:`fault_doubles`): the engine has no fault hooks.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from api_factories import MODEL_NAME, live_server, serve_process, wait_until_idle
from fault_doubles import FAULTS_ENV, WORKER, Faults

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.engine.faults import EngineFatalError, StepFailureWindow
from pagedllm.server.entrypoints.openai.api_server import ServerSettings
from tests.support import assert_all_blocks_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(5 + i)] for i in range(20)]


def run_all(llm: LLM, ids: list[str], params: SamplingParams = GREEDY) -> dict:
    engine = llm.llm_engine
    for request_id, prompt in zip(ids, PROMPTS):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


@pytest.fixture
def llm(tiny_llama):
    return LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=256, enable_prefix_caching=False)


@pytest.fixture
def faulty_llm(tiny_llama, monkeypatch):
    """An LLM whose worker fails by ``rules`` (see :mod:`fault_doubles`)."""

    def make(rules: str) -> LLM:
        monkeypatch.setenv(FAULTS_ENV, rules)
        return LLM(
            model=tiny_llama, block_size=8, num_gpu_blocks_override=256, enable_prefix_caching=False, worker_cls=WORKER
        )

    return make


@pytest.fixture
def reference(tiny_llama):
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    outputs = run_all(LLM(model=tiny_llama, block_size=8, num_gpu_blocks_override=256), ids)
    return [outputs[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize("where", ["request", "sampler"])
def test_a_raising_request_fails_alone(faulty_llm, reference, where):
    llm = faulty_llm(f"{where}=poison")
    ids = [f"poison-{i}" if i == 7 else f"ok-{i}" for i in range(len(PROMPTS))]
    outputs = run_all(llm, ids)
    assert "injected fault" in outputs["poison-7"].error
    for i, request_id in enumerate(ids):
        if i != 7:
            assert outputs[request_id].error is None
            assert outputs[request_id].outputs[0].token_ids == reference[i], request_id
    assert_all_blocks_free(llm)


def test_a_failed_model_step_fails_its_requests_and_the_engine_goes_on(faulty_llm, reference):
    llm = faulty_llm("step=3")
    ids = [f"a{i}" for i in range(len(PROMPTS))]
    outputs = run_all(llm, ids)
    failed = [i for i in ids if outputs[i].error is not None]
    assert failed and all("model step failed" in outputs[i].error for i in failed)
    assert_all_blocks_free(llm)
    again = run_all(llm, [f"b{i}" for i in range(len(PROMPTS))])  # the engine still serves, correctly
    assert [again[f"b{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    assert_all_blocks_free(llm)


def test_repeated_step_failures_are_fatal(faulty_llm):
    llm = faulty_llm("step=1+")
    with pytest.raises(EngineFatalError, match="3 model steps failed"):
        for round_ in range(3):
            run_all(llm, [f"x{round_}-{i}" for i in range(2)])


def test_failure_window_forgets_old_failures():
    now = [0.0]
    window = StepFailureWindow(max_failures=3, window_s=60, clock=lambda: now[0])
    for t in (0, 30, 91, 120):  # never three within 60 s
        now[0] = t
        window.record(RuntimeError("x"))
    now[0] = 125
    with pytest.raises(EngineFatalError):
        window.record(RuntimeError("x"))


def test_broken_bookkeeping_is_reported(llm):
    bm = llm.llm_engine.block_manager
    assert bm.check_invariants() == []
    bm.gpu.ref_counts[0] = 2
    problems = bm.check_invariants()
    assert any("block 0 has 2 references but 0 tables hold it" in p for p in problems), problems


def test_fault_rules_parse_and_reject_nonsense():
    rules = Faults.parse("request=bad,step=4+,hang=1")
    assert rules == Faults(request="bad", first_step=4, every_step_after=True, hang_rank=1)
    with pytest.raises(ValueError, match=FAULTS_ENV):
        Faults.parse("explode=now")


# -- over HTTP ------------------------------------------------------------------------------------------
def test_one_poisoned_request_among_20_over_http(tiny_llama, monkeypatch):
    settings = ServerSettings(served_model_names=[MODEL_NAME])

    def complete_all(http: httpx.Client, poison: int | None) -> list[httpx.Response]:
        def one(i: int) -> httpx.Response:
            request_id = f"poison-{i}" if i == poison else f"req-{i}-{poison}"
            body = {"model": MODEL_NAME, "prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            return http.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            return list(pool.map(one, range(20)))

    with live_server(tiny_llama, settings) as clean, httpx.Client(base_url=clean.url, timeout=120) as http:
        expected = [r.json()["choices"][0]["text"] for r in complete_all(http, None)]
    monkeypatch.setenv(FAULTS_ENV, "request=poison")
    poisoned = live_server(tiny_llama, settings, worker_cls=WORKER)
    with poisoned as server, httpx.Client(base_url=server.url, timeout=120) as http:
        responses = complete_all(http, poison=7)
        assert responses[7].status_code == 500
        error = responses[7].json()["error"]
        assert error["type"] == "internal_server_error" and "poison-7" in error["message"]
        for i, response in enumerate(responses):
            if i != 7:
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == expected[i]
        stream = http.post(
            "/v1/completions",
            json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 8, "stream": True},
            headers={"X-Request-Id": "poison-stream"},
        )
        assert '"internal_server_error"' in stream.text and stream.text.rstrip().endswith("data: [DONE]")
        assert http.get("/health").status_code == 200
        stats = wait_until_idle(server)
        assert stats.blocks_used == 0 and stats.num_free_gpu_blocks == stats.num_gpu_blocks


def test_repeated_step_failures_end_the_server_with_a_non_zero_exit(tiny_llama):
    with serve_process(tiny_llama, "--worker-cls", WORKER, env={FAULTS_ENV: "step=3+"}) as (proc, url):
        with httpx.Client(base_url=url, timeout=30) as http:
            deadline = time.monotonic() + 60
            while proc.poll() is None and time.monotonic() < deadline:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
                try:
                    http.post("/v1/completions", json=body)
                    health = http.get("/health")
                except httpx.HTTPError:
                    break  # the server went away
                if health.status_code == 503:
                    assert "model steps failed" in health.json()["error"]["message"]
        assert proc.wait(timeout=60) != 0
        assert "model steps failed" in proc.stdout.read()


def test_repeated_step_failures_turn_health_503_with_the_reason(tiny_llama, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "step=3+")
    settings = ServerSettings(served_model_names=[MODEL_NAME])
    failing = live_server(tiny_llama, settings, worker_cls=WORKER)
    with failing as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        statuses = set()
        for _ in range(3):  # each request dies with its failed step; the third failure is fatal
            response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4})
            statuses.add(response.status_code)
        assert statuses <= {500, 503}
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        health = http.get("/health")
        assert health.status_code == 503 and "3 model steps failed" in health.json()["error"]["message"]
