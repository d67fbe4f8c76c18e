"""The worker: owns the model and its KV cache, turns a scheduled step into tensors and runs it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedllm.server.config import EngineConfig, GiB
from pagedllm.server.core.scheduler import SchedulerOutput
from pagedllm.server.core.sequence import Sequence, SequenceGroup
from pagedllm.server.worker.attention import AttentionMetadata, select_attention_ops
from pagedllm.server.worker.cpu_threads import choose_threads
from pagedllm.server.worker.model_loader import checkpoint_dtype, init_dummy_weights, iterate_weights
from pagedllm.server.worker.models import model_class
from pagedllm.server.worker.models.base import CausalLM

logger = logging.getLogger(__name__)


@dataclass
class SampleRow:
    """A row of the step's logits: the sequence it belongs to and what it is for."""

    group: SequenceGroup
    seq: Sequence
    prompt_positions: list[int] = field(default_factory=list)  # prompt logprob rows: token indices scored


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: list[SampleRow]  # sequences that reach their end and sample a token
    sample_index: torch.Tensor  # [len(sample_rows)] token index of each row's last token
    prompt_rows: list[SampleRow]  # sequences that want prompt logprobs for this chunk
    prompt_index: torch.Tensor  # [sum of their positions] token indices whose logits score the prompt


@dataclass
class StepResult:
    inputs: StepInputs
    logits: torch.Tensor  # [len(inputs.sample_rows), vocab] float32
    prompt_logits: torch.Tensor | None  # [len(inputs.prompt_index), vocab] float32


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available: use 'cpu' or 'auto'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, hf_config: dict, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    dtype = checkpoint_dtype(hf_config)
    return torch.bfloat16 if dtype == torch.float32 else dtype


