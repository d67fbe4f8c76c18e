"""Each quantized matmul against a float64 dequantize-then-matmul reference, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch
from quant_writers import AWQ_ORDER, pack_rows

from pagedllm.server.worker.models.cpu_linear import onednn_bf16
from pagedllm.server.worker.quantization.base import QuantizedWeight, pack_int32, sort_by_groups, unpack_int32
from pagedllm.server.worker.quantization.kernels import (
    DENSE_ROWS_BFLOAT16,
    DequantizeKernel,
    Int4CpuKernel,
    Int8CpuKernel,
    TritonW4A16Kernel,
    choose_kernel,
)

N, K = 64, 256
CPU = torch.device("cpu")


def random_int4(group: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    groups = K // group
    q = torch.randint(0, 16, (N, K), generator=gen).to(torch.uint8)
    scales = torch.rand(N, groups, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (N, groups), generator=gen).float()
    return QuantizedWeight(q, scales, zeros, group, 4)


def reference(w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    g = w.group_size
    deq = w.q.double()
    if w.zeros is not None:
        deq = deq - w.zeros.double().repeat_interleave(g, 1)
    return x.double() @ (deq * w.scales.double().repeat_interleave(g, 1)).T


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), f"max error {err:.3e} vs magnitude {want.abs().max().item():.3e}"


@pytest.mark.parametrize("group", [32, 64, 128, 256, K])
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_int4_cpu_matches_float64(group, rows):
    w = random_int4(group, seed=group + rows)
    kernel = choose_kernel(w, CPU, torch.float32)
    assert isinstance(kernel, Int4CpuKernel)
    x = torch.randn(rows, K)
    assert_close(kernel(x), reference(w, x), 1e-5)
    assert_close(DequantizeKernel(w)(x), reference(w, x), 1e-5)
    bf16 = Int4CpuKernel(w, torch.bfloat16)
    assert_close(bf16(x.bfloat16()), reference(w, x.bfloat16()), 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_cpu_unpacked_a_tile_at_a_time_matches_float64(dtype, monkeypatch):
    import pagedllm.server.worker.quantization.kernels as kernels

    monkeypatch.setattr(kernels, "TILE_ELEMENTS", 64 * K)  # NOTE: three tiles of 64 output columns
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (192, K), generator=gen).to(torch.uint8)
    scales, zeros = torch.rand(192, K // 32, generator=gen) * 0.1 + 0.01, torch.randint(0, 16, (192, K // 32))
    w = QuantizedWeight(q, scales, zeros.float(), 32, 4)
    x = torch.randn(40, K).to(dtype)
    assert_close(Int4CpuKernel(w, dtype).unpacked_mm(x), reference(w, x), 1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("rows", [1, 16])
def test_int8_cpu_matches_float64(rows):
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (N, K), generator=gen).to(torch.int8)
    w = QuantizedWeight(q, torch.rand(N, 1, generator=gen) * 0.01, None, K, 8)
    kernel = choose_kernel(w, CPU, torch.float32)
    assert isinstance(kernel, Int8CpuKernel)
    x = torch.randn(rows, K)
    assert_close(kernel(x), reference(w, x), 1e-5)
    unsigned = QuantizedWeight((q.short() + 128).to(torch.uint8), w.scales, torch.full((N, 1), 128.0), K, 8)
    assert isinstance(choose_kernel(unsigned, CPU, torch.float32), Int8CpuKernel)
    assert_close(choose_kernel(unsigned, CPU, torch.float32)(x), reference(w, x), 1e-5)


def test_act_order_sorted_by_group_matches_the_original_order():
    gen = torch.Generator().manual_seed(0)
    group = 32
    g_idx = torch.empty(K, dtype=torch.long)
    g_idx[torch.randperm(K, generator=gen)] = torch.arange(K) // group
    q = torch.randint(0, 16, (N, K), generator=gen).to(torch.uint8)
    scales, zeros = torch.rand(N, K // group, generator=gen) + 0.1, torch.randint(0, 16, (N, K // group)).float()
    original = (q.double() - zeros.double()[:, g_idx]) * scales.double()[:, g_idx]
    w = sort_by_groups(q, scales, zeros, g_idx, 4)
    assert w.group_size == group and w.perm is not None
    x = torch.randn(3, K)
    kernel = choose_kernel(w, CPU, torch.float32)
    assert isinstance(kernel, Int4CpuKernel)
    assert_close(kernel(x[:, w.perm]), x.double() @ original.T, 1e-5)
    uneven = sort_by_groups(q[:, :100], scales, zeros, g_idx[:100], 4)  # a shard that cuts groups
    assert uneven.group_size == 1
    want = x[:, :100].double() @ original[:, :100].T
    assert_close(choose_kernel(uneven, CPU, torch.float32)(x[:, :100][:, uneven.perm]), want, 1e-5)


def test_unpacking_reads_awq_order_and_sequential_packing():
    q = torch.randint(0, 16, (K, N), dtype=torch.int64)
    awq = sum(q[:, AWQ_ORDER[i] :: 8] << (4 * i) for i in range(8))
    awq = torch.where(awq >= 2**31, awq - 2**32, awq).to(torch.int32)
    assert torch.equal(unpack_int32(awq, 4, dim=1, order=AWQ_ORDER), q.to(torch.uint8))
    for bits in (4, 8):
        v = torch.randint(0, 1 << bits, (K, N), dtype=torch.uint8)
        packed = pack_rows(v, bits)  # the writers' own packing, along K
        assert torch.equal(pack_int32(v, bits, dim=0), packed)
        assert torch.equal(unpack_int32(packed, bits, dim=0), v)


def test_triton_layout_is_packed_along_k_in_sequential_order():
    w = random_int4(32, seed=1)
    kernel = TritonW4A16Kernel(w, torch.float32)
    assert kernel.qweight.shape == (K // 8, N) and kernel.scales.shape == kernel.zeros.shape == (K // 32, N)
    word = kernel.qweight[1, 5].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 15 for i in range(8)] == w.q[5, 8:16].tolist()


def test_the_reference_runs_what_no_fast_kernel_takes():
    fp8 = QuantizedWeight(torch.randn(N, K).to(torch.float8_e4m3fn), torch.rand(N, 8) + 0.1, None, 32, 8)
    x = torch.randn(4, K)
    kernel = choose_kernel(fp8, CPU, torch.float32)
    assert isinstance(kernel, DequantizeKernel)
    assert_close(kernel(x), reference(fp8, x), 1e-5)


def test_int4_cpu_in_float32_unpacks_exactly_what_it_packed():
    w = random_int4(64, seed=3)
    kernel = Int4CpuKernel(w, torch.float32)
    assert kernel.dense_rows == 1 and torch.equal(kernel.unpack(), w.q)
    bf16_rows = DENSE_ROWS_BFLOAT16 if onednn_bf16() else None  # NOTE: packed below it (always without oneDNN's bf16)
    assert Int4CpuKernel(w, torch.bfloat16).dense_rows == bf16_rows
    assert_close(kernel.unpacked_mm(torch.eye(K)), reference(w, torch.eye(K)), 1e-6)


@pytest.mark.parametrize("rows", [1, 7, 16])
def test_int8_w8a8_quantizes_each_row_and_multiplies_exactly(rows):
    from pagedllm.server.worker.quantization.kernels import Int8W8A8CpuKernel

    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (N, K), generator=gen).to(torch.int8)
    w = QuantizedWeight(q, torch.rand(N, 1, generator=gen) * 0.01, None, K, 8, int8_activations=True)
    kernel = choose_kernel(w, CPU, torch.float32)
    assert isinstance(kernel, Int8W8A8CpuKernel)
    x = torch.randn(rows, K)
    x_scale = x.abs().amax(-1, keepdim=True).double() / 127
    xq = torch.round(x.double() / x_scale)
    want = (xq @ q.double().T) * x_scale * w.scales.double()[:, 0]
    assert_close(kernel(x), want, 1e-6)
    assert_close(kernel(x), reference(w, x), 2e-2)  # NOTE: per-token int8 activations: close to W8A16, not equal
