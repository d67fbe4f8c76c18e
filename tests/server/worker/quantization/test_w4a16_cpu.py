"""The tiled 4-bit CPU kernel as a quantized layer's kernel: when it is chosen and what it computes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import w4_gemm_cpu
from pagedllm.server.worker.quantization import kernels as quant_kernels
from pagedllm.server.worker.quantization.base import QuantizedWeight, sort_by_groups
from pagedllm.server.worker.quantization.kernels import (
    DequantizeKernel,
    Int4CpuKernel,
    Int8CpuKernel,
    Int8W8A8CpuKernel,
    choose_kernel,
)
from pagedllm.server.worker.quantization.w4a16_cpu import W4A16TilesKernel, W8A8TilesKernel

N, K = 64, 256
CPU = torch.device("cpu")
needs_kernel = pytest.mark.skipif(
    not w4_gemm_cpu.available(), reason="needs an x86-64 CPU with AVX-512-BF16 or AVX2, numba and a C compiler"
)


def random_int4(n: int, k: int, group: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    return QuantizedWeight(q, scales, zeros, group, 4)


def as_rounded(kernel: W4A16TilesKernel | W8A8TilesKernel, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: rounded to int8 per row and group of the packed weight, and back
    (float64), where it runs on int8 activations; else x itself."""
    if not kernel.int8:
        return x
    levels, stats = w4_gemm_cpu.quantize_rows(x, kernel.group_size)
    rows, k = x.shape
    return (levels.double().view(rows, -1, kernel.group_size) * stats[..., :1].double()).view(rows, k)


def assert_matches(got: torch.Tensor, w: QuantizedWeight, x: torch.Tensor) -> None:
    """Within 2^-7 of the output's magnitude of the float64 product on the dequantized weight (bfloat16 out)."""
    want = x.double() @ w.dequantize(torch.float64).T
    err = (got.double() - want).abs().max().item()
    assert err <= 2**-7 * want.abs().max().item(), f"max error {err:.3e} vs {want.abs().max().item():.3e}"


@pytest.mark.parametrize("group", [32, 64, 128, 256, K])
@pytest.mark.parametrize("rows", [1, 5, 16, 64, 100])
@needs_kernel
def test_chosen_for_bfloat16_at_every_row_count(group, rows):
    w = random_int4(N, K, group, seed=group + rows)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, W4A16TilesKernel)
    assert kernel.label == ("w4a8-tiles" if w4_gemm_cpu.int8_available() else "w4a16-tiles")
    x = torch.randn(rows, K).to(torch.bfloat16)
    out = kernel(x)
    assert out.dtype == torch.bfloat16
    assert_matches(out, w, as_rounded(kernel, x))


@needs_kernel
def test_a_per_channel_weight_runs_in_groups_of_128():
    w = random_int4(N, 512, 512, seed=1)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, W4A16TilesKernel) and kernel.group_size == 128
    assert kernel.meta.shape == (N // 16, 4, 2, 16)
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert_matches(kernel(x), w, as_rounded(kernel, x))


@needs_kernel
def test_act_order_runs_on_the_sorted_weight():
    gen = torch.Generator().manual_seed(0)
    g_idx = torch.empty(K, dtype=torch.long)
    g_idx[torch.randperm(K, generator=gen)] = torch.arange(K) // 32
    q = torch.randint(0, 16, (N, K), generator=gen).to(torch.uint8)
    scales, zeros = torch.rand(N, K // 32, generator=gen) + 0.1, torch.randint(0, 16, (N, K // 32)).float()
    w = sort_by_groups(q, scales, zeros, g_idx, 4)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, W4A16TilesKernel)
    x = torch.randn(4, K).to(torch.bfloat16)
    original = (q.double() - zeros.double()[:, g_idx]) * scales.double()[:, g_idx]
    # NOTE: int8 groups are the sorted inputs' groups, which act order's g_idx makes of scattered columns
    want = as_rounded(kernel, x[:, w.perm])[:, torch.argsort(w.perm)].double() @ original.T
    err = (kernel(x[:, w.perm]).double() - want).abs().max().item()
    assert err <= 2**-7 * want.abs().max().item()


def test_what_it_does_not_take_keeps_the_other_kernels():
    w = random_int4(N, K, 32, seed=3)
    assert isinstance(choose_kernel(w, CPU, torch.float32), Int4CpuKernel)  # NOTE: float32 activations
    no_zeros = QuantizedWeight(w.q, w.scales, None, 32, 4)
    assert not W4A16TilesKernel.fits(no_zeros)
    assert not W4A16TilesKernel.fits(random_int4(N + 8, K, 32, seed=4))  # N not a multiple of 16
    assert not W4A16TilesKernel.fits(QuantizedWeight(w.q, w.scales.repeat_interleave(32, 1), None, 1, 4))
    uneven = QuantizedWeight(w.q, w.scales.repeat_interleave(2, 1), w.zeros.repeat_interleave(2, 1), 16, 4)  # type: ignore[union-attr]
    assert not W4A16TilesKernel.fits(uneven)  # NOTE: group 16 is not among the packed groups
    assert isinstance(choose_kernel(uneven, CPU, torch.bfloat16), DequantizeKernel)


@pytest.mark.parametrize(("onednn", "label"), [(True, "int4-cpu+unpacked-bfloat16-from-64-rows"), (False, "int4-cpu")])
def test_unavailable_leaves_bfloat16_on_int4_cpu(monkeypatch, onednn, label):
    """Widened for a dense bfloat16 GEMM only where oneDNN runs one (not on an AVX2-only CPU)."""
    monkeypatch.setattr(w4_gemm_cpu, "available", lambda: False)
    monkeypatch.setattr(quant_kernels, "onednn_bf16", lambda: onednn)
    w = random_int4(N, K, 64, seed=5)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, Int4CpuKernel)
    assert kernel.label == label


