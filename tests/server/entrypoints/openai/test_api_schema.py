"""Schemathesis over the server's own OpenAPI schema: every operation it declares, valid and invalid inputs.

Whatever operations the schema has are fuzzed, so a new endpoint is covered as soon as it is
routed. Checks: no 5xx (``not_a_server_error``), responses of a declared status have the
declared content type and body schema, and every 4xx is an OpenAI-shaped error.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from api_factories import API_KEY, MODEL_NAME, live_server, wait_until_idle
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance
from schemathesis.core.failures import FailureGroup

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]
# NOTE: small and seeded so a run is repeatable and short on one core;
# PAGEDLLM_FUZZ_EXAMPLES=200 (and PAGEDLLM_FUZZ_SEED) fuzz deeper locally.
EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("PAGEDLLM_FUZZ_SEED", "20240601"))
MODES = {GenerationMode.POSITIVE: EXAMPLES, GenerationMode.NEGATIVE: EXAMPLES}
# Operations every build serves; others (added endpoints) are fuzzed too, this is only a floor.
KNOWN_PATHS = {
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
    "/metrics",
    "/version",
}


@pytest.fixture(scope="module")
def server(tiny_llama):
    # NOTE: max_model_len stays small, so generated max_tokens cannot make a case slow.
    with live_server(tiny_llama, max_model_len=64) as s:
        yield s


@pytest.mark.timeout(300)
def test_every_operation_survives_valid_and_invalid_inputs(server):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{server.url}/openapi.json").json())
    operations = [op.ok() for op in schema.get_all_operations()]
    assert {op.path for op in operations} >= KNOWN_PATHS
    failures: list[str] = []
    answered: set[str] = set()
    for op in operations:
        for mode, examples in MODES.items():
            _fuzz(server.url, op, mode, examples, failures, answered)
    assert not failures, "\n\n".join(failures[:5])
    assert answered >= KNOWN_PATHS  # NOTE: valid bodies got through to the engine, not only to refusals
    stats = wait_until_idle(server)
    assert stats.num_running == 0 and stats.blocks_used == 0
    assert server.engine.is_alive


def _fuzz(url: str, op, mode: GenerationMode, examples: int, failures: list[str], answered: set[str]) -> None:
    @seed(SEED)
    @given(case=op.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def check(case) -> None:
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) and case.body.get("model") is not None:
            case.body["model"] = MODEL_NAME  # NOTE: else nearly every valid body stops at 404, short of the engine
        response = case.call(base_url=url, headers=AUTH, timeout=60)
        if response.status_code < 300:
            answered.add(op.path)
        try:
            case.validate_response(response, checks=CHECKS)
            if 400 <= response.status_code < 500:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, error
        except (AssertionError, FailureGroup) as exc:
            failures.append(f"{op.label} [{mode.value}] {response.status_code}: {exc}\n  body: {case.body!r:.300}")

    try:
        check()
    except Unsatisfiable:
        assert mode == GenerationMode.NEGATIVE  # operations without inputs have no invalid ones
