"""Asynchronous scheduling (``async_scheduling``): the engine schedules and launches the next step
before it processes the outputs of the step in flight, so on a GPU the host's work (scheduling,
input preparation, output processing) runs while the device computes::

    step() k:    schedule N+1 ahead ─► launch N+1 ─► wait for N ─► process N ─► N's outputs
    step() k+1:  schedule N+2 ahead ─► launch N+2 ─► wait for N+1 ─► process N+1 ─► ...

Scheduling ahead gives each sequence that samples in step N a placeholder for its token
(:mod:`~pagedllm.server.core.lookahead`); the worker fills it in from the ids it sampled, on
its device. One thread of the executor runs the steps in order (:meth:`Executor.submit`).

Steps fall back to running in turn (step N processed before step N+1 is scheduled, N+1 still
launched before ``step()`` returns) when step N holds a request that cannot be followed ahead
(:func:`~pagedllm.server.core.lookahead.follows`: beams, ``n > 1``, penalties, grammars,
prompt logprobs, ``min_tokens`` not met, embeddings) or when the cache might not hold every
running sequence's next token (lookahead never preempts). Speculative decoding turns it off
altogether (the engine runs every step in turn).

On a GPU "launch" queues the step's kernels and the copy of its sampled ids to page-locked
host memory, and "wait for N" waits for that copy alone (:meth:`Executor.submit`): step N+1 is
on the stream before N's tokens are read, so the device does not idle while the host works.

Rules that keep the outputs those of steps run in turn:

- a request finished by step N (stop, length, failure) gets nothing from step N+1: its rows
  are dropped when step N+1 is processed; its blocks were freed when step N was;
- :meth:`LLMEngine.abort_request` first processes the step in flight (:meth:`drain`), so no
  request is aborted under a running step; the outputs of that step wait for the next ``step()``;
- a failed step fails the step launched after it too (it ran on what the failed one left).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.server.core.lookahead import can_follow, schedule_ahead
from pagedllm.server.core.scheduler import ScheduledStep
from pagedllm.server.core.sequence import Sequence
from pagedllm.server.engine.faults import EngineFatalError
from pagedllm.server.engine.step_end import collect_outputs, step_failed
from pagedllm.server.engine.step_inputs import PoolRow, SampleRow, SpecRow, StepInputs, StepResult
from pagedllm.server.executor import WorkerDiedError
from pagedllm.server.outputs import EngineOutput
from pagedllm.server.worker.model_step import LaunchedStep, StepOutputs

if TYPE_CHECKING:
    from pagedllm.server.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedllm.engine")


@dataclass
class InFlight:
    """A launched step, until its outputs are processed."""

    out: ScheduledStep
    inputs: StepInputs | None = None
    future: Future[LaunchedStep] | None = None
    """Its outputs (None: nothing was launched: an empty step, or its inputs failed)."""
    error: Exception | None = None
    """Why it failed: its inputs could not be built (then nothing was launched), or the step before
    it failed (then it ran on what that step left, and fails without counting as a failure of its own)."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests whose sampling rows could not be described."""
    advanced: bool = False
    """Its chunks were counted as computed when the step after it was scheduled ahead."""
    placeholders: list[Sequence] = field(default_factory=list)
    """Sequences given a placeholder for the token this step samples."""