@needs_kernel
def test_the_layer_keeps_its_int8_product_until_its_buffers_change():
    """The int8 product is made on the first call and kept; a kernel whose buffers were replaced
    (``.to``, a new tensor assigned) makes a new one on the new buffers."""
    if not w4_gemm_cpu.int8_available():
        pytest.skip("no int8 product on this CPU")
    w = random_int4(N, K, 128, seed=9)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, W4A16TilesKernel) and kernel.int8
    x = torch.randn(3, K).to(torch.bfloat16)
    first = kernel(x)
    product = kernel.__dict__["_int8_product"]
    assert torch.equal(kernel(x), first) and kernel.__dict__["_int8_product"] is product
    kernel.meta = kernel.meta.clone()
    kernel.meta[:, :, 0] *= 2  # every scale doubled: the output follows the new buffer
    again = kernel(x)
    assert kernel.__dict__["_int8_product"] is not product
    torch.testing.assert_close(again.float(), 2 * first.float(), rtol=2**-7, atol=0)


@needs_kernel
def test_int8_activations_only_where_they_run(monkeypatch):
    """A group not a multiple of 16 inputs (a per-channel weight of K = 40), or ``PAGEDLLM_W4A8=0``
    (``int8_available`` false), keeps the same packed weight on bfloat16 activations."""
    w = random_int4(N, 40, 40, seed=6)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, W4A16TilesKernel) and kernel.label == "w4a16-tiles"
    x = torch.randn(5, 40).to(torch.bfloat16)
    assert_matches(kernel(x), w, x)
    monkeypatch.setattr(w4_gemm_cpu, "int8_available", lambda: False)
    w = random_int4(N, K, 128, seed=7)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert kernel.label == "w4a16-tiles"
    x = torch.randn(16, K).to(torch.bfloat16)
    torch.testing.assert_close(kernel(x), w4_gemm_cpu.gemm(x, w4_gemm_cpu.W4Packed(kernel.weight, kernel.meta, 128)))


needs_w8 = pytest.mark.skipif(
    not w4_gemm_cpu.w8_available(), reason="needs AVX-512-BF16, VNNI and VBMI, numba and a C compiler"
)


def random_int8(n: int, k: int, group: int, seed: int, signed: bool = False) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    if signed:
        return QuantizedWeight(torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8), scales, None, group, 8)
    zeros = torch.randint(0, 256, (n, k // group), generator=gen).float()
    return QuantizedWeight(torch.randint(0, 256, (n, k), generator=gen).to(torch.uint8), scales, zeros, group, 8)


@pytest.mark.parametrize(
    ("desc", "group", "signed", "kernel_group"),
    [
        ("gptq-g32-asym", 32, False, 32),
        ("gptq-g128", 128, False, 128),
        ("channel", 512, False, 128),
        ("signed-channel", 512, True, 128),
        ("signed-g64", 64, True, 64),
    ],
)
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@needs_w8
def test_8bit_weights_run_w8a8_tiles_for_bfloat16(desc, group, signed, kernel_group, rows):
    """GPTQ / compressed-tensors 8-bit levels (unsigned with zeros, or signed: zero 0) in groups or per
    channel (kept in groups of 128): x rounded to int8 per row and group, then exact up to float32 sums."""
    w = random_int8(N, 512, group, seed=rows + group, signed=signed)
    kernel = choose_kernel(w, CPU, torch.bfloat16)
    assert isinstance(kernel, W8A8TilesKernel) and kernel.label == "w8a8-tiles"
    assert kernel.group_size == kernel_group
    x = torch.randn(rows, 512).to(torch.bfloat16)
    assert_matches(kernel(x), w, as_rounded(kernel, x))


@needs_w8
def test_8bit_weights_it_does_not_take_keep_their_kernels():
    w = random_int8(N, 512, 512, seed=1, signed=True)
    assert isinstance(choose_kernel(w, CPU, torch.float32), Int8CpuKernel)  # NOTE: float32 activations
    w8a8 = QuantizedWeight(w.q, w.scales, None, 512, 8, None, True)  # the format rounds x per token itself
    assert isinstance(choose_kernel(w8a8, CPU, torch.bfloat16), Int8W8A8CpuKernel)
    odd = random_int8(N, 40, 40, seed=2)  # NOTE: a per-channel K of 40: no group of a multiple of 16
    assert not W8A8TilesKernel.fits(odd) and isinstance(choose_kernel(odd, CPU, torch.bfloat16), DequantizeKernel)
