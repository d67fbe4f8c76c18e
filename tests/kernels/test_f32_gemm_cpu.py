"""The CPU float32 GEMM (kernels/f32_gemm_avx2.c through kernels/bf16_gemm_cpu.py) against a
float64 reference, and where the engine packs float32 weights for it."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import bf16_gemm_cpu
from pagedllm.server.worker.models.cpu_linear import linear, pack_weight, packed_kernel, takes_tiles

runs_here = pytest.mark.skipif(
    not bf16_gemm_cpu.runs("avx2-f32"), reason="needs an x86-64 CPU with AVX2 and FMA, numba and a C compiler"
)


def close_to_reference(out: torch.Tensor, x, weight, bias=None) -> None:
    """Within k float32 roundings of the sum of magnitudes of the float64 product."""
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ weight.double().abs().T + (0 if bias is None else bias.double().abs())
    error = (out.double() - exact).abs()
    assert (error <= scale * x.shape[-1] * 2**-24 + 1e-30).all(), error.max()


def test_pack_f32_is_a_permutation_of_the_weight():
    w = torch.randn(48, 35)
    packed = bf16_gemm_cpu.pack_f32(w)
    assert packed.shape == w.shape and packed.dtype == torch.float32 and packed.data_ptr() % 64 == 0
    assert torch.equal(bf16_gemm_cpu.unpack(packed), w)
    assert packed.reshape(3, 35, 16)[2, 5, 7] == w[2 * 16 + 7, 5]  # block b, input i, column c


@pytest.mark.parametrize(
    "shape", [(16, 1), (48, 35), (80, 64), (64 * 3 + 16 * 3, 96), (1536, 512)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 37])
@pytest.mark.parametrize("with_bias", [False, True])
@runs_here
def test_gemm_f32_matches_the_reference(shape, rows, with_bias):
    torch.manual_seed(rows * 1000 + shape[0] + shape[1])
    n, k = shape
    w, x = torch.randn(n, k), torch.randn(rows, k)
    bias = torch.randn(n) if with_bias else None
    out = bf16_gemm_cpu.gemm(x, bf16_gemm_cpu.pack_f32(w), bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    close_to_reference(out, x, w, bias)


@pytest.mark.parametrize("rows", [192, 193, 389])
@runs_here
def test_gemm_f32_prefill_rows_in_chunks(rows):
    """Over 2 x 96 rows the kernel takes 96 at a time over every block: the chunks' edges, a short last one."""
    torch.manual_seed(rows)
    w, x, bias = torch.randn(80, 64), torch.randn(rows, 64), torch.randn(80)
    close_to_reference(bf16_gemm_cpu.gemm(x, bf16_gemm_cpu.pack_f32(w), bias), x, w, bias)


@pytest.mark.parametrize("threads", [1, 2, 3])
@runs_here
def test_gemm_f32_every_thread_count_writes_every_column(threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w, x = torch.randn(16 * 7, 256), torch.randn(5, 256)
        assert 5 * 16 * 7 * 256 >= bf16_gemm_cpu.PARALLEL_MIN_WORK  # NOTE: large enough to go parallel
        close_to_reference(bf16_gemm_cpu.gemm(x, bf16_gemm_cpu.pack_f32(w)), x, w)
    finally:
        torch.set_num_threads(previous)


@runs_here
def test_gemm_f32_takes_views_and_empty_inputs_and_names_bad_ones():
    w = torch.randn(32, 16)
    packed = bf16_gemm_cpu.pack_f32(w)
    x = torch.randn(2, 3, 40)[..., 8:24]  # not contiguous
    out = bf16_gemm_cpu.gemm(x, packed)
    assert out.shape == (2, 3, 32)
    close_to_reference(out.reshape(6, 32), x.reshape(6, 16), w)
    assert bf16_gemm_cpu.gemm(torch.empty(0, 16), packed).shape == (0, 32)
    with pytest.raises(ValueError, match=r"x must be float32 \[..., 16\]"):
        bf16_gemm_cpu.gemm(x.to(torch.bfloat16), packed)
    with pytest.raises(ValueError, match=r"bias must be float32 \[32\]"):
        bf16_gemm_cpu.gemm(x, packed, torch.zeros(32, dtype=torch.float64))
    with pytest.raises(ValueError, match="rows a multiple of 16, got \\(24, 16\\)"):
        bf16_gemm_cpu.pack_f32(torch.randn(24, 16))


def test_the_engine_packs_float32_weights_for_it_only_where_avx512_is_absent(monkeypatch):
    """float32 weights go to the kernel on an AVX2 CPU without AVX-512, to oneDNN elsewhere."""
    w, x = torch.randn(64, 48), torch.randn(5, 48)
    packed = pack_weight(w)
    if bf16_gemm_cpu.f32_available():
        assert takes_tiles(w) and packed_kernel(packed) == "f32-tiles"
    else:
        assert not takes_tiles(w) and packed_kernel(packed) == "onednn-packed"
    close_to_reference(linear(x, packed), x, w)
    assert not takes_tiles(torch.randn(40, 48))  # rows not a multiple of 16: oneDNN
    monkeypatch.setattr(bf16_gemm_cpu, "cpu_has_avx512f", lambda: True)
    bf16_gemm_cpu.f32_available.cache_clear()
    try:
        assert not bf16_gemm_cpu.f32_available() and not takes_tiles(w)
        assert packed_kernel(pack_weight(w)) == "onednn-packed"
    finally:
        bf16_gemm_cpu.f32_available.cache_clear()