class AsyncSteps:
    """The step in flight and what :meth:`LLMEngine.step` does with ``async_scheduling`` on.

    NOTE: holds no reference to the engine: each call gets it as an argument.
    """

    def __init__(self) -> None:
        self.in_flight: InFlight | None = None
        self._ready: list[EngineOutput] = []
        """Outputs of a step processed between two ``step()`` calls (:meth:`drain`)."""
        self.num_ahead = 0
        """Steps scheduled while the step before them ran (the rest were scheduled in turn)."""

    @property
    def busy(self) -> bool:
        """Whether a step is in flight or outputs wait: ``step()`` has more to return."""
        return self.in_flight is not None or bool(self._ready)

    def step(self, engine: LLMEngine) -> list[EngineOutput]:
        """Schedule and launch the next step (ahead when it can be), then process the one in flight."""
        outputs, self._ready = self._ready, []
        prev, self.in_flight = self.in_flight, None
        out = None
        if prev is not None and prev.future is not None and prev.error is None and can_follow(prev.out):
            samplers = [(row.group, row.seq) for row in prev.inputs.sample_rows] if prev.inputs else []
            engine.scheduler.updater.advance(prev.out)
            prev.advanced = True
            out, prev.placeholders = schedule_ahead(engine.scheduler, samplers, engine.max_model_len)
            self.num_ahead += out is not None
        if out is None:
            if prev is not None:
                outputs += self._finish(engine, prev)
                prev = None
            out = engine.scheduler.schedule()
        launched = self._launch(engine, out)
        if prev is not None:
            outputs += self._finish(engine, prev, launched)
        if launched.future is None:
            outputs += self._finish(engine, launched)
        else:
            self.in_flight = launched
        return outputs

    def drain(self, engine: LLMEngine, dropped: Iterable[str] = ()) -> None:
        """Process the step in flight now (its outputs wait for the next ``step()``), leaving out
        the outputs of the requests ``dropped``."""
        if self.in_flight is not None:
            rec, self.in_flight = self.in_flight, None
            self._ready += self._finish(engine, rec)
        gone = set(dropped)
        if gone:
            self._ready = [o for o in self._ready if o.request_id not in gone]

    def _launch(self, engine: LLMEngine, out: ScheduledStep) -> InFlight:
        """Build the step's inputs and hand it to the executor's step thread."""
        rec = InFlight(out)
        if out.is_empty:
            return rec
        engine.count_step()
        try:
            inputs, plan = engine.step_builder.build(out)
            plan = plan.with_sampling(engine.sampling_rows.build(inputs, rec.failed))
            rec.inputs = inputs
            rec.future = engine.executor.submit(plan)
        except Exception as exc:
            rec.error = exc
        return rec

    def _finish(self, engine: LLMEngine, rec: InFlight, successor: InFlight | None = None) -> list[EngineOutput]:
        """Wait for ``rec``'s outputs and process them as a step run in turn would (its requests
        that finished meanwhile left out); a failure also fails ``successor``."""
        engine.scheduler.updater.drop_placeholders(rec.placeholders)
        out = _alive(rec.out)
        touched = {id(g): g for g in out.ignored}
        touched.update((id(item.group), item.group) for item in out.scheduled)
        alive = {g.request_id for g in touched.values()}
        failed = {request_id: why for request_id, why in rec.failed.items() if request_id in alive}
        updates = None
        if rec.future is not None or rec.error is not None:
            try:
                outputs = _wait(rec)
            except WorkerDiedError as exc:
                raise EngineFatalError(str(exc)) from exc
            except Exception as exc:
                followed_a_failure = rec.future is not None and rec.error is not None
                step_failed(engine, out, exc, failed, touched, record=not followed_a_failure)
                if successor is not None and successor.future is not None and successor.error is None:
                    successor.error = RuntimeError(f"the step before it failed: {exc!r}")
            else:
                assert rec.inputs is not None and outputs is not None
                result = _alive_result(StepResult.of(rec.inputs, outputs))
                updates = engine.step_results.decide(result, failed)
        engine.scheduler.update_from_output(out, updates, failed, rec.advanced)
        return collect_outputs(engine, touched, failed)


def _wait(rec: InFlight) -> StepOutputs | None:
    """The step's outputs once it has run and its tokens reached the host; its ``error`` if it has one
    (rather than what it raised)."""
    try:
        outputs = rec.future.result().outputs() if rec.future is not None else None
    except Exception:
        if rec.error is None:
            raise
    if rec.error is not None:
        raise rec.error
    return outputs


def _alive(out: ScheduledStep) -> ScheduledStep:
    """``out`` without the groups that finished since it was scheduled."""
    if not any(item.group.is_finished() for item in out.scheduled):
        return out
    return dataclasses.replace(out, scheduled=[item for item in out.scheduled if not item.group.is_finished()])


def _alive_result(result: StepResult) -> StepResult:
    """``result`` without the sample rows of requests that finished since the step was scheduled.

    NOTE: such a request was scheduled ahead as a plain decode (:func:`~pagedllm.server.core.lookahead.follows`):
    its only rows are sample rows.
    """
    rows = result.inputs.sample_rows
    keep = [i for i, row in enumerate(rows) if not row.group.is_finished()]
    if len(keep) == len(rows):
        return result
    inputs = result.inputs
    others: list[SampleRow | PoolRow | SpecRow] = [*inputs.prompt_rows, *inputs.pool_rows, *inputs.spec_rows]
    assert not any(row.group.is_finished() for row in others), "a request scheduled ahead only samples"
    kept_inputs = dataclasses.replace(inputs, sample_rows=[rows[i] for i in keep])
    sampled = result.sampled
    if sampled is not None:
        ids = {rows[i].group.request_id for i in keep} | {row.group.request_id for row in others}
        errors = {request_id: why for request_id, why in sampled.errors.items() if request_id in ids}
        sampled = dataclasses.replace(sampled, rows=[sampled.rows[i] for i in keep], errors=errors)
    return StepResult(kept_inputs, sampled, result.pooled)
