"""One rank's worker: owns the model (its shard), its KV cache and its persistent input batch, and
runs the steps the scheduler sends (:class:`SchedulerOutput`, keyed by sequence id). The executor
(:mod:`pagedllm.server.executor`) drives one per rank."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import numpy as np
import torch

from pagedllm.kernels.kv_quant import cache_dtype, raw, row_width
from pagedllm.server.config import ConfigError, EngineConfig, GiB
from pagedllm.server.config.quantization import with_quantization
from pagedllm.server.core.scheduler_output import SchedulerOutput
from pagedllm.server.worker.attention import AttentionMetadata, select_attention_ops
from pagedllm.server.worker.cpu_malloc import keep_freed_memory
from pagedllm.server.worker.cpu_threads import choose_threads
from pagedllm.server.worker.cuda_graphs import DecodeGraphs, try_capture
from pagedllm.server.worker.device_step import DeviceStep, fill_placeholders
from pagedllm.server.worker.dtype_choice import choose_dtype
from pagedllm.server.worker.input_batch import InputBatch
from pagedllm.server.worker.kv_scales import apply_kv_scales, split_kv_scales
from pagedllm.server.worker.lora_model import LoRAModel
from pagedllm.server.worker.model_loader import init_dummy_weights, iterate_weights
from pagedllm.server.worker.model_step import LaunchedStep, ModelStep, StepOutputs
from pagedllm.server.worker.models import model_class
from pagedllm.server.worker.models.base import CausalLM
from pagedllm.server.worker.models.fused_linear import finish_linears
from pagedllm.server.worker.models.tensor_parallel import TPGroup
from pagedllm.server.worker.quantization.linear import finish_quantized_layers, weights_summary
from pagedllm.server.worker.sampler import Sampler
from pagedllm.server.worker.sampling_batch import SamplerOutput
from pagedllm.server.worker.triton_warmup import WarmupShapes, warm_up

logger = logging.getLogger(__name__)


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank ``rank`` (``cuda:rank`` on GPUs)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available: use 'cpu' or 'auto'")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, rank) if name == "cuda" else torch.device(name)


def check_tensor_parallel(hf_config: dict, size: int, device: torch.device, ranks_per_node: int | None = None) -> None:
    """Refuse a tensor-parallel size the model or the machine cannot take, before any rank starts.

    Builds the model's rank-0 shard on the ``meta`` device (no memory), so the models' own
    divisibility checks (heads, KV heads, MLP width) speak.
    """
    if size == 1:
        return
    here = size if ranks_per_node is None else ranks_per_node
    if device.type == "cuda" and here > torch.cuda.device_count():
        raise ConfigError(
            "tensor_parallel_size",
            size,
            f"at most the {torch.cuda.device_count()} visible CUDA devices (CUDA_VISIBLE_DEVICES)",
            problem="is more than this machine has",
        )
    with torch.device("meta"):
        model_class(hf_config).from_hf_config(hf_config, TPGroup(0, size))


class ModelRunner:
    """One rank: loads the model (its shard), allocates the KV cache and executes scheduled steps.

    ``tp``: this rank of the tensor-parallel group (None: the only rank); the group's
    process group is joined before (see :class:`~pagedllm.server.executor.Executor`).
    """

    def __init__(self, config: EngineConfig, hf_config: dict, max_model_len: int, tp: TPGroup | None = None) -> None:
        self.config = config
        hf_config = with_quantization(hf_config, config.model.quantization)
        self.tp = tp if tp is not None else TPGroup(0, 1)
        # NOTE: a rank's device is its index on its own node (ranks are spread over --nnodes hosts)
        self.device = resolve_device(config.model.device, config.parallel.local_rank(self.tp.rank))
        self.threads = choose_threads(config.parallel.cpu_threads, ranks=config.parallel.ranks_per_node)
        torch.set_num_threads(self.threads.threads)
        logger.info("torch uses %d CPU threads (%s)", self.threads.threads, self.threads.reason)
        if self.device.type == "cpu":
            keep_freed_memory()
        dtype = choose_dtype(config.model.dtype, hf_config, self.device)
        self.dtype = dtype.dtype
        logger.info("the model computes in %s (%s)", str(self.dtype).removeprefix("torch."), dtype.reason)
        self.block_size = config.cache.tokens_per_block
        self.max_model_len = max_model_len
        self.ops = select_attention_ops(config.model.attention_backend, self.device, self.dtype)
        try:
            self.model = self._load_model(hf_config)
            use_triton = self.ops.name == "triton"
            self.lora = LoRAModel(self.model, config.lora, self.tp, use_triton) if config.lora.enable_lora else None
            """The resident LoRA adapters and the hooks that add them (None without --enable-lora)."""
        except BaseException:
            self.shutdown()
            raise
        self.num_layers, self.num_kv_heads, self.head_dim = self.model.kv_shape
        self.cache_dtype = cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        """What the KV cache holds: the model's dtype, or an 8-bit format (kernels/kv_quant.py)."""
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        """Captured decode steps (CUDA, one rank, no LoRA, not ``enforce_eager``), once the cache exists."""
        self.sampler = Sampler(config.model.seed, self.device) if self.tp.rank == 0 else None
        """Turns the step's logits into tokens; the driver's alone (the other ranks never sample)."""
        self.lookahead = config.scheduler.async_scheduling
        """Steps may be scheduled ahead, with placeholders for the ids the step before samples."""
        self.input_batch = InputBatch(config.scheduler.max_num_seqs, max_model_len, self.block_size, self.lookahead)
        """Every sequence the scheduler told this rank about; builds each step's arrays from its diffs."""
        self._sampled: torch.Tensor | None = None
        """[sample rows] the ids the last step sampled, on the device (``lookahead`` only)."""

    def _load_model(self, hf_config: dict) -> CausalLM:
        cls = model_class(hf_config)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)  # NOTE: restored below; builds weights in place
        try:
            with torch.device(self.device):
                model = cls.from_hf_config(hf_config, self.tp)
        finally:
            torch.set_default_dtype(previous)
        if self.config.model.load_format == "dummy":
            init_dummy_weights(model, self.config.model.seed)
        else:
            assert self.config.model.model is not None, "the engine resolves the model directory first"
            scales: dict = {}
            weights = iterate_weights(self.config.model.model, self.config.model.load_format)
            model.load_weights(split_kv_scales(weights, scales))
            apply_kv_scales(model, scales, cache_dtype(self.config.cache.kv_cache_dtype, self.dtype))  # type: ignore[arg-type]
        fused, packed = finish_linears(model, self.device, self.config.lora.enable_lora)  # type: ignore[arg-type]
        logger.info("%d layers' projections fused, %d linear weights packed for oneDNN", fused, packed)
        finish_quantized_layers(model, self.device, self.dtype)  # type: ignore[arg-type]
        self.weights = weights_summary(model, self.dtype)  # type: ignore[arg-type]
        """The weights' quantization (or none), each linear kind's kernel and the bytes: banner and metrics."""
        return model.eval()

    # -- KV cache -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (an 8-bit cache: half a 16-bit one's, plus int8's scales)."""
        element = torch.empty((), dtype=self.cache_dtype).element_size()
        row = row_width(self.cache_dtype, self.head_dim)
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * row * element

    def shutdown(self) -> None:
        """Free this rank's KV cache (idempotent)."""
        self.graphs = None  # NOTE: first: the graphs hold the cache's addresses
        self.kv_caches = []
        self.host_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # NOTE: hands the freed blocks back to the device, not only to torch's pool

    def allocate_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        """This rank's KV cache (every rank gets the same block counts, each for its own heads)."""
        self.allocate_local_cache(num_device_blocks, num_host_blocks)
        if self.device.type == "cuda" and self.ops.name == "triton":  # NOTE: no compile stalls while serving
            warm_up(self.model, self.kv_caches, self.ops, self._warmup_shapes(), self.device)
        # NOTE: the Triton KV write skips the padding rows' slot -1; the torch backend's would not
        graphed = self.device.type == "cuda" and self.ops.name == "triton" and self.tp.size == 1 and self.lora is None
        if graphed and not self.config.model.enforce_eager:
            with torch.inference_mode():
                self.graphs = try_capture(
                    self.model,
                    self.kv_caches,
                    self.ops,
                    self.config.scheduler.max_num_seqs,
                    -(-self.max_model_len // self.block_size),
                    self.device,
                )

    def _warmup_shapes(self) -> WarmupShapes:
        budget = min(self.config.scheduler.token_budget, self.max_model_len)
        return WarmupShapes(self.config.scheduler.max_num_seqs, budget, -(-self.max_model_len // self.block_size))

    def device_blocks(self, useful_blocks: int) -> int:
        """Blocks that fit here: the override, the CPU budget, or what profiling leaves on the GPU."""
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

    def host_blocks(self, useful_blocks: int) -> int:
        return int(min(self.config.cache.swap_space * GiB // self.block_bytes, useful_blocks))

    @torch.inference_mode()
    def _profile_cuda_free_bytes(self) -> int:
        """Run the largest step once and see what memory is left for the cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        tokens = min(self.config.scheduler.token_budget, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        self.allocate_local_cache(blocks, 0)
        table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None]
        meta = AttentionMetadata.prefills(
            torch.arange(tokens, dtype=torch.int64, device=self.device),
            table,
            torch.tensor([0, tokens], dtype=torch.int32, device=self.device),
            torch.tensor([tokens], dtype=torch.int32, device=self.device),
        )
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        meta = self.ops.prepare(meta, self.block_size)
        hidden = self.model(ids, torch.arange(tokens, device=self.device), self.kv_caches, meta, self.ops)
        self.model.compute_logits(hidden[-min(tokens, self.config.scheduler.max_num_seqs) :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.config.cache.gpu_memory_utilization - peak)

    def allocate_local_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        # Each layer: key and value caches [num_blocks, block_size, num_kv_heads, head_dim].
        shape = (self.block_size, self.num_kv_heads, row_width(self.cache_dtype, self.head_dim))
        pin, dtype = self.device.type == "cuda", self.cache_dtype
        self.kv_caches = [
            (
                torch.zeros((num_device_blocks, *shape), dtype=dtype, device=self.device),
                torch.zeros((num_device_blocks, *shape), dtype=dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        # NOTE: host blocks are only ever read after being written by a swap-out.
        self.host_caches = [
            (
                torch.empty((num_host_blocks, *shape), dtype=dtype, pin_memory=pin),
                torch.empty((num_host_blocks, *shape), dtype=dtype, pin_memory=pin),
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
            for device_cache, host_cache in zip(map(raw, device_kv), map(raw, host_kv)):  # NOTE: fp8 as bytes
                if to_host:
                    host_cache[dst] = device_cache[src.to(self.device)].to("cpu", non_blocking=False)
                else:
                    device_cache[dst.to(self.device)] = host_cache[src].to(self.device, non_blocking=True)

    def execute(self, out: SchedulerOutput) -> StepOutputs:
        """This rank's part of a step: its diffs into the batch, then the step (:meth:`run`)."""
        return self.run(self.input_batch.step(out))

    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """:meth:`execute` without waiting for the sampled tokens (``async_scheduling``): on a GPU the
        step is queued and its tokens copied to the host behind it; the next step can be queued at once."""
        return self._launch(self.input_batch.step(out), defer=True)

    def run(self, model_step: ModelStep) -> StepOutputs:
        """A step's arrays on this rank: block moves, the model, then (the driver) sampling."""
        return self._launch(model_step).outputs()

    @torch.inference_mode()
    def _launch(self, model_step: ModelStep, defer: bool = False) -> LaunchedStep:
        step = DeviceStep.of(model_step, self.device, pinned=self.lookahead)
        previous, self._sampled = self._sampled, None
        if model_step.placeholders is not None:
            fill_placeholders(step.input_ids, model_step.placeholders, previous, self.lookahead)
        if step.sampling is not None and self.sampler is not None:
            self.sampler.forget(step.sampling.finished_request_ids)
        self._move_blocks(step.swap_out, to_host=True)
        self._move_blocks(step.swap_in, to_host=False)
        if step.copies:
            mapping = torch.tensor(step.copies, dtype=torch.int64, device=self.device)
            self.ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], mapping)
        if step.input_ids.numel() == 0:
            return LaunchedStep(lambda: None, None)
        meta = self.ops.prepare(step.meta, self.block_size)
        adapters = self.lora.running(step.lora, self.device) if self.lora is not None else contextlib.nullcontext()
        if self.graphs is not None and step.pool_index is None and self.graphs.fits(step.input_ids, meta):
            hidden = self.graphs.run(step.input_ids, step.positions, meta)
        else:
            with adapters:
                hidden = self.model(step.input_ids, step.positions, self.kv_caches, meta, self.ops)
        # NOTE: every rank computes the logits (the LM head's slices are gathered on rank 0); the driver samples
        logits = self.model.compute_logits(hidden[step.sample_index])
        prompt_logits = self.model.compute_logits(hidden[step.prompt_index]) if step.prompt_index is not None else None
        pooled = _pool(hidden, step.pool_index, step.pool_lens)
        if step.sampling is None or self.sampler is None:
            return LaunchedStep(lambda: None, pooled)
        if not defer:
            sampled = self.sampler(logits, prompt_logits, step.sampling)
            read: Callable[[], SamplerOutput | None] = lambda: sampled  # noqa: E731
        else:
            read = self.sampler.launch(logits, prompt_logits, step.sampling)
        if self.lookahead:
            last = self.sampler.last_tokens
            if last is None:  # NOTE: rare (a row failed): the ids come from the host lists, read back now
                done = read()
                assert done is not None, "the driver sampled"
                read, last = (lambda: done), _host_ids(done, self.device)
            self._sampled = last
        return LaunchedStep(read, pooled)


def _host_ids(sampled: SamplerOutput, device: torch.device) -> torch.Tensor:
    """The first id of each sample row, from the host lists (where the sampler kept no device copy)."""
    ids = [row.token_ids[0] if row is not None and row.token_ids else 0 for row in sampled.rows]
    return torch.tensor(ids, dtype=torch.int64, device=device)


def _pool(hidden: torch.Tensor, index: torch.Tensor | None, lens: torch.Tensor | None) -> np.ndarray | None:
    """Sum ``hidden`` over each pool row's token indices: [len(lens), hidden_size] float32 on the host.

    NOTE: a sum, not a mean: a prompt chunked over several steps adds its chunks' sums up
    and divides once at the end. Rows after the last layer's all-reduce are whole on every rank.
    """
    if index is None or lens is None:
        return None
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=hidden.device), lens, output_size=index.numel())
    sums = torch.zeros((lens.numel(), hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, rows, hidden[index].float()).cpu().numpy()
