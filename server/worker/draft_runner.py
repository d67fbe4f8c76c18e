"""The draft model of ``draft_model`` speculation on the driver's worker: a smaller checkpoint
with the target's vocabulary, its own weights and its own paged KV cache, in the target's block ids
(see :mod:`pagedllm.server.engine.spec_decode.draft_model` for how the engine keeps it current).

The draft runs on the driver's device alone (tensor parallelism applies to the target),
greedy, in the target's dtype and load format; its forward passes are chunked-prefill
shaped (every row a chunk over cached context), so every attention backend runs them.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedllm.server.config import ConfigError, EngineConfig, LoRAConfig, SpeculativeConfig
from pagedllm.server.hf_config import read_hf_config
from pagedllm.server.worker.attention import AttentionMetadata
from pagedllm.server.worker.model_runner import ModelRunner


class DraftRunner:
    """The draft's weights and KV cache, and its batched greedy forward over sequence chunks."""

    def __init__(
        self, config: EngineConfig, spec: SpeculativeConfig, target_vocab: int, max_model_len: int, dtype: torch.dtype
    ) -> None:
        assert spec.model is not None  # NOTE: SpeculativeConfig requires it for draft_model
        self.path = spec.model
        hf_config = read_hf_config(spec.model)
        vocab = hf_config.get("vocab_size")
        if vocab != target_vocab:
            raise ConfigError(
                "speculative_config.model",
                spec.model,
                f"a draft model shares the target's tokenizer: its vocabulary has {vocab} tokens, "
                f"the target's {target_vocab}",
                problem="has another vocabulary",
            )
        name = str(dtype).removeprefix("torch.")  # NOTE: the target's, also where the target chose it (auto)
        model = dataclasses.replace(config.model, model=spec.model, tokenizer=None, dtype=name)
        parallel = dataclasses.replace(config.parallel, tensor_parallel_size=1)
        draft_config = dataclasses.replace(config, model=model, parallel=parallel, lora=LoRAConfig())
        self.runner = ModelRunner(draft_config, hf_config, max_model_len)
        self.block_size = self.runner.block_size

    @property
    def block_bytes(self) -> int:
        return self.runner.block_bytes

    def allocate(self, num_blocks: int) -> None:
        """The draft's cache: as many blocks as the target's device cache, none on the host (and
        no CUDA graphs: those are for decode steps, the draft runs chunk-shaped passes)."""
        self.runner.allocate_local_cache(num_blocks, 0)

    def shutdown(self) -> None:
        self.runner.shutdown()

    @torch.inference_mode()
    def next_tokens(self, chunks: list[tuple[list[int], int, list[int]]]) -> list[int]:
        """The draft's greedy token after each chunk, writing the chunks' K/V into its cache.

        ``chunks``: per sequence, (token ids, position of the first, block table); the
        table must hold a slot for every position up to the chunk's end.
        """
        runner, bs = self.runner, self.block_size
        device = runner.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu, lens = [0], []
        for tokens, start, table in chunks:
            end = start + len(tokens)
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + len(tokens))
            lens.append(end)
        width = max(len(table) for _, _, table in chunks)
        tables = torch.zeros((len(chunks), width), dtype=torch.int32)
        for row, (_, _, table) in enumerate(chunks):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        tables = tables.to(device)
        meta = AttentionMetadata.prefills(
            torch.tensor(slots, dtype=torch.int64, device=device),
            tables,
            torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor(lens, dtype=torch.int32, device=device),
        )
        meta = runner.ops.prepare(meta, bs)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
        hidden = runner.model(
            ids_t, torch.tensor(positions, dtype=torch.int64, device=device), runner.kv_caches, meta, runner.ops
        )
        last = torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1
        return runner.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
