"""The worker runs the steps the engine builds: it never reads a scheduler output, a sequence or a block table.

Dependencies point one way (``worker`` <- ``engine``), so nothing under ``server/worker`` may
import the scheduler's or the engine's modules; the step arrives as a
:class:`~pagedllm.server.worker.model_step.ModelStep` of tensors.
"""

from __future__ import annotations

import ast
import pathlib
import pickle

import numpy as np
import torch

from pagedllm.server.worker.attention import AttentionMetadata
from pagedllm.server.worker.model_step import ModelStep
from pagedllm.server.worker.sampling_batch import PromptScoring, RowSampling, SamplingBatch

WORKER = pathlib.Path(__file__).resolve().parents[3] / "server" / "worker"
FORBIDDEN = ("pagedllm.server.core", "pagedllm.server.engine", "pagedllm.server.entrypoints")


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
        str(path.relative_to(WORKER)): sorted(m for m in imported_modules(path) if m.startswith(FORBIDDEN))
        for path in files
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_a_model_step_survives_the_wire_to_the_other_ranks():
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3, 9], dtype=torch.int64),
        num_decode_tokens=2,
        decode_block_tables=torch.tensor([[0], [2]], dtype=torch.int32),
        decode_context_lens=torch.tensor([4, 2], dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    ids = torch.tensor([7, 8])
    step = ModelStep([(1, 0)], [], [(2, 5)], ids, torch.tensor([3, 1]), meta, torch.tensor([0, 1]), None)
    back = ModelStep.from_wire(step.to_wire())
    assert back.swap_out == [(1, 0)] and back.copies == [(2, 5)] and back.prompt_index is None
    assert torch.equal(back.input_ids, ids) and torch.equal(back.meta.decode_block_tables, meta.decode_block_tables)
    assert back.meta.num_decode_tokens == 2


def test_a_step_s_sampling_batch_survives_the_wire_by_value():
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3], dtype=torch.int64),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([[0]], dtype=torch.int32),
        decode_context_lens=torch.tensor([4], dtype=torch.int32),
        prefill_block_tables=torch.zeros(0, 0, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    row = RowSampling(
        "r", temperature=0.5, seed=3, output_token_ids=np.array([1, 2]), allowed=np.zeros(2, dtype=np.int32)
    )
    batch = SamplingBatch([row], 1, [], [PromptScoring("r", (5,), 1)], ["gone"])
    step = ModelStep([], [], [], torch.tensor([7]), torch.tensor([3]), meta, torch.tensor([0]), None, sampling=batch)
    back = ModelStep.from_wire(pickle.loads(pickle.dumps(step.to_wire())))
    assert back.sampling is not None and back.sampling.prompts == batch.prompts
    assert back.sampling.finished_request_ids == ["gone"] and back.sampling.rows[0].seed == 3
    assert np.array_equal(back.sampling.rows[0].output_token_ids, [1, 2])
    assert not any(isinstance(v, torch.Tensor) for v in vars(back.sampling.rows[0]).values())
