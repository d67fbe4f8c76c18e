"""The compiled 8-bit KV write against the torch ops it replaces: the same bytes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.kv_quant import QUANT_DTYPES, quantize, raw, row_width
from pagedllm.kernels.kv_write_cpu import write_kv_quantized_cpu, write_kv_quantized_reference
from pagedllm.kernels.paged_decode_attention_cpu import HAS_NUMBA
from tests.kernels.kernel_factories import torch_threads

pytestmark = pytest.mark.skipif(not HAS_NUMBA, reason="numba is not installed")

IDS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int8: "int8"}
QDTYPES = [pytest.param(d, id=IDS[d]) for d in QUANT_DTYPES]
SCALES = {torch.float8_e4m3fn: (0.37, 1.0), torch.float8_e5m2: (3.1, 0.011), torch.int8: (1.0, 1.0)}


def _poisoned_caches(dtype, num_blocks, block_size, heads, head_dim, g):
    """Two caches whose every byte is random (NaN scales and fp8 NaNs included)."""
    shape = (num_blocks, block_size, heads, row_width(dtype, head_dim))
    caches = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(dtype) for _ in range(2)]
    return caches, [c.clone() for c in caches]


def _inputs(tokens, heads, head_dim, in_dtype, g, strided):
    # rows of very different sizes, exact zeros, a zero row and values past fp8's range
    size = torch.logspace(-9, 5, tokens * heads).reshape(tokens, heads, 1)
    x = torch.randn(tokens, 2 * heads if strided else heads, head_dim, generator=g)
    x = x[:, ::2] if strided else x
    x = x * size[:, :heads]
    x[x.abs() < 0.05 * size[:, :heads]] = 0.0
    x[0, 0] = 0.0
    return x.to(in_dtype)


def _bytes(cache):
    return raw(cache).view(torch.uint8) if cache.dtype == torch.int8 else raw(cache)


@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,heads,head_dim,block_size", [(1, 2, 64, 16), (16, 2, 64, 16), (37, 3, 40, 8), (5, 8, 128, 4)]
)
@pytest.mark.parametrize("strided", [False, True])
def test_bitwise_equal_to_reference(dtype, in_dtype, tokens, heads, head_dim, block_size, strided):
    g = torch.Generator().manual_seed(tokens * 1000 + heads * head_dim)
    key = _inputs(tokens, heads, head_dim, in_dtype, g, strided)
    value = _inputs(tokens, heads, head_dim, in_dtype, g, strided) * 3
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < 0.2] = -1  # padding
    (kc, vc), (want_k, want_v) = _poisoned_caches(dtype, num_blocks, block_size, heads, head_dim, g)
    k_scale, v_scale = SCALES[dtype]
    write_kv_quantized_cpu(key, value, kc, vc, slots, k_scale, v_scale)
    write_kv_quantized_reference(key, value, want_k, want_v, slots, k_scale, v_scale)
    assert torch.equal(_bytes(kc), _bytes(want_k))  # written rows, and every other byte untouched
    assert torch.equal(_bytes(vc), _bytes(want_v))


@pytest.mark.parametrize("dtype", QDTYPES)
def test_every_rounding_case_matches_torch(dtype):
    """Values at and around every float16 / fp8 rounding tie, subnormals and the clamp."""
    g = torch.Generator().manual_seed(7)
    ties = torch.arange(0, 2**16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    ties = ties[torch.isfinite(ties)]
    near = torch.cat([ties, ties.nextafter(ties * 2 + 1), (ties[1:] + ties[:-1]) / 2])
    x = torch.cat([near, torch.randn(4096, generator=g) * 1e3]).clamp(-6e4, 6e4)
    x = x[: x.numel() // 64 * 64].reshape(-1, 1, 64)
    # int8: rows whose max|x| / 127 lies exactly on a float16 tie, or next to one
    mids = (ties[1:] + ties[:-1])[ties[1:] > 0] / 2
    mids = torch.cat([mids, mids.nextafter(mids * 2), mids.nextafter(torch.zeros_like(mids))])
    mids = mids[:: max(1, mids.numel() // 2048)]
    rows = torch.rand(mids.numel(), 1, 64, generator=g) * 127 * mids[:, None, None]
    rows[:, 0, 0] = -127 * mids
    x = torch.cat([x, rows])
    x = x[torch.randperm(x.shape[0], generator=g)]
    for scale in (1.0, 0.013, 7.0):
        kc = torch.zeros(x.shape[0], 1, 1, row_width(dtype, 64), dtype=dtype)
        vc = kc.clone()
        slots = torch.arange(x.shape[0])
        write_kv_quantized_cpu(x, x, kc, vc, slots, scale, scale)
        want = quantize(x, dtype, scale)
        assert torch.equal(_bytes(kc.view(-1, 1, want.shape[-1])), _bytes(want))


def test_other_dtypes_take_the_reference():
    key = torch.randn(3, 2, 16).half()
    kc = torch.zeros(1, 4, 2, 18, dtype=torch.int8)
    vc, want_k, want_v = kc.clone(), kc.clone(), kc.clone()
    slots = torch.tensor([0, -1, 3])
    write_kv_quantized_cpu(key, key, kc, vc, slots)
    write_kv_quantized_reference(key, key, want_k, want_v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@pytest.mark.parametrize("dtype", QDTYPES)
def test_parallel_build_matches_reference(dtype):
    """A prefill-sized write (past PARALLEL_MIN_ELEMENTS) spread over two threads."""
    g = torch.Generator().manual_seed(3)
    key, value = (_inputs(600, 2, 64, torch.bfloat16, g, strided=False) for _ in range(2))
    slots = torch.randperm(40 * 16, generator=g)[:600]
    slots[::7] = -1
    (kc, vc), (want_k, want_v) = _poisoned_caches(dtype, 40, 16, 2, 64, g)
    with torch_threads(2):
        write_kv_quantized_cpu(key, value, kc, vc, slots, *SCALES[dtype])
    write_kv_quantized_reference(key, value, want_k, want_v, slots, *SCALES[dtype])
    assert torch.equal(_bytes(kc), _bytes(want_k)) and torch.equal(_bytes(vc), _bytes(want_v))


def test_without_numba_the_reference_writes(monkeypatch):
    import pagedllm.kernels.kv_write_cpu as module

    monkeypatch.setattr(module, "HAS_NUMBA", False)
    monkeypatch.setattr(module, "_compiled", None)  # any use of the kernel would fail
    key = torch.randn(4, 2, 16)
    kc = torch.full((2, 4, 2, 18), 5, dtype=torch.int8)
    vc, want_k, want_v = kc.clone(), kc.clone(), kc.clone()
    slots = torch.tensor([0, -1, 6, 2])
    write_kv_quantized_cpu(key, key, kc, vc, slots)
    write_kv_quantized_reference(key, key, want_k, want_v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
