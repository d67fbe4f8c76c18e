"""What crosses to the workers for a step: the scheduler's frozen, id-keyed output, nothing else.

The executor hands rank 0 (in this process) the output with its sampling batch and the other
tensor-parallel ranks the same output without it; every rank builds its arrays itself.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedllm.server.core.scheduler_output import CachedSeqs, NewSeqData, SchedulerOutput
from pagedllm.server.executor import Executor
from pagedllm.server.worker.model_step import StepOutputs
from pagedllm.server.worker.sampling_batch import RowSampling, SamplingBatch
from pagedllm.server.worker.worker import LocalWorker


class Runner:
    def __init__(self) -> None:
        self.steps: list = []

    def execute(self, out):
        self.steps.append(out)
        return StepOutputs(None, None)


class Remote:
    """The other ranks, as the executor sees them; keeps what went over the wire (pickled)."""

    def __init__(self) -> None:
        self.wire: list[bytes] = []

    def send(self, message: tuple) -> None:
        self.wire.append(pickle.dumps(message))

    def step_started(self) -> None: ...

    def step_ended(self) -> None: ...


def test_every_rank_gets_the_frozen_output_and_only_rank0_its_sampling():
    executor = Executor.__new__(Executor)
    runner, remote = Runner(), Remote()
    executor.local = LocalWorker(runner)  # type: ignore[arg-type]
    executor.remote = remote  # type: ignore[assignment]
    executor.workers = [executor.local, remote]
    plan = SchedulerOutput(
        new_seqs=(NewSeqData(3, (1, 2, 3), (7,), 0),),
        cached_seqs=CachedSeqs((5,), ((9,),), ((),), (False,), (4,)),
        scheduled_seq_ids=(5, 3),
        num_scheduled_tokens=(1, 3),
        num_decodes=1,
        sample_seq_ids=(5, 3),
    ).with_sampling(SamplingBatch([RowSampling("a"), RowSampling("b")], 2, [], [], []))
    executor.execute(plan)
    assert runner.steps == [plan] and runner.steps[0].sampling is not None
    (message,) = [pickle.loads(raw) for raw in remote.wire]
    kind, sent = message
    assert kind == "step" and type(sent) is SchedulerOutput
    assert sent == dataclasses.replace(plan, sampling=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sent.num_decodes = 2  # type: ignore[misc]
