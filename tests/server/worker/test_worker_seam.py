"""The worker runs the steps the scheduler sends: it never reads a sequence, a group or the block manager.

Dependencies point one way (``worker`` <- ``engine``), so nothing under ``server/worker`` may
import the scheduler's or the engine's modules, except the step contract itself
(:mod:`pagedllm.server.core.scheduler_output`: frozen plain data, importing nothing of core).
The step arrives as an id-keyed :class:`SchedulerOutput`; the worker's persistent batch makes
it a :class:`~pagedllm.server.worker.model_step.ModelStep` of host arrays, which each worker
makes tensors on its own device (:class:`~pagedllm.server.worker.device_step.DeviceStep`).
"""

from __future__ import annotations

import ast
import pathlib
import pickle

import numpy as np
import torch

from pagedllm.server.core.scheduler_output import SchedulerOutput
from pagedllm.server.worker.device_step import DeviceStep
from pagedllm.server.worker.model_step import ModelStep, StepAttention
from pagedllm.server.worker.sampling_batch import PromptScoring, RowSampling, SamplingBatch

WORKER = pathlib.Path(__file__).resolve().parents[3] / "server" / "worker"
FORBIDDEN = ("pagedllm.server.core", "pagedllm.server.engine", "pagedllm.server.entrypoints")
CONTRACT = "pagedllm.server.core.scheduler_output"


def imported_modules(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_worker_module_imports_the_scheduler_or_the_engine():
    files = sorted(WORKER.rglob("*.py"))
    assert len(files) > 10
    offenders = {
        str(path.relative_to(WORKER)): sorted(
            m for m in imported_modules(path) if m.startswith(FORBIDDEN) and m != CONTRACT
        )
        for path in files
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
    contract = pathlib.Path(__file__).resolve().parents[3] / "server" / "core" / "scheduler_output.py"
    assert not [m for m in imported_modules(contract) if m.startswith(FORBIDDEN)]


def test_a_model_step_survives_the_wire_to_the_other_ranks():
    meta = StepAttention(
        slot_mapping=np.array([3, 9], dtype=np.int64),
        num_decode_tokens=2,
        decode_block_tables=np.array([[0], [2]], dtype=np.int32),
        decode_context_lens=np.array([4, 2], dtype=np.int32),
        prefill_block_tables=np.zeros((0, 0), dtype=np.int32),
        prefill_cu_seqlens_q=np.zeros(1, dtype=np.int32),
        prefill_context_lens=np.zeros(0, dtype=np.int32),
    )
    ids = np.array([7, 8])
    step = ModelStep([(1, 0)], [], [(2, 5)], ids, np.array([3, 1]), meta, np.array([0, 1]), None)
    back = pickle.loads(pickle.dumps(step))
    assert back.swap_out == [(1, 0)] and back.copies == [(2, 5)] and back.prompt_index is None
    assert np.array_equal(back.input_ids, ids) and np.array_equal(back.meta.decode_block_tables, [[0], [2]])
    assert back.meta.num_decode_tokens == 2
    on_device = DeviceStep.of(back, torch.device("cpu"))
    assert torch.equal(on_device.input_ids, torch.tensor([7, 8]))
    assert on_device.meta.decode_block_tables.dtype == torch.int32 and on_device.meta.num_prefills == 0


def test_only_the_driver_gets_the_sampling_batch_and_it_pickles_by_value():
    row = RowSampling(
        "r", temperature=0.5, seed=3, output_token_ids=np.array([1, 2]), allowed=np.zeros(2, dtype=np.int32)
    )
    batch = SamplingBatch([row], 1, [], [PromptScoring("r", (5,), 1)], ["gone"])
    step = SchedulerOutput(scheduled_seq_ids=(4,), num_scheduled_tokens=(1,), num_decodes=1, sample_seq_ids=(4,))
    step = step.with_sampling(batch)
    assert step.for_other_ranks().sampling is None and step.for_other_ranks().scheduled_seq_ids == (4,)
    back = pickle.loads(pickle.dumps(step))
    assert back.sampling is not None and back.sampling.prompts == batch.prompts
    assert back.sampling.finished_request_ids == ["gone"] and back.sampling.rows[0].seed == 3
    assert np.array_equal(back.sampling.rows[0].output_token_ids, [1, 2])
    assert not any(isinstance(v, torch.Tensor) for v in vars(back.sampling.rows[0]).values())
