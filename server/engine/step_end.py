"""The end of a step, shared by the steps run in turn and those scheduled ahead
(:mod:`~pagedllm.server.engine.async_steps`): a failed model step, and the outputs of the
requests a step touched."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedllm.server.core.scheduler import ScheduledStep
from pagedllm.server.core.sequence import SequenceGroup, SequenceStatus
from pagedllm.server.outputs import EngineOutput
from pagedllm.server.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from pagedllm.server.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedllm.engine")
FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def step_failed(
    engine: LLMEngine,
    out: ScheduledStep,
    error: Exception,
    failed: dict[str, str],
    touched: dict[int, SequenceGroup],
    record: bool = True,
) -> None:
    """A model step that raised: every request in it fails (in ``failed``), the workers are reset.

    ``record``: count it towards the failures that make the engine give up (a step that failed only
    because the one before it did is not counted)."""
    logger.error("model step %d failed: %r", engine._num_steps, error, exc_info=error)
    engine.scheduler.worker_view.forget_all()  # NOTE: what the workers applied of the step is unknown
    for item in out.scheduled:
        failed[item.group.request_id] = f"the model step failed: {error!r}"
    # NOTE: groups swapped out for this step may hold host blocks that were never filled.
    for group in out.preempted:
        if any(seq.status == SequenceStatus.SWAPPED for seq in group.seqs):
            failed[group.request_id] = f"the model step that swapped it out failed: {error!r}"
            touched[id(group)] = group
    if record:
        engine.step_failures.record(error)


def collect_outputs(engine: LLMEngine, touched: dict[int, SequenceGroup], failed: dict[str, str]) -> list[EngineOutput]:
    """After the scheduler applied a step: the outputs of the requests it ``touched`` (a ``FINAL_ONLY``
    request's only once it ended); those that ended are forgotten."""
    if failed:
        engine._check_invariants()
    engine._publish_kv_events()
    outputs = []
    for group in touched.values():
        final_only = group.sampling_params.output_kind is FINAL_ONLY
        if final_only and not group.is_finished() and group.request_id not in failed:
            continue  # NOTE: no output built or sent for a step its caller would drop
        output = engine._output(group)
        output.error = failed.get(group.request_id)
        if output.finished:
            engine._forget(group)
        outputs.append(output)
    return outputs
