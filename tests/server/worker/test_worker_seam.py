"""The worker runs the steps the engine builds: it never reads a scheduler output, a sequence or a block table.

Dependencies point one way (``worker`` <- ``engine``), so nothing under ``server/worker`` may
import the scheduler's or the engine's modules; the step arrives as a
:class:`~pagedllm.server.worker.model_step.ModelStep` of tensors.
"""

from __future__ import annotations

import ast
import pathlib

import torch

from pagedllm.server.worker.attention import AttentionMetadata
from pagedllm.server.worker.model_step import ModelStep

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
