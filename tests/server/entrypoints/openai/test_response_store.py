"""The bounded store behind ``previous_response_id``: least recently used out first, and its flag."""

from __future__ import annotations

import pytest

from pagedllm.server.entrypoints import serve
from pagedllm.server.entrypoints.cli import build_parser
from pagedllm.server.entrypoints.openai.protocol_responses import InputMessage, ResponsesResponse
from pagedllm.server.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.server.entrypoints.openai.settings import DEFAULT_RESPONSES_STORE_SIZE


def stored(response_id: str) -> StoredResponse:
    response = ResponsesResponse(id=response_id, status="completed", model="m")
    return StoredResponse(response, [InputMessage(role="user", content=response_id)])


def test_the_least_recently_used_response_goes_first():
    store = ResponseStore(capacity=2)
    store.put(stored("a"))
    store.put(stored("b"))
    assert store.get("a") is not None  # NOTE: a is now the most recently used
    store.put(stored("c"))
    assert store.get("b") is None and len(store) == 2
    assert [store.get(i).conversation[0].content for i in ("a", "c")] == ["a", "c"]
    store.put(stored("d"))  # c was read after a: a goes
    assert store.get("a") is None and store.get("c") is not None and store.get("d") is not None


def test_storing_again_refreshes_instead_of_duplicating():
    store = ResponseStore(capacity=2)
    for response_id in ("a", "b", "a", "c"):
        store.put(stored(response_id))
    assert len(store) == 2 and store.get("b") is None and store.get("a") is not None


def test_capacity_zero_keeps_nothing():
    store = ResponseStore(capacity=0)
    store.put(stored("a"))
    assert store.get("a") is None and len(store) == 0


def test_the_flag_sets_the_capacity_and_refuses_negative_sizes():
    parse = build_parser().parse_args
    assert serve.settings_from_args(parse(["serve"])).responses_store_size == DEFAULT_RESPONSES_STORE_SIZE
    assert serve.settings_from_args(parse(["serve", "--responses-store-size", "7"])).responses_store_size == 7
    with pytest.raises(ValueError, match=r"^--responses-store-size=-1 is out of range"):
        serve.settings_from_args(parse(["serve", "--responses-store-size", "-1"]))
