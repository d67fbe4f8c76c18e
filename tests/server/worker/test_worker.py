"""Every rank answers the executor's messages the same way; the class a rank runs is checked at the edge."""

from __future__ import annotations

import pytest

from pagedllm.server.config import ConfigError, ParallelConfig
from pagedllm.server.worker.model_runner import ModelRunner
from pagedllm.server.worker.worker import REPLIES, LocalWorker, handle, worker_class


class Recorder:
    """Stands in for a model runner: notes each call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.calls.append((name, *args)) or len(self.calls)


def test_each_message_reaches_its_method_and_only_block_counts_are_answered():
    runner = Recorder()
    for message in [("device_blocks", 10), ("host_blocks", 4), ("allocate", 8, 2), ("step", "the step")]:
        handle(runner, message)  # type: ignore[arg-type]
    assert runner.calls == [
        ("device_blocks", 10),
        ("host_blocks", 4),
        ("allocate_cache", 8, 2),
        ("execute", "the step"),
    ]
    assert REPLIES == {"device_blocks", "host_blocks"}
    with pytest.raises(ValueError, match="unknown worker message 'inject_fault'"):
        handle(runner, ("inject_fault", "die"))  # type: ignore[arg-type]


def test_the_local_worker_runs_a_message_when_its_answer_is_collected():
    runner = Recorder()
    local = LocalWorker(runner)  # type: ignore[arg-type]
    message = ("device_blocks", 3)
    local.send(message)
    assert runner.calls == []  # NOTE: the other ranks get the message first and start at once
    assert local.collect(message) == [1] and runner.calls == [("device_blocks", 3)]


def test_the_worker_class_is_the_model_runner_or_a_named_subclass():
    assert worker_class("auto") is ModelRunner
    assert issubclass(worker_class("tests.server.fault_doubles:FaultyWorker"), ModelRunner)
    with pytest.raises(ConfigError, match="a subclass of ModelRunner"):
        worker_class("json:JSONDecoder")
    with pytest.raises(ConfigError, match="importable module:Class"):
        worker_class("no_such_module_here:Worker")
    with pytest.raises(ConfigError, match="auto or module:Class"):
        ParallelConfig(worker_cls="just a name")
