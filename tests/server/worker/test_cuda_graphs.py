"""CUDA graphs of the decode step: which batch sizes are captured, and on a GPU that graphed
steps give the tokens eager steps give (greedy, float32).

NOTE: float32 only. A graph's decode kernel splits the KV range by the full block-table
width, an eager step's by the step's widest table, so the two add their partial sums in a
different order; in bfloat16 that may flip a near-tie, which is no fault of the graphs."""

from __future__ import annotations

import pytest
import torch
from engine_factories import make_prompts

from pagedllm.server import LLM, SamplingParams
from pagedllm.server.worker import cuda_graphs
from pagedllm.server.worker.cuda_graphs import capture_sizes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@pytest.mark.parametrize(
    ("max_rows", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (24, [1, 2, 4, 8, 16, 24]),
        (10_000, [1, 2, 4, *range(8, 512, 8), 512]),
    ],
)
def test_capture_sizes_cover_every_batch(max_rows, expected):
    assert capture_sizes(max_rows) == expected
    sizes = capture_sizes(max_rows)
    assert all(any(s >= rows for s in sizes) for rows in range(1, min(max_rows, 512) + 1))


def test_eager_is_an_engine_argument():
    from pagedllm.server.config import EngineConfig

    assert EngineConfig.from_kwargs(enforce_eager=True).model.enforce_eager
    assert not EngineConfig.from_kwargs().model.enforce_eager


def _generate(model_dir: str, prompts: list[list[int]], dtype: str, **engine_args) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=model_dir, device="cuda", dtype=dtype, block_size=16, max_num_seqs=32, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.gpu
@needs_cuda
def test_graphed_decode_gives_the_eager_tokens(tiny_llama, monkeypatch):
    replays: list[int] = []
    run = cuda_graphs.DecodeGraphs.run

    def counted(self, input_ids, positions, meta):
        replays.append(input_ids.numel())
        return run(self, input_ids, positions, meta)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", counted)
    # 37 requests through 32 rows: batches of every size as requests finish, padded to a graph's size
    prompts = make_prompts(37, min_len=1, max_len=90, seed=3)
    eager, want = _generate(tiny_llama, prompts, "float32", enforce_eager=True)
    assert eager.llm_engine.runner.graphs is None and not replays
    eager.shutdown()
    graphed, got = _generate(tiny_llama, prompts, "float32")
    assert graphed.llm_engine.runner.graphs is not None
    assert replays and any(r not in graphed.llm_engine.runner.graphs.sizes for r in replays), replays
    assert got == want
    graphed.shutdown()


def test_no_graphs_off_cuda(tiny_llama):
    """Triton on the CPU (its interpreter) and the CPU backends run eagerly: graphs are CUDA's."""
    for backend in ("triton", "numba"):
        llm = LLM(model=tiny_llama, device="cpu", attention_backend=backend, num_gpu_blocks_override=16, cpu_threads=1)
        assert llm.llm_engine.runner.graphs is None
        llm.shutdown()
