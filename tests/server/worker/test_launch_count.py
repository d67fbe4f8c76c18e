"""Kernel launches of one eager LLaMA decoder layer on the CUDA path: at most 12 per layer.

A decode step replays a captured graph, but eager steps (prefill, LoRA, tensor parallel,
``enforce_eager``) pay a host launch per kernel; the layer's budget is::

    add+norm, qkv GEMM, rotary, KV write, attention, o GEMM, add+norm, gate-up GEMM, act-and-mul, down GEMM

On CPU the CUDA branches are forced on (Triton through its interpreter) and launches are
counted as a GPU would see them: each Triton grid launch once (the interpreter's own tensor
traffic inside it not counted), plus every torch op that computes (views, splits, empty
allocations and other metadata-only ops launch nothing). On a GPU the profiler counts the
kernels themselves.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagedllm.kernels.kv_quant import quantize
from pagedllm.server.worker.attention import AttentionMetadata, select_attention_ops
from pagedllm.server.worker.models import decoder, rope
from pagedllm.server.worker.models.decoder import DecoderForCausalLM
from pagedllm.server.worker.models.fused_linear import finish_linears

MAX_LAUNCHES_PER_LAYER = 12
GEMMS = ("linear", "mm", "addmm")
EXPECTED_TRITON = {  # launches of each Triton kernel in one layer; attention splits and merges in one
    "rms_norm_kernel": 2,  # the input and post-attention add + norm
    "rotary_embedding_kernel": 1,
    "reshape_and_cache_kernel": 1,
    "paged_decode_attention_kernel": 1,
    "act_and_mul_kernel": 1,
}
BLOCK_SIZE = 16
KV_DTYPES = [None, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]  # None: the model's dtype
aten = torch.ops.aten
# NOTE: ops that only make a tensor's header (or leave its memory unwritten): no kernel on a GPU
NO_KERNEL = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default, aten.t.default,
             aten.detach.default, aten.lift_fresh.default}  # fmt: skip


class LaunchCounter(TorchDispatchMode):
    """Counts the kernels a CUDA device would run: torch ops that compute, and Triton launches."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view and func not in NO_KERNEL:
            self.launches[f"aten.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting_triton(self, monkeypatch):
        """Count each Triton grid launch once (the interpreter's tensor copies inside it not at all)."""
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run

        def counted(kernel, *args, grid, warmup, **kwargs):
            if not warmup:
                self.launches[f"triton.{kernel.__name__}"] += 1
            self.paused = True
            try:
                return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                self.paused = False

        monkeypatch.setattr(InterpretedFunction, "run", counted)
        with self:
            yield self


def _llama(device: str = "cpu") -> DecoderForCausalLM:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256).to_dict()  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = DecoderForCausalLM.from_hf_config(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.05)
    finish_linears(model, torch.device("cuda"), lora=False)  # NOTE: what a CUDA runner does after loading
    return model.eval()


def _decode_step(batch: int, device: str = "cpu") -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata and positions of a decode step of ``batch`` rows, contexts of 20 to 70 tokens."""
    lens = torch.tensor([20 + (50 * i) // max(1, batch - 1) for i in range(batch)], dtype=torch.int32)
    blocks = -(-int(lens.max()) // BLOCK_SIZE)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    slots = tables.gather(1, ((lens - 1) // BLOCK_SIZE).long()[:, None])[:, 0] * BLOCK_SIZE + (lens - 1) % BLOCK_SIZE
    meta = AttentionMetadata(
        slot_mapping=slots.long().to(device),
        num_decode_tokens=batch,
        decode_block_tables=tables.to(device),
        decode_context_lens=lens.to(device),
        prefill_block_tables=tables[:0].to(device),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_context_lens=lens[:0].to(device),
    )
    return meta, (lens - 1).long().to(device)


def _layer_inputs(model, batch: int, device: str = "cpu", dtype=torch.float32, kv_dtype: torch.dtype | None = None):
    meta, positions = _decode_step(batch, device)
    _, kv_heads, head_dim = model.kv_shape
    blocks = int(meta.decode_block_tables.numel())
    shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
    cache = tuple(quantize(torch.randn(shape, device=device, dtype=dtype), kv_dtype or dtype) for _ in range(2))
    x = torch.randn(batch, 64, device=device, dtype=dtype)
    residual = torch.randn(batch, 64, device=device, dtype=dtype)
    return x, residual, positions, cache, meta


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_an_eager_cuda_decoder_layer_launches_at_most_12_kernels(batch, kv_dtype, monkeypatch):
    # NOTE: an 8-bit cache adds nothing: the KV write quantizes inside its one launch
    for module in (decoder, rope):
        monkeypatch.setattr(module, "runs_on_triton", lambda t: True)
    model = _llama()
    ops = select_attention_ops("triton", torch.device("cpu"))
    layer = model.model.layers[1]  # NOTE: not the first: it adds the previous layer's output to the stream
    x, residual, positions, cache, meta = _layer_inputs(model, batch, kv_dtype=kv_dtype)
    counter = LaunchCounter()
    with torch.inference_mode():
        layer(x.clone(), residual.clone(), positions, cache, meta, ops)  # NOTE: steady state: buffers kept exist
        with counter.counting_triton(monkeypatch):
            layer(x, residual, positions, cache, meta, ops)
    launches = counter.launches
    assert sum(launches.values()) <= MAX_LAUNCHES_PER_LAYER, dict(launches)
    assert sum(launches[f"aten.{gemm}"] for gemm in GEMMS) == 4, dict(launches)  # qkv, o, gate-up, down
    triton = {name.removeprefix("triton."): n for name, n in launches.items() if name.startswith("triton.")}
    assert triton == EXPECTED_TRITON, dict(launches)
    assert sum(launches.values()) == 4 + sum(EXPECTED_TRITON.values()), dict(launches)  # nothing else: no copies


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_an_eager_cuda_decoder_layer_launches_at_most_12_kernels_on_a_gpu(batch, kv_dtype):
    from torch.profiler import ProfilerActivity, profile

    model = _llama("cuda").half()  # NOTE: serving's 16-bit GEMMs, not float32's (cuBLAS may split those)
    ops = select_attention_ops("triton", torch.device("cuda"))
    layer = model.model.layers[1]
    inputs = _layer_inputs(model, batch, "cuda", torch.float16, kv_dtype)
    with torch.inference_mode():
        layer(inputs[0].clone(), inputs[1].clone(), *inputs[2:], ops)  # compiles, allocates what is kept
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            layer(*inputs, ops)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert 0 < len(kernels) <= MAX_LAUNCHES_PER_LAYER, kernels


def test_the_counted_cuda_path_layer_computes_what_the_cpu_one_does(monkeypatch):
    # NOTE: the launches above are of a right answer: the same layer on the CPU path (torch attention) agrees
    model = _llama()
    layer = model.model.layers[1]
    x, residual, positions, cache, meta = _layer_inputs(model, 5)
    cpu_ops = select_attention_ops("torch", torch.device("cpu"))
    with torch.inference_mode():
        cpu_cache = tuple(t.clone() for t in cache)
        want = layer(x.clone(), residual.clone(), positions, cpu_cache, cpu_ops.prepare(meta, BLOCK_SIZE), cpu_ops)
        for module in (decoder, rope):
            monkeypatch.setattr(module, "runs_on_triton", lambda t: True)
        ops = select_attention_ops("triton", torch.device("cpu"))
        got = layer(x.clone(), residual.clone(), positions, cache, meta, ops)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cache[0], cpu_cache[0])  # the same K written to the same slots