class ModelRunner:
    """Loads the model, allocates the KV cache and executes scheduled steps."""

    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int) -> None:
        self.config = config
        self.threads = choose_threads(config.parallel.cpu_threads)
        torch.set_num_threads(self.threads.threads)
        logger.info("torch uses %d CPU threads (%s)", self.threads.threads, self.threads.reason)
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, hf_config, self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.ops = select_attention_ops(config.model.attention_backend, self.device)
        self.model = self._load_model(hf_config)
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_shape
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _load_model(self, hf_config: dict) -> CausalLM:
        cls = model_class(hf_config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # NOTE: restored below; builds weights in place
        try:
            with torch.device(self.device):
                model = cls.from_hf_config(hf_config)
        finally:
            torch.set_default_dtype(previous)
        if self.config.model.load_format == "dummy":
            init_dummy_weights(model, self.config.model.seed)
        else:
            assert self.config.model.model is not None, "the engine resolves the model directory first"
            model.load_weights(iterate_weights(self.config.model.model, self.config.model.load_format))
        return model.eval()

    # -- KV cache -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_device_blocks(self, useful_blocks: int) -> int:
        """Blocks that fit: the override, the CPU budget, or what profiling leaves on the GPU."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type == "cuda":
            free_bytes = self._profile_cuda_free_bytes()
        else:
            free_bytes = int(cache.kv_cache_memory * GiB)
        blocks = min(free_bytes // self.block_bytes, useful_blocks)
        if blocks < 1:
            raise ValueError(
                f"no room for a single KV block of {self.block_bytes} bytes: raise "
                "gpu_memory_utilization / kv_cache_memory or use a smaller model"
            )
        return int(blocks)

    def num_host_blocks(self, useful_blocks: int) -> int:
        return int(min(self.config.cache.swap_space * GiB // self.block_bytes, useful_blocks))

    @torch.inference_mode()
    def _profile_cuda_free_bytes(self) -> int:
        """Run the largest step once and see what memory is left for the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.config.scheduler.token_budget, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        self.allocate_cache(blocks, 0)
        seq = Sequence(-1, [0] * tokens)
        table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, dtype=torch.int64, device=self.device),
            num_decode_tokens=0,
            decode_block_tables=table[:0],
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=self.device),
            prefill_block_tables=table,
            prefill_cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            prefill_context_lens=torch.tensor([tokens], dtype=torch.int32, device=self.device),
        )
        ids = torch.tensor(seq.token_ids, device=self.device)
        hidden = self.model(ids, torch.arange(tokens, device=self.device), self.kv_caches, meta, self.ops)
        self.model.compute_logits(hidden[-min(tokens, self.config.scheduler.max_num_seqs) :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.cache.gpu_memory_utilization - peak)

    def allocate_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        # Each layer: key and value caches [num_blocks, block_size, num_kv_heads, head_dim].
        shape = (self.block_size, self.num_kv_heads, self.head_dim)
        pin = self.device.type == "cuda"
        self.kv_caches = [
            (
                torch.zeros((num_device_blocks, *shape), dtype=self.dtype, device=self.device),
                torch.zeros((num_device_blocks, *shape), dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        # NOTE: host blocks are only ever read after being written by a swap-out.
        self.host_caches = [
            (
                torch.empty((num_host_blocks, *shape), dtype=self.dtype, pin_memory=pin),
                torch.empty((num_host_blocks, *shape), dtype=self.dtype, pin_memory=pin),
            )
            for _ in range(self.num_layers)
        ]

    # -- one step -----------------------------------------------------------------------
    def _move_blocks(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        if not pairs:
            return
        index = torch.tensor(pairs, dtype=torch.int64)
        src, dst = index[:, 0], index[:, 1]
        for device_kv, host_kv in zip(self.kv_caches, self.host_caches):
            for device_cache, host_cache in zip(device_kv, host_kv):
                if to_host:
                    host_cache[dst] = device_cache[src.to(self.device)].to("cpu", non_blocking=False)
                else:
                    device_cache[dst.to(self.device)] = host_cache[src].to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_tables: dict[int, list[int]]) -> StepResult:
        """Move and copy blocks as scheduled, then run the model on the step's tokens."""
        self._move_blocks(out.blocks_to_swap_out, to_host=True)
        self._move_blocks(out.blocks_to_swap_in, to_host=False)
        if out.blocks_to_copy:
            mapping = torch.tensor(out.blocks_to_copy, dtype=torch.int64, device=self.device)
            self.ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)
        inputs = self.prepare_inputs(out, block_tables)
        if inputs.input_ids.numel() == 0:
            return StepResult(inputs, torch.empty(0, 0), None)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, self.ops)
        logits = self.model.compute_logits(hidden[inputs.sample_index])
        prompt_logits = self.model.compute_logits(hidden[inputs.prompt_index]) if inputs.prompt_rows else None
        return StepResult(inputs, logits, prompt_logits)

    def prepare_inputs(self, out: SchedulerOutput, block_tables: dict[int, list[int]]) -> StepInputs:
        """Flatten the step: decodes first, then prefill chunks (see attention.py)."""
        decodes: list[tuple[SequenceGroup, Sequence, int]] = []
        prefills: list[tuple[SequenceGroup, Sequence, int]] = []
        for item in out.scheduled:
            for seq in item.group.seqs:
                chunk = item.chunks.get(seq.seq_id)
                if chunk:
                    (decodes if chunk == 1 else prefills).append((item.group, seq, chunk))
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[SampleRow] = []
        sample_index: list[int] = []
        prompt_rows: list[SampleRow] = []
        prompt_index: list[int] = []
        for group, seq, chunk in decodes + prefills:
            start = seq.num_computed_tokens
            table = block_tables[seq.seq_id]
            tokens = seq.token_ids
            offset = len(ids)
            ids.extend(tokens[start : start + chunk])
            positions.extend(range(start, start + chunk))
            slots.extend(
                table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, start + chunk)
            )
            if start + chunk == len(seq):
                sample_rows.append(SampleRow(group, seq))
                sample_index.append(offset + chunk - 1)
            if group.sampling_params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
                scored = [p for p in range(start, start + chunk) if p + 1 < len(seq.prompt_token_ids)]
                prompt_rows.append(SampleRow(group, seq, [p + 1 for p in scored]))
                prompt_index.extend(offset + p - start for p in scored)
        meta = self._metadata(decodes, prefills, block_tables, slots)
        device = self.device
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            meta=meta,
            sample_rows=sample_rows,
            sample_index=torch.tensor(sample_index, dtype=torch.int64, device=device),
            prompt_rows=prompt_rows,
            prompt_index=torch.tensor(prompt_index, dtype=torch.int64, device=device),
        )

    def _metadata(self, decodes, prefills, block_tables, slots) -> AttentionMetadata:
        def tables(entries):
            rows = [block_tables[seq.seq_id] for _, seq, _ in entries]
            width = max((len(r) for r in rows), default=0)
            padded = [r + [0] * (width - len(r)) for r in rows]
            return torch.tensor(padded, dtype=torch.int32, device=self.device).view(len(rows), width)

        def context_lens(entries):
            return torch.tensor(
                [seq.num_computed_tokens + chunk for _, seq, chunk in entries], dtype=torch.int32, device=self.device
            )

        cu = [0]
        for _, _, chunk in prefills:
            cu.append(cu[-1] + chunk)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=tables(decodes),
            decode_context_lens=context_lens(decodes),
            prefill_block_tables=tables(prefills),
            prefill_cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            prefill_context_lens=context_lens(prefills),
        )
